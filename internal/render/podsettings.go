// Pod settings (spec.engine.pod, spec.<pool>.pod, spec.router.pod): merged and applied.

package render

import (
	"cmp"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/utils/ptr"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
)

// mergePodSettings is engine.pod with the pool's pod over it: a field the pool sets wins
// (affinity and topology spread whole); env, labels, annotations, volumes (by name) and
// volume mounts (by path) merge key by key, the pool's winning; envFrom and image pull secrets
// add up.
func mergePodSettings(engine, pool *v1alpha1.PodSettings) v1alpha1.PodSettings {
	var out v1alpha1.PodSettings
	for _, s := range []*v1alpha1.PodSettings{engine, pool} {
		if s == nil {
			continue
		}
		s = s.DeepCopy() // the rendered pod must not share memory with the PDCluster
		out.Env = mergeBy(out.Env, s.Env, func(e corev1.EnvVar) string { return e.Name })
		out.Volumes = mergeBy(out.Volumes, s.Volumes, func(v corev1.Volume) string { return v.Name })
		out.VolumeMounts = mergeBy(out.VolumeMounts, s.VolumeMounts, func(m corev1.VolumeMount) string { return m.MountPath })
		out.EnvFrom = append(out.EnvFrom, s.EnvFrom...)
		out.ImagePullSecrets = append(out.ImagePullSecrets, s.ImagePullSecrets...)
		out.Labels = mergeMaps(out.Labels, s.Labels)
		out.Annotations = mergeMaps(out.Annotations, s.Annotations)
		if s.Affinity != nil {
			out.Affinity = s.Affinity
		}
		if len(s.TopologySpreadConstraints) > 0 {
			out.TopologySpreadConstraints = s.TopologySpreadConstraints
		}
		out.PriorityClassName = cmp.Or(s.PriorityClassName, out.PriorityClassName)
		out.ServiceAccountName = cmp.Or(s.ServiceAccountName, out.ServiceAccountName)
		out.SchedulerName = cmp.Or(s.SchedulerName, out.SchedulerName)
		if s.TerminationGracePeriodSeconds != nil {
			out.TerminationGracePeriodSeconds = s.TerminationGracePeriodSeconds
		}
		if s.ShmSize != nil {
			out.ShmSize = s.ShmSize
		}
	}
	return out
}

// applyPodSettings puts s into an engine pod: the environment into the engine container, after
// the operator's own.
func applyPodSettings(pod *corev1.PodSpec, s v1alpha1.PodSettings) {
	engine := &pod.Containers[0]
	engine.Env = append(engine.Env, s.Env...)
	engine.EnvFrom = append(engine.EnvFrom, s.EnvFrom...)
	engine.VolumeMounts = append(engine.VolumeMounts, s.VolumeMounts...)
	pod.Volumes = append(pod.Volumes, s.Volumes...)
	pod.Affinity = s.Affinity
	pod.TopologySpreadConstraints = s.TopologySpreadConstraints
	pod.ImagePullSecrets = s.ImagePullSecrets
	pod.PriorityClassName = s.PriorityClassName
	pod.ServiceAccountName = s.ServiceAccountName
	if s.ServiceAccountName == "" {
		// Neither vLLM nor the sidecar talks to the API server: the namespace's default
		// ServiceAccount's token would only be something for the engine's code to steal. A
		// named one is the author's (workload identity, say) and keeps its own setting.
		pod.AutomountServiceAccountToken = ptr.To(false)
	}
	pod.SchedulerName = s.SchedulerName
	pod.TerminationGracePeriodSeconds = s.TerminationGracePeriodSeconds
	if s.ShmSize != nil {
		for i := range pod.Volumes {
			if pod.Volumes[i].Name == shmVolume {
				pod.Volumes[i].EmptyDir.SizeLimit = s.ShmSize
			}
		}
	}
}

func nodeSelector(m v1alpha1.NodeSelector) map[string]string {
	if m == nil {
		return nil
	}
	out := make(map[string]string, len(m))
	for k, v := range m {
		out[k] = string(v)
	}
	return out
}
