package render_test

import (
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"
	corev1 "k8s.io/api/core/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
)

// Where the weights come from: the volume, its read-only mount at /models, what vllm serve
// loads, and the Hugging Face cache and token.
func TestModelSources(t *testing.T) {
	for _, tc := range []struct {
		in        string
		wantModel string
		wantMount corev1.VolumeMount
		wantEnv   []corev1.EnvVar
	}{
		{"testdata/model-pvc.yaml", "/models/Qwen3-32B", corev1.VolumeMount{Name: "model", MountPath: "/models", SubPath: "qwen3", ReadOnly: true}, nil},
		{"testdata/model-huggingface.yaml", "meta-llama/Llama-3.1-8B-Instruct", corev1.VolumeMount{Name: "hf-cache", MountPath: "/var/cache/huggingface"},
			[]corev1.EnvVar{{Name: "HF_HOME", Value: "/var/cache/huggingface"}, {Name: "HF_TOKEN", ValueFrom: &corev1.EnvVarSource{SecretKeyRef: &corev1.SecretKeySelector{
				LocalObjectReference: corev1.LocalObjectReference{Name: "hf-token"}, Key: "token"}}}}},
	} {
		t.Run(tc.in, func(t *testing.T) {
			pdc := load(t, tc.in)
			pod := enginePod(t, pdc, v1alpha1.RoleDecode)
			c := pod.Containers[0]
			if c.Args[1] != tc.wantModel {
				t.Errorf("vllm serve %s, want %s", c.Args[1], tc.wantModel)
			}
			var mount *corev1.VolumeMount
			for i := range c.VolumeMounts {
				if c.VolumeMounts[i].Name == tc.wantMount.Name {
					mount = &c.VolumeMounts[i]
				}
			}
			if mount == nil {
				t.Fatalf("no %s mount in %+v", tc.wantMount.Name, c.VolumeMounts)
			}
			if d := cmp.Diff(tc.wantMount, *mount); d != "" {
				t.Errorf("mount (-want +got):\n%s", d)
			}
			var vol *corev1.Volume
			for i := range pod.Volumes {
				if pod.Volumes[i].Name == tc.wantMount.Name {
					vol = &pod.Volumes[i]
				}
			}
			switch {
			case vol == nil:
				t.Fatal("no volume for the mount")
			case vol.PersistentVolumeClaim != nil && (!vol.PersistentVolumeClaim.ReadOnly || vol.PersistentVolumeClaim.ClaimName != "model-store"):
				t.Errorf("weights volume %+v, want model-store read-only", vol.PersistentVolumeClaim)
			case vol.EmptyDir != nil && vol.EmptyDir.SizeLimit.String() != "200Gi":
				t.Errorf("cache emptyDir %+v, want 200Gi", vol.EmptyDir)
			}
			for _, want := range tc.wantEnv {
				if !slices.ContainsFunc(c.Env, func(e corev1.EnvVar) bool { return cmp.Equal(e, want) }) {
					t.Errorf("env lacks %+v", want)
				}
			}
		})
	}
}
