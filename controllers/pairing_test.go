package controllers

import (
	"context"
	"testing"

	"github.com/google/go-cmp/cmp"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

const rackKey = "example.com/rack"

// Pairing by topology: each bound engine pod gets its node's rack, each pool a Service per
// rack of the nodes, router.json the racks' Services and the mode; without pairing, the
// Services and labels go.
func TestPairingLabelsPodsAndRendersDomainServices(t *testing.T) {
	p := pdc()
	p.Spec.Scheduling.Pairing = &v1alpha1.PairingSpec{TopologyKey: rackKey, Mode: v1alpha1.PairingRequired}
	f := newRolloutFixture(t, p)
	ctx := context.Background()
	for name, rack := range map[string]string{"n1": "r1", "n2": "r2", "n3": ""} {
		n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{}}}
		if rack != "" {
			n.Labels[rackKey] = rack
		}
		if err := f.c.Create(ctx, n); err != nil {
			t.Fatal(err)
		}
	}
	rev, err := render.KVRevision(p)
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range []*wrappers.PodWrapper{
		wrappers.MakeEnginePod("ns", "p-0", "c", v1alpha1.RolePrefill, start).OnNode("n1"),
		wrappers.MakeEnginePod("ns", "d-0", "c", v1alpha1.RoleDecode, start).OnNode("n2"),
		wrappers.MakeEnginePod("ns", "d-1", "c", v1alpha1.RoleDecode, start).OnNode("n3"),
		wrappers.MakeEnginePod("ns", "d-2", "c", v1alpha1.RoleDecode, start),
	} {
		if err := f.c.Create(ctx, w.KVRevision(rev).Obj()); err != nil {
			t.Fatal(err)
		}
	}
	router := wrappers.MakeEnginePod("ns", "router-0", "c", v1alpha1.RoleRouter, start).Obj()
	if err := f.c.Create(ctx, router); err != nil {
		t.Fatal(err)
	}
	f.r.PairsReader = fakePairs{"router-0": {SameDomain: 3, CrossDomain: 1}}
	f.reconcile()
	var got v1alpha1.PDCluster
	if err := f.c.Get(ctx, client.ObjectKeyFromObject(p), &got); err != nil {
		t.Fatal(err)
	}
	wantStatus := &v1alpha1.PairingStatus{Domains: 2, SameDomainPairs: 3, CrossDomainPairs: 1, SameDomainPercent: ptrTo(75)}
	if d := cmp.Diff(wantStatus, got.Status.Pairing); d != "" {
		t.Errorf("status.pairing (-want +got):\n%s", d)
	}
	domains := func() map[string]string {
		var pods corev1.PodList
		if err := f.c.List(ctx, &pods); err != nil {
			t.Fatal(err)
		}
		out := map[string]string{}
		for _, pod := range pods.Items {
			if d, ok := pod.Labels[v1alpha1.LabelDomain]; ok {
				out[pod.Name] = d
			}
		}
		return out
	}
	if d := cmp.Diff(map[string]string{"p-0": "r1", "d-0": "r2"}, domains()); d != "" {
		t.Errorf("pod domains (-want +got):\n%s", d)
	}
	file := f.routerFile()
	svc := func(pool, rack string) string { return render.DomainServiceName("c-"+pool, rack) }
	want := []routerconfig.DomainHosts{
		{Domain: "r1", PrefillHost: svc("prefill", "r1") + ".ns.svc", DecodeHost: svc("decode", "r1") + ".ns.svc"},
		{Domain: "r2", PrefillHost: svc("prefill", "r2") + ".ns.svc", DecodeHost: svc("decode", "r2") + ".ns.svc"},
	}
	if d := cmp.Diff(want, file.Domains); d != "" || file.Pairing == nil || file.Pairing.Mode != routerconfig.PairingRequired {
		t.Errorf("router.json pairing %+v, domains (-want +got):\n%s", file.Pairing, d)
	}
	var s corev1.Service
	if err := f.c.Get(ctx, client.ObjectKey{Namespace: "ns", Name: svc("decode", "r2")}, &s); err != nil {
		t.Fatal(err)
	}
	wantSel := render.RevisionLabels("c", v1alpha1.RoleDecode, rev)
	wantSel[v1alpha1.LabelDomain] = "r2"
	if d := cmp.Diff(wantSel, s.Spec.Selector); d != "" {
		t.Errorf("rack r2's decode Service selector (-want +got):\n%s", d)
	}
	f.writes = 0
	f.reconcile()
	if f.writes != 0 {
		t.Errorf("a resync wrote %d times, want 0", f.writes)
	}

	if err := f.c.Get(ctx, client.ObjectKeyFromObject(p), p); err != nil {
		t.Fatal(err)
	}
	p.Spec.Scheduling.Pairing = nil
	if err := f.c.Update(ctx, p); err != nil {
		t.Fatal(err)
	}
	f.reconcile()
	if d := domains(); len(d) != 0 {
		t.Errorf("without pairing, pods keep domains %v", d)
	}
	if err := f.c.Get(ctx, client.ObjectKey{Namespace: "ns", Name: svc("decode", "r2")}, &s); err == nil {
		t.Error("without pairing, rack r2's decode Service is still there")
	}
	if file := f.routerFile(); file.Pairing != nil || len(file.Domains) != 0 {
		t.Errorf("router.json without pairing: %+v", file)
	}
	if err := f.c.Get(ctx, client.ObjectKeyFromObject(p), &got); err != nil || got.Status.Pairing != nil {
		t.Errorf("status.pairing without pairing: %+v, %v", got.Status.Pairing, err)
	}
}

type fakePairs map[string]routerconfig.PairCounts

func (f fakePairs) ReadPairs(_ context.Context, pod *corev1.Pod) (routerconfig.PairCounts, error) {
	return f[pod.Name], nil
}
