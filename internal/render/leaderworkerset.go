// The engine pools whose replicas span pods: one LeaderWorkerSet per pool and KV revision.

package render

import (
	"fmt"
	"strconv"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	lwsv1 "sigs.k8s.io/lws/api/leaderworkerset/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
)

const (
	// launcherVolume holds the connector binary, which the init container copies there: the
	// engine container runs the engine's image, and starts vLLM through `connector launch`.
	launcherVolume = "launcher"
	launcherDir    = "/var/run/pdcluster-launcher"
	// Launcher is the connector binary in a multi-node engine container.
	Launcher = launcherDir + "/connector"
	// launcherVolumeBytes bounds the volume: it holds one static binary.
	launcherVolumeBytes = 256 << 20
	// maxGroupSetName keeps a LeaderWorkerSet's StatefulSets (<lws>-<group>) and their
	// revision labels (<statefulset>-<hash>) within a DNS label for up to a million groups.
	maxGroupSetName = 44
)

// multiNode reports whether role's replicas span pods (spec.<pool>.parallelism.nodes > 1).
func multiNode(pdc *v1alpha1.PDCluster, role v1alpha1.Role) bool {
	return ptr.Deref(pool(pdc, role).Parallelism.Nodes, 1) > 1
}

// podDataParallel is how many data-parallel ranks each pod of a pool runs (vLLM runs an
// EngineCore, with its scheduler and completion gate, per rank): the replica's data, split
// over its pods when it spans nodes. There vLLM's hybrid load balancing counts a pod's ranks
// from 0 (local_engines_only): its bootstrap registry, its gates' reports and the
// X-data-parallel-rank it takes.
func podDataParallel(p v1alpha1.Parallelism) int32 {
	return max(ptr.Deref(p.Data, 1)/ptr.Deref(p.Nodes, 1), 1)
}

// The layouts in `connector launch --layout`'s words (connector/launch's Layout, which the
// manager and pdctl may not link: TestLaunchesTheRenderedGroups runs every rendered group's
// pods through the launcher's own parser).
const (
	layoutDataParallel = "data-parallel"
	layoutModel        = "model"
)

// Layout is how a replica spreads over its pods, in `connector launch`'s words: with
// data-parallel ranks, each pod runs and serves podDataParallel of them (vLLM's hybrid load
// balancing); without, the model is sharded across the pods and only the leader serves.
func Layout(p v1alpha1.Parallelism) (layout string, localRanks int32, port int32) {
	if ptr.Deref(p.Data, 1) > 1 {
		return layoutDataParallel, podDataParallel(p), vllm.DataParallelRPCPort
	}
	return layoutModel, 0, vllm.MasterPort
}

// leaderServesAlone: only the leader of role's groups runs an API server (and so the
// scheduler, its completion gate, and the router's traffic); the others are headless workers.
func leaderServesAlone(pdc *v1alpha1.PDCluster, role v1alpha1.Role) bool {
	layout, _, _ := Layout(pool(pdc, role).Parallelism)
	return multiNode(pdc, role) && layout == layoutModel
}

// GroupSetName is the name of the LeaderWorkerSet whose serving pods the headless Service
// service selects: service with -lws, its end a hash of that past maxGroupSetName.
func GroupSetName(service string) string {
	return fitName(service, service+"-lws", maxGroupSetName)
}

// engineGroupSet is role's LeaderWorkerSet of KV revision rev: each replica a group of nodes
// pods, each pod the engine Deployment's pod with its share of the replica's GPUs, started
// by `connector launch` (which finds the pod's rank and the leader's address) from the
// LeaderWorkerSet's variables. service is the headless Service of its serving pods.
func engineGroupSet(pdc *v1alpha1.PDCluster, opts Options, role v1alpha1.Role, rev, service string, replicas int32) (*lwsv1.LeaderWorkerSet, error) {
	dep, err := engineDeployment(pdc, opts, role, rev)
	if err != nil {
		return nil, err
	}
	p := pool(pdc, role)
	nodes := *p.Parallelism.Nodes
	layout, localRanks, port := Layout(p.Parallelism)
	launch := []string{Launcher, "launch", "--layout=" + layout}
	if localRanks > 0 {
		launch = append(launch, "--local-ranks="+strconv.Itoa(int(localRanks)))
	}
	launch = append(launch, "--port="+strconv.Itoa(int(port)), "--", "vllm")

	leader := *dep.Spec.Template.DeepCopy()
	spec := &leader.Spec
	spec.Volumes = append(spec.Volumes, corev1.Volume{Name: launcherVolume, VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{
		SizeLimit: resource.NewQuantity(launcherVolumeBytes, resource.BinarySI),
	}}})
	connector := containerNamed(spec.Containers, v1alpha1.ConnectorContainerName)
	spec.InitContainers = append([]corev1.Container{{
		Name:    launcherVolume,
		Image:   connector.Image,
		Command: []string{ConnectorBinary, "install", Launcher},
		// A static binary copied once: it needs little and writes only its volume.
		Resources: corev1.ResourceRequirements{
			Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("10m"), corev1.ResourceMemory: resource.MustParse("16Mi")},
			Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("64Mi")},
		},
		VolumeMounts:             []corev1.VolumeMount{{Name: launcherVolume, MountPath: launcherDir}},
		SecurityContext:          nonRoot(readOnlyRoot(hardened())),
		TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError,
	}}, spec.InitContainers...)
	engine := containerNamed(spec.Containers, v1alpha1.EngineContainerName)
	engine.Command = launch
	engine.VolumeMounts = append(engine.VolumeMounts, corev1.VolumeMount{Name: launcherVolume, MountPath: launcherDir, ReadOnly: true})
	gpus := *resource.NewQuantity(gpusPerReplica(p.Parallelism)/int64(nodes), resource.DecimalSI)
	setResource(&engine.Resources, corev1.ResourceName(v1alpha1.GPUResourceName), gpus)

	var worker corev1.PodTemplateSpec
	if leaderServesAlone(pdc, role) {
		// Headless workers run no API server (nothing answers /health) and no scheduler (no
		// completion gate): the sidecar beside them waits for none, and the engine container
		// is watched through its process, whose exit recreates the group.
		worker = *leader.DeepCopy()
		w := containerNamed(worker.Spec.Containers, v1alpha1.EngineContainerName)
		w.StartupProbe, w.ReadinessProbe, w.LivenessProbe = nil, nil, nil
		*containerNamed(worker.Spec.Containers, v1alpha1.ConnectorContainerName) = connectorContainerOf(pdc, opts, role, false)
	}

	labels := dep.Labels
	lws := &lwsv1.LeaderWorkerSet{
		TypeMeta: metav1.TypeMeta{APIVersion: lwsv1.GroupVersion.String(), Kind: "LeaderWorkerSet"},
		ObjectMeta: metav1.ObjectMeta{
			Name: GroupSetName(service), Namespace: pdc.Namespace, Labels: labels,
			Annotations: map[string]string{v1alpha1.AnnotationService: service},
		},
		Spec: lwsv1.LeaderWorkerSetSpec{
			Replicas: ptr.To(replicas),
			LeaderWorkerTemplate: lwsv1.LeaderWorkerTemplate{
				Size: ptr.To(nodes),
				// A pod lost is a replica lost: its ranks cannot rejoin a running group.
				RestartPolicy: lwsv1.RecreateGroupOnPodRestart,
			},
			// Every pod at once: a model-layout leader is not ready until its workers join.
			StartupPolicy: lwsv1.LeaderCreatedStartupPolicy,
			RolloutStrategy: lwsv1.RolloutStrategy{
				Type: lwsv1.RollingUpdateStrategyType,
				RollingUpdateConfiguration: &lwsv1.RollingUpdateConfiguration{
					Partition:      ptr.To[int32](0),
					MaxUnavailable: *pdc.Spec.Rollout.MaxUnavailable,
					MaxSurge:       *pdc.Spec.Rollout.MaxSurge,
				},
			},
			NetworkConfig: &lwsv1.NetworkConfig{SubdomainPolicy: ptr.To(lwsv1.SubdomainShared)},
		},
	}
	if worker.Spec.Containers == nil {
		lws.Spec.LeaderWorkerTemplate.WorkerTemplate = leader
	} else {
		lws.Spec.LeaderWorkerTemplate.LeaderTemplate = &leader
		lws.Spec.LeaderWorkerTemplate.WorkerTemplate = worker
	}
	return lws, nil
}

// containerNamed is the container of that name in cs; render made it, so it is there.
func containerNamed(cs []corev1.Container, name string) *corev1.Container {
	for i := range cs {
		if cs[i].Name == name {
			return &cs[i]
		}
	}
	panic(fmt.Sprintf("render: no %s container", name))
}
