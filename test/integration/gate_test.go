package integration

import (
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

// The completion-gate plugin's ConfigMap is created with the PDCluster, owned by it, put back
// when edited; turning the gate off says so in a condition and a Warning event.
func TestCompletionGateConfigMap(t *testing.T) {
	f := newFixture(t)
	pdc := wrappers.MakePDCluster(f.ns, "gate").Obj()
	if err := f.c.Create(f.ctx, pdc); err != nil {
		t.Fatal(err)
	}
	// Deleted at the end, so its series leave the operator's metrics that other tests read.
	t.Cleanup(func() {
		if err := f.c.Delete(f.ctx, pdc); err == nil {
			f.reconcile("gate")
		}
	})
	f.reconcile("gate")
	var cm corev1.ConfigMap
	f.get(&cm, render.GateObjectName("gate"))
	if owner := metav1.GetControllerOf(&cm); owner == nil || owner.Kind != "PDCluster" || owner.Name != "gate" {
		t.Errorf("ConfigMap owner = %+v, want the PDCluster", owner)
	}
	if cm.Data["mooncake.py"] != vllm.Files()["mooncake.py"] {
		t.Error("ConfigMap does not hold the embedded plugin")
	}
	f.get(pdc, "gate")
	if c := condition(pdc, v1alpha1.ConditionCompletionGated); c.Status != metav1.ConditionTrue {
		t.Errorf("CompletionGated = %+v, want True", c)
	}

	cm.Data["mooncake.py"] = "# edited by hand"
	if err := f.c.Update(f.ctx, &cm); err != nil {
		t.Fatal(err)
	}
	f.events()
	f.reconcile("gate")
	f.get(&cm, render.GateObjectName("gate"))
	if cm.Data["mooncake.py"] != vllm.Files()["mooncake.py"] {
		t.Error("an edited plugin was not put back")
	}

	f.get(pdc, "gate")
	pdc.Spec.KVTransfer.CompletionGate = v1alpha1.CompletionGateDisabled
	if err := f.c.Update(f.ctx, pdc); err != nil {
		t.Fatal(err)
	}
	f.events()
	f.reconcile("gate")
	f.get(pdc, "gate")
	if c := condition(pdc, v1alpha1.ConditionCompletionGated); c.Status != metav1.ConditionFalse || c.Reason != v1alpha1.ReasonGateDisabled {
		t.Errorf("CompletionGated = %+v, want False/GateDisabled", c)
	}
	got := strings.Join(f.events(), "\n")
	for _, want := range []string{"Warning " + v1alpha1.ReasonGateDisabled, "Normal Deleted deleted ConfigMap gate-pdgate"} {
		if !strings.Contains(got, want) {
			t.Errorf("events %q lack %q", got, want)
		}
	}
	if err := f.c.Get(f.ctx, client.ObjectKey{Namespace: f.ns, Name: render.GateObjectName("gate")}, &cm); !apierrors.IsNotFound(err) {
		t.Errorf("the unused plugin ConfigMap is still there (err %v)", err)
	}
}
