// Where the engines load the model from.

package render

import (
	"path"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/utils/ptr"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
)

// Where the model's volumes appear in the engine container.
const (
	modelVolume = "model"
	ModelDir    = "/models"
	hfVolume    = "hf-cache"
	HFHome      = "/var/cache/huggingface"
)

// modelArg is the model `vllm serve` loads: the directory inside the mounted weights for a pvc
// or hostPath source, else path as given (a Hugging Face id or a path in the image).
func modelArg(m v1alpha1.ModelSpec) string {
	if m.PVC != nil || m.HostPath != nil {
		return path.Join(ModelDir, m.Path)
	}
	return m.Path
}

// modelVolumes are the volumes, mounts and environment the model's source needs.
func modelVolumes(m v1alpha1.ModelSpec) ([]corev1.Volume, []corev1.VolumeMount, []corev1.EnvVar) {
	switch {
	case m.PVC != nil:
		return []corev1.Volume{{Name: modelVolume, VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: m.PVC.ClaimName, ReadOnly: true}}}},
			[]corev1.VolumeMount{{Name: modelVolume, MountPath: ModelDir, SubPath: m.PVC.SubPath, ReadOnly: true}}, nil
	case m.HostPath != nil:
		return []corev1.Volume{{Name: modelVolume, VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: m.HostPath.Path, Type: ptr.To(corev1.HostPathDirectory)}}}},
			[]corev1.VolumeMount{{Name: modelVolume, MountPath: ModelDir, ReadOnly: true}}, nil
	case m.HuggingFace != nil:
		hf := m.HuggingFace
		src := corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{SizeLimit: hf.CacheSizeLimit}}
		if hf.CacheClaimName != "" {
			src = corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: hf.CacheClaimName}}
		}
		env := []corev1.EnvVar{{Name: "HF_HOME", Value: HFHome}}
		if t := hf.TokenSecret; t != nil {
			env = append(env, corev1.EnvVar{Name: "HF_TOKEN", ValueFrom: &corev1.EnvVarSource{SecretKeyRef: &corev1.SecretKeySelector{
				LocalObjectReference: corev1.LocalObjectReference{Name: t.Name}, Key: t.Key,
			}}})
		}
		return []corev1.Volume{{Name: hfVolume, VolumeSource: src}}, []corev1.VolumeMount{{Name: hfVolume, MountPath: HFHome}}, env
	}
	return nil, nil, nil
}
