// Pairing by topology: a headless Service per pool, revision and domain, which the router
// reads to pair a request's prefill and decode within one domain.

package render

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// DomainServiceName is the name of the Service of the pods of domain behind the revision
// Service named service: <service>-<hash of the domain> (a node label value need not be a DNS
// label), shortened with a hash of the whole name past 63 characters.
func DomainServiceName(service, domain string) string {
	sum := sha256.Sum256([]byte(domain))
	full := service + "-" + hex.EncodeToString(sum[:])[:8]
	if len(full) <= maxNameLength {
		return full
	}
	sum = sha256.Sum256([]byte(full))
	h := hex.EncodeToString(sum[:])[:10]
	return service[:maxNameLength-len(h)-1] + "-" + h
}

// domainServices are the Services of each of domains for the revision rev whose pool
// Services are named prefill and decode, and their hosts for router.json.
func domainServices(pdc *v1alpha1.PDCluster, rev, prefill, decode string, domains []string) ([]Object, []routerconfig.DomainHosts) {
	var objs []Object
	var hosts []routerconfig.DomainHosts
	for _, d := range domains {
		h := routerconfig.DomainHosts{Domain: d}
		for _, p := range []struct {
			role v1alpha1.Role
			name string
			host *string
		}{{v1alpha1.RolePrefill, prefill, &h.PrefillHost}, {v1alpha1.RoleDecode, decode, &h.DecodeHost}} {
			svc := EngineService(pdc, p.role, rev, DomainServiceName(p.name, d))
			svc.Labels[v1alpha1.LabelDomain] = d
			svc.Spec.Selector[v1alpha1.LabelDomain] = d
			*p.host = ServiceHost(pdc.Namespace, svc.Name)
			objs = append(objs, svc)
		}
		hosts = append(hosts, h)
	}
	return objs, hosts
}

// serviceName is the Service name of a host ServiceHost made.
func serviceName(namespace, host string) string {
	return strings.TrimSuffix(host, "."+namespace+".svc")
}

// pairingObjects are the domain Services of the update revision and of each older one, and
// router.json's domains for both.
func pairingObjects(pdc *v1alpha1.PDCluster, rev string, serving Serving) ([]Object, []routerconfig.DomainHosts, [][]routerconfig.DomainHosts) {
	if pdc.Spec.Scheduling.Pairing == nil {
		return nil, nil, nil
	}
	objs, update := domainServices(pdc, rev,
		EngineObjectName(pdc.Name, v1alpha1.RolePrefill, rev, !serving.Suffixed), EngineObjectName(pdc.Name, v1alpha1.RoleDecode, rev, !serving.Suffixed), serving.Domains)
	old := make([][]routerconfig.DomainHosts, len(serving.Old))
	for i, o := range serving.Old {
		if o.PrefillHost == "" || o.DecodeHost == "" || o.Revision == UnlabelledRevision {
			continue // a revision missing a pool serves nothing; one without labels cannot be told apart
		}
		more, hosts := domainServices(pdc, o.Revision, serviceName(pdc.Namespace, o.PrefillHost), serviceName(pdc.Namespace, o.DecodeHost), serving.Domains)
		objs, old[i] = append(objs, more...), hosts
	}
	return objs, update, old
}

// UnlabelledRevision names, in router.json, the revision of pods made before the KV-revision
// label.
const UnlabelledRevision = "unlabelled"

// pairingAffinity makes a pool's pods prefer the domains where the other pool's pods run.
func pairingAffinity(pdc *v1alpha1.PDCluster, role v1alpha1.Role, pod *corev1.PodSpec) {
	p := pdc.Spec.Scheduling.Pairing
	if p == nil {
		return
	}
	other := v1alpha1.RoleDecode
	if role == v1alpha1.RoleDecode {
		other = v1alpha1.RolePrefill
	}
	pod.Affinity = pod.Affinity.DeepCopy() // the user's, from spec: not to be changed in place
	if pod.Affinity == nil {
		pod.Affinity = &corev1.Affinity{}
	}
	if pod.Affinity.PodAffinity == nil {
		pod.Affinity.PodAffinity = &corev1.PodAffinity{}
	}
	pa := pod.Affinity.PodAffinity
	pa.PreferredDuringSchedulingIgnoredDuringExecution = append(pa.PreferredDuringSchedulingIgnoredDuringExecution, corev1.WeightedPodAffinityTerm{
		Weight: 50,
		PodAffinityTerm: corev1.PodAffinityTerm{
			LabelSelector: &metav1.LabelSelector{MatchLabels: Labels(pdc.Name, other)},
			TopologyKey:   p.TopologyKey,
		},
	})
}
