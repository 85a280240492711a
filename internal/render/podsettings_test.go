package render_test

import (
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/utils/ptr"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

// The router's own scheduling and resources come from spec.router; unset, small defaults.
func TestRouterPodSettings(t *testing.T) {
	pdc := load(t, "testdata/mooncake-rdma.yaml")
	_, dep := wrappers.RenderRouter(t, pdc)
	pod := dep.Spec.Template.Spec
	if got := pod.Containers[0].Resources.Requests.Cpu().String(); got != "2" {
		t.Errorf("router cpu request %s, want 2 from spec.router.resources", got)
	}
	if d := cmp.Diff(map[string]string{"node-role.kubernetes.io/ingress": ""}, pod.NodeSelector); d != "" {
		t.Errorf("nodeSelector (-want +got):\n%s", d)
	}
	if len(pod.Tolerations) != 1 || pod.Tolerations[0].Key != "dedicated" {
		t.Errorf("tolerations %+v", pod.Tolerations)
	}
	pdc.Spec.Router = v1alpha1.RouterSpec{}
	_, dep = wrappers.RenderRouter(t, pdc)
	if got := dep.Spec.Template.Spec.Containers[0].Resources.Requests.Memory().String(); got != "128Mi" {
		t.Errorf("default router memory request %s, want 128Mi", got)
	}
}

// Engine pods mount no ServiceAccount token (nothing in them talks to the API server) unless
// the author names a ServiceAccount, whose own setting then decides.
func TestEnginePodsMountNoTokenUnlessAServiceAccountIsNamed(t *testing.T) {
	for _, tc := range []struct {
		name string
		sa   string
		want *bool
	}{
		{"the namespace's default ServiceAccount", "", ptr.To(false)},
		{"a named ServiceAccount keeps its own setting", "model-reader", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pdc := load(t, "testdata/mooncake-rdma.yaml")
			pdc.Spec.Engine.Pod = &v1alpha1.PodSettings{ServiceAccountName: tc.sa}
			objs, err := render.Render(pdc, render.DefaultOptions())
			if err != nil {
				t.Fatal(err)
			}
			n := 0
			for _, o := range objs {
				dep, ok := o.(*appsv1.Deployment)
				if !ok || dep.Labels[v1alpha1.LabelRole] == string(v1alpha1.RoleRouter) {
					continue
				}
				n++
				if d := cmp.Diff(tc.want, dep.Spec.Template.Spec.AutomountServiceAccountToken); d != "" {
					t.Errorf("%s: automountServiceAccountToken (-want +got):\n%s", dep.Name, d)
				}
			}
			if n != 2 {
				t.Errorf("%d engine Deployments, want 2", n)
			}
		})
	}
}

// engine.pod and a pool's pod merge as documented, after the operator's own settings.
func TestPodSettingsMerge(t *testing.T) {
	pdc := load(t, "testdata/pod-settings.yaml")
	for _, tc := range []struct {
		role                      v1alpha1.Role
		nccl, priority, sa, sched string
		labels                    map[string]string
	}{
		{v1alpha1.RolePrefill, "WARN", "inference", "", "", map[string]string{"team": "inference"}},
		{v1alpha1.RoleDecode, "INFO", "inference-critical", "decode-engine", "gang-scheduler", map[string]string{"team": "inference", "tier": "decode"}},
	} {
		t.Run(string(tc.role), func(t *testing.T) {
			dep, err := render.EngineDeployment(pdc, render.DefaultOptions(), tc.role)
			if err != nil {
				t.Fatal(err)
			}
			pod := dep.Spec.Template.Spec
			env := map[string]string{}
			for _, e := range pod.Containers[0].Env {
				if _, dup := env[e.Name]; dup {
					t.Errorf("env %s twice", e.Name)
				}
				env[e.Name] = e.Value
			}
			if env["NCCL_DEBUG"] != tc.nccl || env["VLLM_LOGGING_LEVEL"] != "INFO" || pod.Containers[0].Env[0].Name != "POD_IP" {
				t.Errorf("env %v, want NCCL_DEBUG=%s after the operator's own", env, tc.nccl)
			}
			if len(pod.Containers[0].EnvFrom) != 1 || len(pod.ImagePullSecrets) != 1 {
				t.Errorf("envFrom %v, pull secrets %v", pod.Containers[0].EnvFrom, pod.ImagePullSecrets)
			}
			if pod.PriorityClassName != tc.priority || pod.ServiceAccountName != tc.sa || pod.SchedulerName != tc.sched || *pod.TerminationGracePeriodSeconds != 120 {
				t.Errorf("priority %q sa %q scheduler %q grace %d", pod.PriorityClassName, pod.ServiceAccountName, pod.SchedulerName, *pod.TerminationGracePeriodSeconds)
			}
			for k, v := range tc.labels {
				if dep.Spec.Template.Labels[k] != v {
					t.Errorf("pod label %s = %q, want %q", k, dep.Spec.Template.Labels[k], v)
				}
			}
			rev, err := render.KVRevision(pdc)
			if err != nil {
				t.Fatal(err)
			}
			if d := cmp.Diff(render.RevisionLabels(pdc.Name, tc.role, rev), dep.Spec.Selector.MatchLabels); d != "" {
				t.Errorf("selector changed (-want +got):\n%s", d)
			}
			if dep.Spec.Template.Annotations["k8s.v1.cni.cncf.io/networks"] != "rdma-net" || dep.Spec.Template.Annotations[v1alpha1.AnnotationConfigHash] == "" {
				t.Errorf("annotations %v", dep.Spec.Template.Annotations)
			}
			if !slices.ContainsFunc(pod.Volumes, func(v corev1.Volume) bool { return v.Name == "nccl-topo" && v.ConfigMap != nil }) ||
				!slices.ContainsFunc(pod.Containers[0].VolumeMounts, func(m corev1.VolumeMount) bool { return m.MountPath == "/etc/nccl" }) {
				t.Errorf("the extra volume or its mount is missing: %v / %v", pod.Volumes, pod.Containers[0].VolumeMounts)
			}
			if len(pod.TopologySpreadConstraints) != 1 || (pod.Affinity != nil) != (tc.role == v1alpha1.RoleDecode) {
				t.Errorf("spread %v, affinity %v", pod.TopologySpreadConstraints, pod.Affinity)
			}
			if got := pod.Volumes[0].EmptyDir.SizeLimit.String(); pod.Volumes[0].Name != "dshm" || got != "16Gi" {
				t.Errorf("/dev/shm volume %s limit %s, want 16Gi", pod.Volumes[0].Name, got)
			}
		})
	}
}

// Every environment variable render sets on an engine is one the CRD refuses in pod.env, so a
// user's value can never silently shadow (or be shadowed by) the operator's.
func TestOperatorEnvIsReservedInTheCRD(t *testing.T) {
	crdYAML, err := os.ReadFile("../../config/crd/bases/serving.pdcluster.dev_pdclusters.yaml")
	if err != nil {
		t.Fatal(err)
	}
	crdText := string(crdYAML)
	for _, in := range testInputs(t) {
		pdc := load(t, in)
		pdc.Spec.Engine.Pod, pdc.Spec.Prefill.Pod, pdc.Spec.Decode.Pod = nil, nil, nil
		for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode} {
			for _, e := range engineContainer(t, pdc, role).Env {
				if !strings.Contains(crdText, "'"+e.Name+"'") {
					t.Errorf("%s: render sets %s, which the CRD's pod.env rule does not reserve", in, e.Name)
				}
			}
		}
	}
}

// Env and volume names admission cannot check (see PodSettings) fail the render, naming the
// field: the reconciler reports it as InvalidSpec instead of failing every apply of the pods.
func TestPodSettingsNamesAreCheckedAtRender(t *testing.T) {
	pdc := load(t, "testdata/minimal.yaml")
	pdc.Spec.Decode.Pod = &v1alpha1.PodSettings{
		Env:     []corev1.EnvVar{{Name: "OK", Value: "1"}, {Name: "1BAD", Value: "2"}},
		Volumes: []corev1.Volume{{Name: "Topo"}},
	}
	_, err := render.Render(pdc, render.DefaultOptions())
	for _, want := range []string{`spec.decode.pod.env[1].name: Invalid value: "1BAD"`, `spec.decode.pod.volumes[0].name: Invalid value: "Topo"`} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("err = %v, want it to contain %q", err, want)
		}
	}
	pdc.Spec.Decode.Pod = &v1alpha1.PodSettings{Env: []corev1.EnvVar{{Name: "NCCL_DEBUG", Value: "INFO"}}, Volumes: []corev1.Volume{{Name: "topo"}}}
	if _, err := render.Render(pdc, render.DefaultOptions()); err != nil {
		t.Errorf("valid names refused: %v", err)
	}
}

// The volumes render adds to the engine pods are the ones v1alpha1.OperatorVolumeNames lists
// (a PDCluster's mounts may name them: PDCluster.Validate) and the CRD's pod.volumes rule
// reserves.
func TestOperatorVolumesAreTheReservedOnes(t *testing.T) {
	crdYAML, err := os.ReadFile("../../config/crd/bases/serving.pdcluster.dev_pdclusters.yaml")
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range v1alpha1.OperatorVolumeNames {
		if !strings.Contains(string(crdYAML), "'"+name+"'") {
			t.Errorf("v1alpha1.OperatorVolumeNames has %s, which the CRD's pod.volumes rule does not reserve", name)
		}
	}
	seen := map[string]bool{}
	for _, in := range testInputs(t) {
		pdc := load(t, in)
		pdc.Spec.Engine.Pod, pdc.Spec.Prefill.Pod, pdc.Spec.Decode.Pod = nil, nil, nil
		for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode} {
			for _, v := range enginePod(t, pdc, role).Volumes {
				seen[v.Name] = true
				if !slices.Contains(v1alpha1.OperatorVolumeNames, v.Name) {
					t.Errorf("%s: render adds volume %s, which v1alpha1.OperatorVolumeNames does not list", in, v.Name)
				}
			}
		}
	}
	if len(seen) < 4 {
		t.Errorf("the test inputs render only the volumes %v", seen)
	}
}
