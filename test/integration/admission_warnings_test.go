package integration

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	admissionv1 "k8s.io/api/admissionregistration/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

// warnings records the API server's Warning headers.
type warnings struct {
	mu   sync.Mutex
	text []string
}

func (w *warnings) HandleWarningHeader(_ int, _ string, text string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.text = append(w.text, text)
}

func (w *warnings) take() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := w.text
	w.text = nil
	return out
}

// TestAdmissionWarningsMatchPdctl: the operator's ValidatingAdmissionPolicy, as shipped in
// config/admission, warns of replicas written for an External pool, admits the PDCluster, and
// says what (*PDCluster).Warnings (pdctl validate) says; nothing for a PDCluster without them.
func TestAdmissionWarningsMatchPdctl(t *testing.T) {
	f := newFixture(t)
	raw, err := os.ReadFile(filepath.Join("..", "..", "config", "admission", "scaling-warnings.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	policy, binding := &admissionv1.ValidatingAdmissionPolicy{}, &admissionv1.ValidatingAdmissionPolicyBinding{}
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(raw), 4096)
	for _, obj := range []client.Object{policy, binding} {
		if err := dec.Decode(obj); err != nil {
			t.Fatal(err)
		}
		// Only this test's namespace: the other tests' PDClusters are not warned of.
		if b, ok := obj.(*admissionv1.ValidatingAdmissionPolicyBinding); ok {
			b.Spec.MatchResources = &admissionv1.MatchResources{NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"kubernetes.io/metadata.name": f.ns}}}
		}
		if err := f.c.Create(f.ctx, obj); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = f.c.Delete(f.ctx, obj) })
	}
	w := &warnings{}
	wcfg := rest.CopyConfig(cfg)
	wcfg.WarningHandler = w
	c, err := client.New(wcfg, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatal(err)
	}
	external := func(name string, prefill, decode *int32) *v1alpha1.PDCluster {
		p := wrappers.MakePDCluster(f.ns, name).Obj()
		p.Spec.Prefill.Replicas, p.Spec.Decode.Replicas = prefill, decode
		p.Spec.Scaling.Prefill.Mode = v1alpha1.ScalingExternal
		p.Spec.Scaling.Decode.Mode = v1alpha1.ScalingExternal
		return p
	}
	// graced sets engine.pod.terminationGracePeriodSeconds, prefill.pod's when prefill > 0, and
	// decode's drain timeout when set.
	graced := func(name string, engine, prefill int64, decodeDrain *int32) *v1alpha1.PDCluster {
		p := wrappers.MakePDCluster(f.ns, name).Obj()
		p.Spec.Engine.Pod = &v1alpha1.PodSettings{TerminationGracePeriodSeconds: ptr.To(engine)}
		if prefill > 0 {
			p.Spec.Prefill.Pod = &v1alpha1.PodSettings{TerminationGracePeriodSeconds: ptr.To(prefill)}
		}
		p.Spec.Decode.Drain.TimeoutSeconds = decodeDrain
		return p
	}
	cases := []struct {
		name string
		pdc  *v1alpha1.PDCluster
		want int // warnings
	}{
		{"External pools with replicas in Git", external("git", ptr.To[int32](3), ptr.To[int32](0)), 2},
		{"External pools without", external("clean", nil, nil), 0},
		{"Static pools with replicas", wrappers.MakePDCluster(f.ns, "static").Replicas(2, 2).Obj(), 0},
		{"a grace period shorter than both pools' drains", graced("short", 60, 0, nil), 2},
		{"a grace period that covers the drains", graced("covers", 200, 0, nil), 0},
		{"the pool's grace period wins; decode's drain is longer than the engine's", graced("pool", 30, 300, ptr.To[int32](60)), 1},
	}
	for _, tc := range cases {
		// Gone after the test: the manager test reads every PDCluster's metrics.
		t.Cleanup(func() { _ = c.Delete(f.ctx, tc.pdc.DeepCopy()) })
		t.Run(tc.name, func(t *testing.T) {
			// The policy's informer may take a moment to see the binding: until the first
			// warning arrives, a PDCluster that must warn is retried.
			var got []string
			eventually(t, "the policy warns", func() error {
				_ = c.Delete(f.ctx, tc.pdc.DeepCopy())
				if err := c.Create(f.ctx, tc.pdc.DeepCopy()); err != nil {
					return err
				}
				got = w.take()
				if len(got) < tc.want {
					return fmt.Errorf("%d warnings so far: %q", len(got), got)
				}
				return nil
			})
			want := tc.pdc.Warnings()
			if len(want) != tc.want {
				t.Fatalf("Warnings() = %q, want %d", want, tc.want)
			}
			for i := range got {
				// "Validation failed for ValidatingAdmissionPolicy 'x' with binding 'x': <message>"
				if _, msg, ok := strings.Cut(got[i], "': "); ok {
					got[i] = msg
				}
			}
			if d := cmp.Diff(want, got, cmpopts.EquateEmpty()); d != "" {
				t.Errorf("API server warnings (-pdctl +API server):\n%s", d)
			}
		})
	}
}
