package render_test

import (
	"path/filepath"
	"testing"

	"github.com/google/go-cmp/cmp"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/pod-security-admission/api"
	"k8s.io/pod-security-admission/policy"
	lwsv1 "sigs.k8s.io/lws/api/leaderworkerset/v1"

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
	forbidden := func(t *corev1.PodTemplateSpec, level api.Level) []string {
		var out []string
		for _, r := range eval.EvaluatePod(api.LevelVersion{Level: level, Version: api.LatestVersion()}, &t.ObjectMeta, &t.Spec) {
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
			roles := map[v1alpha1.Role]bool{}
			for _, pod := range podTemplates(objs) {
				roles[pod.role] = true
				if pod.role == v1alpha1.RoleRouter {
					if got := forbidden(pod.t, api.LevelRestricted); len(got) != 0 {
						t.Errorf("router pod is not restricted: %q", got)
					}
					continue
				}
				var want []string
				if pdc.Spec.KVTransfer.Protocol == v1alpha1.ProtocolRDMA {
					want = []string{`non-default capabilities: container "engine" must not include "IPC_LOCK" in securityContext.capabilities.add`}
				}
				if d := cmp.Diff(want, forbidden(pod.t, api.LevelBaseline)); d != "" {
					t.Errorf("%s pod under baseline (-want +got):\n%s", pod.name, d)
				}
				// The operator's own containers in the pod (the sidecar, the launcher's init
				// container), alone, meet restricted: they run as a non-root user whatever
				// their image says.
				alone := pod.t.DeepCopy()
				alone.Spec.Containers = nil
				for _, c := range pod.t.Spec.Containers {
					if c.Name == v1alpha1.ConnectorContainerName {
						alone.Spec.Containers = append(alone.Spec.Containers, c)
					}
				}
				if len(alone.Spec.Containers) != 1 {
					t.Fatalf("%s pod has no %s container", pod.name, v1alpha1.ConnectorContainerName)
				}
				if got := forbidden(alone, api.LevelRestricted); len(got) != 0 {
					t.Errorf("%s pod's own containers are not restricted: %q", pod.name, got)
				}
				for _, c := range append(pod.t.Spec.InitContainers, pod.t.Spec.Containers...) {
					sc := c.SecurityContext
					if sc == nil || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation ||
						sc.Capabilities == nil || !cmp.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
						t.Errorf("%s/%s security context %+v: want no privilege escalation and every capability dropped", pod.name, c.Name, sc)
					}
				}
			}
			if len(roles) != 3 {
				t.Fatalf("pods of %v, want prefill, decode and router", roles)
			}
		})
	}
}

// renderedPod is a pod template render produced: a Deployment's, a LeaderWorkerSet's leader's
// or worker's.
type renderedPod struct {
	role v1alpha1.Role
	name string
	t    *corev1.PodTemplateSpec
}

func podTemplates(objs []render.Object) []renderedPod {
	var out []renderedPod
	for _, o := range objs {
		role := v1alpha1.Role(o.GetLabels()[v1alpha1.LabelRole])
		switch x := o.(type) {
		case *appsv1.Deployment:
			out = append(out, renderedPod{role, x.Name, &x.Spec.Template})
		case *lwsv1.LeaderWorkerSet:
			if l := x.Spec.LeaderWorkerTemplate.LeaderTemplate; l != nil {
				out = append(out, renderedPod{role, x.Name + " leader", l})
			}
			out = append(out, renderedPod{role, x.Name + " worker", &x.Spec.LeaderWorkerTemplate.WorkerTemplate})
		}
	}
	return out
}
