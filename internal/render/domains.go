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
	return fitLabel(service, service+"-"+hex.EncodeToString(sum[:])[:8])
}

// pairedRevision is a running revision whose pools get a Service per domain: its pool
// Services' names, and which of serving.Old it is (-1: the update revision).
type pairedRevision struct {
	rev, prefill, decode string
	old                  int
}

// pairedRevisions are the update revision and each older one that can be paired by domain;
// none without pairing.
func pairedRevisions(pdc *v1alpha1.PDCluster, rev string, serving Serving) []pairedRevision {
	if pdc.Spec.Scheduling.Pairing == nil {
		return nil
	}
	out := []pairedRevision{{rev, EngineObjectName(pdc.Name, v1alpha1.RolePrefill, rev, !serving.Suffixed), EngineObjectName(pdc.Name, v1alpha1.RoleDecode, rev, !serving.Suffixed), -1}}
	for i, o := range serving.Old {
		if o.PrefillHost == "" || o.DecodeHost == "" || o.Revision == UnlabelledRevision {
			continue // a revision missing a pool serves nothing; one without labels cannot be told apart
		}
		out = append(out, pairedRevision{o.Revision, serviceName(pdc.Namespace, o.PrefillHost), serviceName(pdc.Namespace, o.DecodeHost), i})
	}
	return out
}

// domainHosts are router.json's domains of r.
func domainHosts(namespace string, r pairedRevision, domains []string) []routerconfig.DomainHosts {
	var out []routerconfig.DomainHosts
	for _, d := range domains {
		out = append(out, routerconfig.DomainHosts{Domain: d,
			PrefillHost: ServiceHost(namespace, DomainServiceName(r.prefill, d)), DecodeHost: ServiceHost(namespace, DomainServiceName(r.decode, d))})
	}
	return out
}

// domainServices are the Services of each domain of each of revs.
func domainServices(pdc *v1alpha1.PDCluster, revs []pairedRevision, domains []string) []Object {
	var objs []Object
	for _, r := range revs {
		for _, d := range domains {
			for _, p := range []struct {
				role v1alpha1.Role
				name string
			}{{v1alpha1.RolePrefill, r.prefill}, {v1alpha1.RoleDecode, r.decode}} {
				svc := engineService(pdc, p.role, r.rev, DomainServiceName(p.name, d))
				svc.Labels[v1alpha1.LabelDomain] = d
				svc.Spec.Selector[v1alpha1.LabelDomain] = d
				objs = append(objs, svc)
			}
		}
	}
	return objs
}

// serviceName is the Service name of a host ServiceHost made.
func serviceName(namespace, host string) string {
	return strings.TrimSuffix(host, "."+namespace+".svc")
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
