package render_test

import (
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

func enginePod(t *testing.T, pdc *v1alpha1.PDCluster, role v1alpha1.Role) corev1.PodSpec {
	t.Helper()
	dep, err := render.EngineDeployment(pdc, render.DefaultOptions(), role)
	if err != nil {
		t.Fatal(err)
	}
	return dep.Spec.Template.Spec
}

func engineContainer(t *testing.T, pdc *v1alpha1.PDCluster, role v1alpha1.Role) corev1.Container {
	t.Helper()
	return enginePod(t, pdc, role).Containers[0]
}

func container(t *testing.T, pod corev1.PodSpec, name string) corev1.Container {
	t.Helper()
	for _, c := range pod.Containers {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("pod has no container %q", name)
	return corev1.Container{}
}

func mountPaths(c corev1.Container) map[string]string {
	m := map[string]string{}
	for _, v := range c.VolumeMounts {
		m[v.Name] = v.MountPath
	}
	return m
}

// flagValue reads --name value or --name=value from args.
func flagValue(args []string, name string) (string, bool) {
	for i, a := range args {
		if v, ok := strings.CutPrefix(a, name+"="); ok {
			return v, true
		}
		if a == name && i+1 < len(args) {
			return args[i+1], true
		}
	}
	return "", false
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}
