package integration

import (
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

// The sample ValidatingAdmissionPolicy of docs/security.md, applied as a platform team would:
// host directories are refused in a tenant namespace, in each place a PDCluster can name one,
// with its message; a PDCluster without one, and any PDCluster elsewhere, is admitted.
func TestSampleAdmissionPolicyRefusesHostPaths(t *testing.T) {
	f := newFixture(t)
	raw, err := os.ReadFile(filepath.Join("..", "..", "config", "samples", "security", "deny-host-paths.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	policy, binding := &admissionv1.ValidatingAdmissionPolicy{}, &admissionv1.ValidatingAdmissionPolicyBinding{}
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(raw), 4096)
	for _, obj := range []client.Object{policy, binding} {
		if err := dec.Decode(obj); err != nil {
			t.Fatalf("decode the sample: %v", err)
		}
		if err := f.c.Create(f.ctx, obj); err != nil {
			t.Fatalf("apply the sample's %s: %v", obj.GetName(), err)
		}
		t.Cleanup(func() { _ = f.c.Delete(f.ctx, obj) })
	}
	if err := dec.Decode(&struct{}{}); !errors.Is(err, io.EOF) {
		t.Fatalf("the sample holds more than a policy and its binding: %v", err)
	}
	tenant := &corev1.Namespace{}
	f.get(tenant, f.ns)
	tenant.Labels = map[string]string{"serving.pdcluster.dev/tenant": "true"}
	if err := f.c.Update(f.ctx, tenant); err != nil {
		t.Fatal(err)
	}
	hostVolume := []corev1.Volume{{Name: "host", VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: "/etc"}}}}
	cases := []struct {
		name, want string
		edit       func(*v1alpha1.PDCluster)
	}{
		{"model on a host path", "spec.model.hostPath is not allowed", func(p *v1alpha1.PDCluster) {
			p.Spec.Model.HostPath = &v1alpha1.HostPathModelSource{Path: "/models"}
		}},
		{"engine volume", "spec.engine.pod.volumes", func(p *v1alpha1.PDCluster) {
			p.Spec.Engine.Pod = &v1alpha1.PodSettings{Volumes: hostVolume}
		}},
		{"prefill volume", "spec.prefill.pod.volumes", func(p *v1alpha1.PDCluster) {
			p.Spec.Prefill.Pod = &v1alpha1.PodSettings{Volumes: hostVolume}
		}},
		{"decode volume", "spec.decode.pod.volumes", func(p *v1alpha1.PDCluster) {
			p.Spec.Decode.Pod = &v1alpha1.PodSettings{Volumes: hostVolume}
		}},
		{"no host path", "", func(p *v1alpha1.PDCluster) {
			p.Spec.Decode.Pod = &v1alpha1.PodSettings{Volumes: []corev1.Volume{{Name: "scratch", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}}}}
		}},
	}
	// The API server loads a new policy within a second or so: until then, creates pass.
	var err0 error
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		probe := wrappers.MakePDCluster(f.ns, "probe").Obj()
		cases[0].edit(probe)
		if err0 = f.c.Create(f.ctx, probe); err0 != nil {
			break
		}
		_ = f.c.Delete(f.ctx, probe)
	}
	if err0 == nil {
		t.Fatal("the policy was not enforced within 30 s")
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for _, ns := range []struct {
				name   string
				tenant bool
			}{{f.ns, true}, {"default", false}} {
				p := wrappers.MakePDCluster(ns.name, "hp-"+string(rune('a'+i))).Obj()
				p.Spec.Prefill.Replicas = ptr.To[int32](1)
				tc.edit(p)
				err := f.c.Create(f.ctx, p)
				if err == nil {
					_ = f.c.Delete(f.ctx, p)
				}
				switch {
				case !ns.tenant || tc.want == "":
					if err != nil {
						t.Errorf("namespace %s: refused: %v", ns.name, err)
					}
				case !apierrors.IsInvalid(err) && !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), tc.want):
					t.Errorf("namespace %s: got %v, want a refusal saying %q", ns.name, err, tc.want)
				}
			}
		})
	}
}
