package controllers

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
)

// +kubebuilder:rbac:groups="",resources=nodes,verbs=get;list;watch

// topology is what pairing reads of the nodes: each node's domain (its value of
// spec.scheduling.pairing.topologyKey) and the domains, sorted.
type topology struct {
	byNode  map[string]string
	domains []string
}

// observeTopology reads the nodes' domains when the PDCluster pairs by topology. Nodes are
// read as metadata only (their labels), from the cache.
func (r *PDClusterReconciler) observeTopology(ctx context.Context, pdc *v1alpha1.PDCluster) (topology, error) {
	p := pdc.Spec.Scheduling.Pairing
	if p == nil {
		return topology{}, nil
	}
	var nodes metav1.PartialObjectMetadataList
	nodes.SetGroupVersionKind(corev1.SchemeGroupVersion.WithKind("NodeList"))
	if err := r.List(ctx, &nodes, client.HasLabels{p.TopologyKey}); err != nil {
		return topology{}, fmt.Errorf("list nodes for spec.scheduling.pairing: %w", err)
	}
	t := topology{byNode: map[string]string{}}
	for _, n := range nodes.Items {
		if d := n.Labels[p.TopologyKey]; d != "" {
			t.byNode[n.Name] = d
		}
	}
	t.domains = slices.Sorted(maps.Values(t.byNode))
	t.domains = slices.Compact(t.domains)
	return t, nil
}

// labelDomains gives each bound engine pod its node's domain (serving.pdcluster.dev/domain),
// which its domain's Service selects; a pod whose node has none gets no label. Pods already
// labelled right are not written.
func (r *PDClusterReconciler) labelDomains(ctx context.Context, pdc *v1alpha1.PDCluster, pods []corev1.Pod, t topology) error {
	var errs []error
	for i := range pods {
		pod := &pods[i]
		role := v1alpha1.Role(pod.Labels[v1alpha1.LabelRole])
		if (role != v1alpha1.RolePrefill && role != v1alpha1.RoleDecode) || pod.Spec.NodeName == "" || pod.DeletionTimestamp != nil {
			continue
		}
		want := ""
		if pdc.Spec.Scheduling.Pairing != nil {
			want = t.byNode[pod.Spec.NodeName]
		}
		if have, ok := pod.Labels[v1alpha1.LabelDomain]; have == want && (ok || want == "") {
			continue
		}
		patched := pod.DeepCopy()
		if want == "" {
			delete(patched.Labels, v1alpha1.LabelDomain)
		} else {
			patched.Labels[v1alpha1.LabelDomain] = want
		}
		if err := r.Patch(ctx, patched, client.MergeFrom(pod)); client.IgnoreNotFound(err) != nil {
			errs = append(errs, fmt.Errorf("label pod %s with its domain: %w", pod.Name, err))
		}
	}
	return errors.Join(errs...)
}

// pairingStatus writes status.pairing: the domains and the routers' pairs by locality. Counts
// the routers did not answer keep what status said.
func pairingStatus(status *v1alpha1.PDClusterStatus, in statusInputs) {
	if in.pdc.Spec.Scheduling.Pairing == nil {
		status.Pairing = nil
		return
	}
	ps := v1alpha1.PairingStatus{Domains: int32(len(in.topo.domains))}
	if status.Pairing != nil {
		ps.SameDomainPairs, ps.CrossDomainPairs, ps.SameDomainPercent = status.Pairing.SameDomainPairs, status.Pairing.CrossDomainPairs, status.Pairing.SameDomainPercent
	}
	if pc := in.obs.pairs; pc != nil {
		ps.SameDomainPairs, ps.CrossDomainPairs, ps.SameDomainPercent = pc.SameDomain, pc.CrossDomain, percentOf(pc.SameDomain, pc.CrossDomain)
	}
	status.Pairing = &ps
}
