// The engine pools: vLLM's command line and the prefill and decode Deployments.

package render

import (
	"cmp"
	"encoding/json"
	"fmt"
	"strconv"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/scaling"
)

// drain is the preStop hook of the engine container: it serves on while the routers learn the
// pod is gone; then SIGTERM starts vLLM's own drain (--shutdown-timeout).
func drain() *corev1.Lifecycle {
	return &corev1.Lifecycle{PreStop: &corev1.LifecycleHandler{Sleep: &corev1.SleepAction{Seconds: drainSeconds}}}
}

// drainTimeout is role's drain.timeoutSeconds.
func drainTimeout(pdc *v1alpha1.PDCluster, role v1alpha1.Role) int32 {
	return *pool(pdc, role).Drain.TimeoutSeconds
}

// gracePeriod is a pod's default terminationGracePeriodSeconds: the router's window, the
// pool's drain, and the engine's teardown.
func gracePeriod(pdc *v1alpha1.PDCluster, role v1alpha1.Role) int64 {
	return int64(drainSeconds + drainTimeout(pdc, role) + graceMarginSeconds)
}

// gpusPerReplica is tensor*data*pipeline of a pool.
func gpusPerReplica(p v1alpha1.Parallelism) int64 {
	return int64(*p.Tensor) * int64(*p.Data) * int64(*p.Pipeline)
}

// EngineArgs is the full `vllm serve` argument list for role.
func EngineArgs(pdc *v1alpha1.PDCluster, role v1alpha1.Role) ([]string, error) {
	return engineArgs(defaulted(pdc), role)
}

// engineArgs is EngineArgs of a defaulted PDCluster.
func engineArgs(pdc *v1alpha1.PDCluster, role v1alpha1.Role) ([]string, error) {
	spec := pdc.Spec
	p := pool(pdc, role)
	kvcfg, err := KVTransferConfig(spec.KVTransfer, role)
	if err != nil {
		return nil, err
	}
	served := spec.Model.ServedModelName
	if served == "" {
		served = spec.Model.Path
	}
	args := []string{
		"serve", modelArg(spec.Model),
		"--served-model-name", served,
		"--host", "0.0.0.0",
		"--port", strconv.Itoa(int(vllm.APIPort)),
		"--block-size", strconv.Itoa(int(*spec.Engine.BlockSize)),
		"--tensor-parallel-size", strconv.Itoa(int(*p.Parallelism.Tensor)),
		"--data-parallel-size", strconv.Itoa(int(*p.Parallelism.Data)),
		"--pipeline-parallel-size", strconv.Itoa(int(*p.Parallelism.Pipeline)),
	}
	if r := spec.Model.Revision; r != "" && spec.Model.PVC == nil && spec.Model.HostPath == nil {
		args = append(args, "--revision", r)
	}
	if p.Parallelism.Expert {
		args = append(args, "--enable-expert-parallel")
	}
	if *spec.Engine.EnablePrefixCaching {
		args = append(args, "--enable-prefix-caching")
	} else {
		args = append(args, "--no-enable-prefix-caching")
	}
	args = append(args, "--kv-transfer-config", kvcfg)
	if KVEvents(pdc) {
		events, err := json.Marshal(vllm.KVEventsConfig{
			EnableKVCacheEvents: true, Publisher: "zmq", Topic: vllm.KVEventsTopic,
			Endpoint:       "tcp://*:" + strconv.Itoa(int(vllm.KVEventsPort)),
			ReplayEndpoint: "tcp://*:" + strconv.Itoa(int(vllm.KVEventsReplayPort)),
		})
		if err != nil {
			return nil, fmt.Errorf("kv events config: %w", err)
		}
		args = append(args, vllm.FlagKVEventsConfig, string(events))
	}
	// SIGTERM drains (finish running requests, keep KV blocks until decode pulled them) for
	// this long; 0 aborts at once, vLLM's default.
	args = append(args, "--shutdown-timeout", strconv.Itoa(int(drainTimeout(pdc, role))))
	args = append(args, spec.Engine.Args...)
	args = append(args, p.Args...)
	return args, nil
}

// EngineDeployment is the prefill (kv_producer) or decode (kv_consumer) Deployment: the engine
// and, beside it, the connector sidecar that watches its completion gate.
func EngineDeployment(pdc *v1alpha1.PDCluster, opts Options, role v1alpha1.Role) (*appsv1.Deployment, error) {
	pdc = defaulted(pdc)
	rev, err := kvRevision(pdc)
	if err != nil {
		return nil, err
	}
	return engineDeployment(pdc, opts, role, rev)
}

// engineDeployment is EngineDeployment of a defaulted PDCluster whose KV revision is rev.
func engineDeployment(pdc *v1alpha1.PDCluster, opts Options, role v1alpha1.Role, rev string) (*appsv1.Deployment, error) {
	p := pool(pdc, role)
	args, err := engineArgs(pdc, role)
	if err != nil {
		return nil, err
	}
	resources := *p.Resources.DeepCopy()
	gpus := *resource.NewQuantity(gpusPerReplica(p.Parallelism), resource.DecimalSI)
	setResource(&resources, corev1.ResourceName(v1alpha1.GPUResourceName), gpus)
	if pdc.Spec.KVTransfer.Protocol == v1alpha1.ProtocolRDMA {
		setResource(&resources, corev1.ResourceName(p.RDMA.ResourceName), *resource.NewQuantity(int64(*p.RDMA.Count), resource.DecimalSI))
	}

	env := []corev1.EnvVar{
		podIPEnv(),
		// The address vLLM's transfer engine registers at the pod's bootstrap registry: the
		// pod's own, which is the only one the router trusts (internal/router/registry.go);
		// vLLM would otherwise take the address that routes out, another on a pod with a
		// second network.
		{Name: vllm.EnvHostIP, Value: "$(POD_IP)"},
		{Name: "PDCLUSTER_CONNECTOR_URL", Value: ConnectorSocket},
	}
	env = append(env, connectorEnv(pdc.Spec.KVTransfer, role)...)

	mounts := []corev1.VolumeMount{
		{Name: shmVolume, MountPath: "/dev/shm"},
		{Name: connectorVolume, MountPath: ConnectorDir},
	}
	volumes, modelMounts, modelEnv := modelVolumes(pdc.Spec.Model)
	mounts = append(mounts, modelMounts...)
	env = append(env, modelEnv...)
	gate := GateEnabled(pdc.Spec.KVTransfer)
	if gate {
		// vLLM imports the plugin by kv_connector_module_path in the scheduler, every worker and
		// the API server: PYTHONPATH is container-wide.
		env = append(env, corev1.EnvVar{Name: "PYTHONPATH", Value: vllm.MountDir})
		mounts = append(mounts, corev1.VolumeMount{Name: gateVolume, MountPath: vllm.MountDir + "/" + vllm.Package, ReadOnly: true})
		volumes = append(volumes, corev1.Volume{Name: gateVolume, VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{
			LocalObjectReference: corev1.LocalObjectReference{Name: GateObjectName(pdc.Name)},
		}}})
	}

	health := &corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/health", Port: intstr.FromString(portHTTP)}}
	connector := connectorContainer(pdc, opts, role)
	podSpec := corev1.PodSpec{
		Containers: []corev1.Container{{
			Name:      v1alpha1.EngineContainerName,
			Image:     cmp.Or(p.Image, pdc.Spec.Engine.Image),
			Command:   []string{"vllm"},
			Args:      args,
			Ports:     enginePorts(pdc, role),
			Env:       env,
			Resources: resources,
			// Model loading can take many minutes; the startup probe holds liveness off until then.
			StartupProbe:    probe(health, 10, 180),
			ReadinessProbe:  probe(health, 5, 3),
			LivenessProbe:   probe(health, 10, 6),
			SecurityContext: hardened(engineCapabilities(pdc.Spec.KVTransfer)...),
			VolumeMounts:    mounts,
			Lifecycle:       drain(),
			// A crashing engine's last log lines become its termination message, which the
			// PDCluster's status then quotes (vLLM writes no termination-log file).
			TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError,
		}, connector},
		Volumes: append([]corev1.Volume{
			// NCCL and the engine's worker processes share tensors through /dev/shm.
			{Name: shmVolume, VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{Medium: corev1.StorageMediumMemory}}},
			{Name: connectorVolume, VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{
				Medium: corev1.StorageMediumMemory, SizeLimit: resource.NewQuantity(connectorVolumeBytes, resource.BinarySI),
			}}},
			{Name: controlVolume, VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{
				Medium: corev1.StorageMediumMemory, SizeLimit: resource.NewQuantity(connectorVolumeBytes, resource.BinarySI),
			}}},
		}, volumes...),
		NodeSelector: nodeSelector(p.NodeSelector),
		Tolerations:  append([]corev1.Toleration(nil), p.Tolerations...),
	}
	settings := mergePodSettings(pdc.Spec.Engine.Pod, p.Pod)
	applyPodSettings(&podSpec, settings)
	pairingAffinity(pdc, role, &podSpec)
	if podSpec.TerminationGracePeriodSeconds == nil {
		podSpec.TerminationGracePeriodSeconds = ptr.To(gracePeriod(pdc, role))
	}
	dep, err := deployment(pdc, role, scaling.SpecReplicas(pdc, role), podSpec)
	if err != nil {
		return nil, err
	}
	// The operator's own keys go in last: CEL refuses user keys under its prefixes, and these
	// must win all the same.
	tmpl := &dep.Spec.Template.ObjectMeta
	tmpl.Labels = mergeMaps(nodeSelector(settings.Labels), tmpl.Labels)
	tmpl.Annotations = mergeMaps(settings.Annotations, tmpl.Annotations)
	tmpl.Labels[v1alpha1.LabelKVRevision] = rev
	// A Deployment holds one KV revision for its life: a new one gets its own (the selector
	// cannot change), which the reconciler steps in lockstep with the other pool's.
	dep.Spec.Selector = &metav1.LabelSelector{MatchLabels: RevisionLabels(pdc.Name, role, rev)}
	dep.Labels[v1alpha1.LabelKVRevision] = rev
	dep.Spec.Strategy = rolloutStrategy(pdc)
	if gate {
		tmpl.Annotations[v1alpha1.AnnotationGateHash] = vllm.Hash()
	}
	return dep, nil
}

// rolloutStrategy is spec.rollout as a Deployment's: the pods of one KV revision roll in place
// within the same bounds as a new revision's lockstep.
func rolloutStrategy(pdc *v1alpha1.PDCluster) appsv1.DeploymentStrategy {
	r := pdc.Spec.Rollout
	return appsv1.DeploymentStrategy{Type: appsv1.RollingUpdateDeploymentStrategyType, RollingUpdate: &appsv1.RollingUpdateDeployment{
		MaxSurge: ptr.To(*r.MaxSurge), MaxUnavailable: ptr.To(*r.MaxUnavailable),
	}}
}

// enginePorts are the ports vLLM binds in role's engine container: the OpenAI API, and the
// connector's own listeners (Mooncake's bootstrap server on prefill, NIXL's side channel on
// every engine, one port per data-parallel rank).
func enginePorts(pdc *v1alpha1.PDCluster, role v1alpha1.Role) []corev1.ContainerPort {
	ports := []corev1.ContainerPort{{Name: portHTTP, ContainerPort: vllm.APIPort, Protocol: corev1.ProtocolTCP}}
	if KVEvents(pdc) {
		// vLLM's KV events publisher and its replay socket, one of each per data-parallel
		// rank: the router subscribes to them.
		for rank := range *pool(pdc, role).Parallelism.Data {
			ports = append(ports,
				corev1.ContainerPort{Name: portKVEventsPrefix + strconv.Itoa(int(rank)), ContainerPort: vllm.KVEventsPort + rank, Protocol: corev1.ProtocolTCP},
				corev1.ContainerPort{Name: portKVReplayPrefix + strconv.Itoa(int(rank)), ContainerPort: vllm.KVEventsReplayPort + rank, Protocol: corev1.ProtocolTCP})
		}
	}
	switch pdc.Spec.KVTransfer.Connector {
	case v1alpha1.ConnectorNixl:
		for rank := range *pool(pdc, role).Parallelism.Data {
			ports = append(ports, corev1.ContainerPort{Name: nixlPortName(rank), ContainerPort: vllm.NixlSideChannelPort + rank, Protocol: corev1.ProtocolTCP})
		}
	default:
		if role == v1alpha1.RolePrefill {
			ports = append(ports, corev1.ContainerPort{Name: portBootstrap, ContainerPort: vllm.MooncakeBootstrapPort, Protocol: corev1.ProtocolTCP})
		}
	}
	return ports
}

// KVEvents reports whether pdc's engines publish KV cache events for the router
// (spec.router.routing.strategy KVEvents).
func KVEvents(pdc *v1alpha1.PDCluster) bool {
	return pdc.Spec.Router.Routing.Strategy == v1alpha1.RoutingKVEvents
}

func nixlPortName(rank int32) string { return portNixlPrefix + strconv.Itoa(int(rank)) }

func podIPEnv() corev1.EnvVar {
	return corev1.EnvVar{Name: "POD_IP", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{APIVersion: "v1", FieldPath: "status.podIP"}}}
}

// probe sets every field, including the ones the API server would default, so the applied
// object compares equal to the stored one and a resync writes nothing.
func probe(h *corev1.ProbeHandler, period, failures int32) *corev1.Probe {
	return &corev1.Probe{ProbeHandler: *h, PeriodSeconds: period, FailureThreshold: failures, TimeoutSeconds: 1, SuccessThreshold: 1}
}

func setResource(r *corev1.ResourceRequirements, name corev1.ResourceName, q resource.Quantity) {
	if r.Limits == nil {
		r.Limits = corev1.ResourceList{}
	}
	if r.Requests == nil {
		r.Requests = corev1.ResourceList{}
	}
	r.Limits[name] = q
	r.Requests[name] = q
}

// EngineMinReadySeconds is how long an engine pod is ready before its Deployment counts it
// available, and so before a rollout (the Deployment's own, or a KV revision's) lets an older
// pod go: the routers find engines by resolving their pools' headless Services every 5 s
// (the router's --refresh) through cluster DNS (records live 5 s), so a pod ready for less
// may be in no router's pools yet, and the clients of the pod that went would get 503.
const EngineMinReadySeconds = 15

func minReadySeconds(role v1alpha1.Role) int32 {
	if role == v1alpha1.RoleRouter {
		return 0
	}
	return EngineMinReadySeconds
}

// deployment wraps podSpec; inputs that pods read but the pod spec does not hold (a ConfigMap's
// data) go into the config hash too, so changing them rolls the pods.
func deployment(pdc *v1alpha1.PDCluster, role v1alpha1.Role, replicas int32, podSpec corev1.PodSpec, inputs ...any) (*appsv1.Deployment, error) {
	hash, err := hashOf(append([]any{podSpec}, inputs...))
	if err != nil {
		return nil, err
	}
	labels := Labels(pdc.Name, role)
	return &appsv1.Deployment{
		TypeMeta:   metav1.TypeMeta{APIVersion: "apps/v1", Kind: "Deployment"},
		ObjectMeta: objectMeta(pdc, role),
		Spec: appsv1.DeploymentSpec{
			Replicas:        ptr.To(replicas),
			MinReadySeconds: minReadySeconds(role),
			Selector:        &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{
					Labels:      labels,
					Annotations: map[string]string{v1alpha1.AnnotationConfigHash: hash},
				},
				Spec: podSpec,
			},
		},
	}, nil
}

// pool is the spec of an engine pool.
func pool(pdc *v1alpha1.PDCluster, role v1alpha1.Role) *v1alpha1.PoolSpec {
	if role == v1alpha1.RolePrefill {
		return &pdc.Spec.Prefill
	}
	return &pdc.Spec.Decode
}
