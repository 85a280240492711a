package render_test

import (
	"path/filepath"
	"testing"

	"github.com/google/go-cmp/cmp"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/pod-security-admission/api"
	"k8s.io/pod-security-admission/policy"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

// Every rendered pod against the Pod Security Standards, with the API server's own checks
// (k8s.io/pod-security-admission): a TCP PDCluster's pods are admitted where baseline is
// enforced, an RDMA one's are refused for IPC_LOCK alone, and the router meets restricted.
func TestPodSecurityStandards(t *testing.T) {
	eval, err := policy.NewEvaluator(policy.DefaultChecks(), nil)
	if err != nil {
		t.Fatal(err)
	}
	forbidden := func(dep *appsv1.Deployment, level api.Level) []string {
		var out []string
		for _, r := range eval.EvaluatePod(api.LevelVersion{Level: level, Version: api.LatestVersion()}, &dep.Spec.Template.ObjectMeta, &dep.Spec.Template.Spec) {
			if !r.Allowed {
				out = append(out, r.ForbiddenReason+": "+r.ForbiddenDetail)
			}
		}
		return out
	}
	for _, in := range testInputs(t) {
		t.Run(filepath.Base(in), func(t *testing.T) {
			pdc := load(t, in)
			objs, err := render.Render(pdc, render.DefaultOptions())
			if err != nil {
				t.Fatal(err)
			}
			n := 0
			for _, o := range objs {
				dep, ok := o.(*appsv1.Deployment)
				if !ok {
					continue
				}
				n++
				role := v1alpha1.Role(dep.Labels[v1alpha1.LabelRole])
				if role == v1alpha1.RoleRouter {
					if got := forbidden(dep, api.LevelRestricted); len(got) != 0 {
						t.Errorf("router pod is not restricted: %q", got)
					}
					continue
				}
				var want []string
				if pdc.Spec.KVTransfer.Protocol == v1alpha1.ProtocolRDMA {
					want = []string{`non-default capabilities: container "engine" must not include "IPC_LOCK" in securityContext.capabilities.add`}
				}
				if d := cmp.Diff(want, forbidden(dep, api.LevelBaseline)); d != "" {
					t.Errorf("%s pod under baseline (-want +got):\n%s", role, d)
				}
				// The operator's own container in the pod, alone, meets restricted: it runs as
				// a non-root user whatever its image says.
				alone := dep.DeepCopy()
				alone.Spec.Template.Spec.Containers = nil
				for _, c := range dep.Spec.Template.Spec.Containers {
					if c.Name == v1alpha1.ConnectorContainerName {
						alone.Spec.Template.Spec.Containers = append(alone.Spec.Template.Spec.Containers, c)
					}
				}
				if len(alone.Spec.Template.Spec.Containers) != 1 {
					t.Fatalf("%s pod has no %s container", role, v1alpha1.ConnectorContainerName)
				}
				if got := forbidden(alone, api.LevelRestricted); len(got) != 0 {
					t.Errorf("%s pod's sidecar is not restricted: %q", role, got)
				}
				for _, c := range dep.Spec.Template.Spec.Containers {
					sc := c.SecurityContext
					if sc == nil || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation ||
						sc.Capabilities == nil || !cmp.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
						t.Errorf("%s/%s security context %+v: want no privilege escalation and every capability dropped", role, c.Name, sc)
					}
				}
			}
			if n != 3 {
				t.Fatalf("%d Deployments, want prefill, decode and router", n)
			}
		})
	}
}
