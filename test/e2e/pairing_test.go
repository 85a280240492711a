package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

const rackLabel = "pdcluster.dev/e2e-rack"

// pairsByRack labels the kwok GPU nodes with two racks, turns spec.scheduling.pairing on,
// and checks what the operator made of it, then turns it off again.
func (e *env) pairsByRack(t *testing.T) {
	var nodes corev1.NodeList
	if err := e.c.List(e.ctx, &nodes, client.MatchingLabels{"pdcluster.dev/gpu-pool": "true"}); err != nil {
		t.Fatal(err)
	}
	racks := map[string]string{}
	for i, n := range nodes.Items {
		racks[n.Name] = fmt.Sprintf("rack-%d", i%2)
		e.run("label", "--overwrite", "node", n.Name, rackLabel+"="+racks[n.Name])
	}
	defer func() {
		for name := range racks {
			e.run("label", "node", name, rackLabel+"-")
		}
	}()
	e.patch(`{"scheduling":{"pairing":{"topologyKey":"` + rackLabel + `"}}}`)
	e.eventually("every engine pod labelled with its node's rack, the router pairing by rack", func() error {
		if err := e.ready(2, 3); err != nil {
			return err
		}
		p := e.pdc()
		for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode} {
			for _, pod := range e.pods(role) {
				if got, want := pod.Labels[v1alpha1.LabelDomain], racks[pod.Spec.NodeName]; got != want {
					return fmt.Errorf("pod %s on %s has domain %q, want %q", pod.Name, pod.Spec.NodeName, got, want)
				}
				aff := pod.Spec.Affinity
				if aff == nil || aff.PodAffinity == nil || !slices.ContainsFunc(aff.PodAffinity.PreferredDuringSchedulingIgnoredDuringExecution,
					func(w corev1.WeightedPodAffinityTerm) bool { return w.PodAffinityTerm.TopologyKey == rackLabel }) {
					return fmt.Errorf("pod %s does not prefer the other pool's racks: %+v", pod.Name, aff)
				}
			}
		}
		var cm corev1.ConfigMap
		if err := e.c.Get(e.ctx, client.ObjectKey{Namespace: sampleNS, Name: sampleName + "-router"}, &cm); err != nil {
			return err
		}
		var file routerconfig.File
		if err := json.Unmarshal([]byte(cm.Data[routerconfig.FileName]), &file); err != nil {
			return err
		}
		if file.Pairing == nil || file.Pairing.Mode != routerconfig.PairingPreferred || len(file.Domains) != 2 {
			return fmt.Errorf("router.json pairing %+v, domains %+v: want Preferred over 2 racks", file.Pairing, file.Domains)
		}
		// Each rack's Services list that rack's pods.
		for _, d := range file.Domains {
			for role, host := range map[v1alpha1.Role]string{v1alpha1.RolePrefill: d.PrefillHost, v1alpha1.RoleDecode: d.DecodeHost} {
				var svc corev1.Service
				name := host[:len(host)-len("."+sampleNS+".svc")]
				if err := e.c.Get(e.ctx, client.ObjectKey{Namespace: sampleNS, Name: name}, &svc); err != nil {
					return err
				}
				if svc.Spec.Selector[v1alpha1.LabelDomain] != d.Domain || svc.Spec.Selector[v1alpha1.LabelRole] != string(role) {
					return fmt.Errorf("Service %s selects %v, want %s pods of %s", name, svc.Spec.Selector, role, d.Domain)
				}
			}
		}
		if p.Status.Pairing == nil || p.Status.Pairing.Domains != 2 {
			return fmt.Errorf("status.pairing %+v, want 2 domains", p.Status.Pairing)
		}
		return nil
	})
	e.patch(`{"scheduling":null}`)
	e.eventually("pairing off: no domain Service left", func() error {
		var svcs corev1.ServiceList
		if err := e.c.List(e.ctx, &svcs, client.InNamespace(sampleNS), client.HasLabels{v1alpha1.LabelDomain}); err != nil {
			return err
		}
		if len(svcs.Items) > 0 {
			return fmt.Errorf("%d domain Services left", len(svcs.Items))
		}
		if e.pdc().Status.Pairing != nil {
			return fmt.Errorf("status.pairing still %+v", e.pdc().Status.Pairing)
		}
		return e.ready(2, 3)
	})
}

// pairsOnOneNode turns pairing on by node (kubernetes.io/hostname), Required: both pools run
// on the real node, so every request's pair is same-domain, as the routers count and
// status.pairing reports.
func (r realNode) pairsOnOneNode(t *testing.T) {
	r.patchReal(t, `{"scheduling":{"pairing":{"topologyKey":"kubernetes.io/hostname","mode":"Required"}}}`)
	defer r.patchReal(t, `{"scheduling":null}`)
	r.eventually("the router pairs by node", func() error {
		code, _, err := r.complete(words(40), 2)
		if err != nil || code != http.StatusOK {
			return fmt.Errorf("completion: %d %v", code, err)
		}
		p := r.pdc().Status.Pairing
		// Every node is a domain of its own (the kwok ones too); both pools run on the real one.
		if p == nil || p.Domains < 2 || p.SameDomainPairs == 0 || p.CrossDomainPairs != 0 || p.SameDomainPercent == nil || *p.SameDomainPercent != 100 {
			return fmt.Errorf("status.pairing %+v: want a domain per node and only same-domain pairs", p)
		}
		return nil
	})
}
