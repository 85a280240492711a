// Package render turns a PDCluster into the Kubernetes objects that run it. It is pure: the
// same PDCluster and Options always give the same objects, with no cluster access, so the
// reconciler only diffs and applies, and `pdctl render` prints exactly what the operator creates.
package render

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"maps"
	"path"
	"slices"
	"sort"
	"strconv"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/intstr"
	utilvalidation "k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"
	"k8s.io/utils/ptr"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	vllmplugin "pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// Names and paths inside the rendered pods.
const (
	shmVolume = "dshm"
	// gateVolume is the completion-gate plugin, from its ConfigMap.
	gateVolume = "completion-gate"

	// connectorVolume holds the sidecar's pod-local socket, which the engine's gate heartbeats
	// to: on the pod's own volume, so only the engine of the same pod reaches it.
	connectorVolume = "connector-run"
	ConnectorDir    = "/var/run/pdcluster"
	// ConnectorSocket is the sidecar's pod-local API (the gate's heartbeat).
	ConnectorSocket = "unix://" + ConnectorDir + "/agent.sock"
	// connectorVolumeBytes bounds the volume: it holds one socket.
	connectorVolumeBytes = 1 << 20
	// ConnectorPort is the sidecar's public port: /healthz, /readyz, /metrics and /gate. It is
	// not vLLM's bootstrap port (8998): the prefill engine binds that in the same network
	// namespace.
	ConnectorPort int32 = 8190

	// Port names, shared by container ports and the Services that target them.
	portHTTP      = "http"
	portBootstrap = "bootstrap"
	portConnector = "connector"
	// portNixlPrefix + data-parallel rank names a NIXL side-channel port.
	portNixlPrefix = "nixl-"

	// drainSeconds keeps a deleted engine pod's containers serving before they get SIGTERM:
	// routers resolve the pools every 5 s through DNS (cached up to 5 s more), so a pod gone at
	// once would still get requests and fail them ("no route to host") during every rollout.
	drainSeconds = 15
)

// drain is the preStop hook of the engine pods' containers (the engine and its connector alike:
// a connector that left first would fail the engine's last transfers).
// nonRootUser runs the operator's own images (static binaries on an empty base), which need no
// user of their own in the image.
const nonRootUser = 65532

// hardened is every rendered container's security context: no privilege escalation, every
// capability dropped but add, the runtime's default seccomp profile (what the restricted Pod
// Security Standard asks of a container, bar the user).
func hardened(add ...corev1.Capability) *corev1.SecurityContext {
	return &corev1.SecurityContext{
		AllowPrivilegeEscalation: ptr.To(false),
		Capabilities:             &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}, Add: add},
		SeccompProfile:           &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
	}
}

// engineCapabilities: RDMA needs to pin (mlock) the registered KV-cache memory; TCP needs
// nothing, so a TCP PDCluster runs in a namespace that enforces the baseline Pod Security
// Standard (which refuses IPC_LOCK).
func engineCapabilities(kv v1alpha1.KVTransferSpec) []corev1.Capability {
	if kv.Protocol == v1alpha1.ProtocolRDMA {
		return []corev1.Capability{"IPC_LOCK"}
	}
	return nil
}

func readOnlyRoot(sc *corev1.SecurityContext) *corev1.SecurityContext {
	sc.ReadOnlyRootFilesystem = ptr.To(true)
	return sc
}

// nonRoot runs the container as nonRootUser, whatever user its image names.
func nonRoot(sc *corev1.SecurityContext) *corev1.SecurityContext {
	sc.RunAsNonRoot, sc.RunAsUser = ptr.To(true), ptr.To(int64(nonRootUser))
	return sc
}

func drain() *corev1.Lifecycle {
	return &corev1.Lifecycle{PreStop: &corev1.LifecycleHandler{Sleep: &corev1.SleepAction{Seconds: drainSeconds}}}
}

// Options are the operator-wide settings that are not part of a PDCluster.
type Options struct {
	// RouterImage runs cmd/router.
	RouterImage string
	// ConnectorImage runs cmd/connector, unless a PDCluster names its own.
	ConnectorImage string
	// OperatorNamespace is where the operator runs: its pods read the connector sidecars'
	// /gate, which the NetworkPolicies admit from there only. Empty: from nowhere.
	OperatorNamespace string
}

// DefaultOptions are used by pdctl and by the manager unless flags override them.
func DefaultOptions() Options {
	return Options{RouterImage: "ghcr.io/pdcluster/router:v0.1.0", ConnectorImage: "ghcr.io/pdcluster/connector:v0.1.0", OperatorNamespace: "pdcluster-system"}
}

// ObjectName is the name of the child object of cluster for role.
func ObjectName(cluster string, role v1alpha1.Role) string { return cluster + "-" + string(role) }

// Labels are the selector labels of role's pods in cluster.
func Labels(cluster string, role v1alpha1.Role) map[string]string {
	l := componentLabels(cluster, string(role))
	l[v1alpha1.LabelRole] = string(role)
	return l
}

// componentLabels are the labels of every object of cluster; component names the part.
func componentLabels(cluster, component string) map[string]string {
	return map[string]string{
		v1alpha1.LabelName:      "pdcluster",
		v1alpha1.LabelInstance:  cluster,
		v1alpha1.LabelComponent: component,
		v1alpha1.LabelManagedBy: v1alpha1.OperatorName,
		v1alpha1.LabelCluster:   cluster,
	}
}

// Render returns every object the operator creates for pdc, in a stable order.
func Render(pdc *v1alpha1.PDCluster, opts Options) ([]Object, error) {
	if err := validatePodSettings(pdc); err != nil {
		return nil, err
	}
	var objs []Object
	for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode} {
		dep, err := EngineDeployment(pdc, opts, role)
		if err != nil {
			return nil, fmt.Errorf("render %s pool: %w", role, err)
		}
		objs = append(objs, dep, EngineService(pdc, role))
		if pdb := DisruptionBudget(pdc, role); pdb != nil {
			objs = append(objs, pdb)
		}
	}
	if GateEnabled(pdc.Spec.KVTransfer) {
		objs = append(objs, GateConfigMap(pdc))
	}
	cm, err := RouterConfigMap(pdc)
	if err != nil {
		return nil, fmt.Errorf("render router config: %w", err)
	}
	router, err := RouterDeployment(pdc, opts, cm)
	if err != nil {
		return nil, fmt.Errorf("render router: %w", err)
	}
	objs = append(objs, cm, router, RouterService(pdc))
	for _, np := range NetworkPolicies(pdc, opts) {
		objs = append(objs, np)
	}
	return objs, nil
}

func pool(pdc *v1alpha1.PDCluster, role v1alpha1.Role) *v1alpha1.PoolSpec {
	if role == v1alpha1.RolePrefill {
		return &pdc.Spec.Prefill
	}
	return &pdc.Spec.Decode
}

// GPUsPerReplica is tensor*data*pipeline of a pool.
func GPUsPerReplica(p v1alpha1.Parallelism) int64 {
	return int64(ptr.Deref(p.Tensor, v1alpha1.DefaultParallelism)) *
		int64(ptr.Deref(p.Data, v1alpha1.DefaultParallelism)) *
		int64(ptr.Deref(p.Pipeline, v1alpha1.DefaultParallelism))
}

// reservedExtraConfigKeys are derived from typed fields and may not come from extraConfig.
var reservedExtraConfigKeys = map[string]string{
	"mooncake_protocol": "kvTransfer.protocol",
	"device_name":       "kvTransfer.rdmaDevices",
}

// KVTransferConfig is the JSON passed to --kv-transfer-config for role.
func KVTransferConfig(kv v1alpha1.KVTransferSpec, role v1alpha1.Role) (string, error) {
	extra := map[string]any{}
	if kv.ExtraConfig != nil && len(kv.ExtraConfig.Raw) > 0 {
		if err := json.Unmarshal(kv.ExtraConfig.Raw, &extra); err != nil {
			return "", fmt.Errorf("kvTransfer.extraConfig must be a JSON object: %w", err)
		}
		for _, k := range sortedKeys(extra) {
			if field, ok := reservedExtraConfigKeys[k]; ok {
				return "", fmt.Errorf("kvTransfer.extraConfig.%s is set by the operator from %s; remove it", k, field)
			}
		}
	}
	connector := orDefault(kv.Connector, v1alpha1.ConnectorMooncake)
	protocol := orDefault(kv.Protocol, v1alpha1.ProtocolRDMA)
	if connector == v1alpha1.ConnectorMooncake {
		extra["mooncake_protocol"] = string(protocol)
		if protocol == v1alpha1.ProtocolRDMA {
			extra["device_name"] = strings.Join(kv.RDMADevices, ",")
		}
	}
	cfg := map[string]any{
		"kv_connector":           string(connector),
		"kv_role":                string(role.KVRole()),
		"kv_buffer_device":       string(orDefault(kv.BufferDevice, v1alpha1.BufferDeviceCUDA)),
		"kv_load_failure_policy": string(orDefault(kv.LoadFailurePolicy, v1alpha1.LoadFailurePolicyFail)),
	}
	if len(extra) > 0 {
		cfg["kv_connector_extra_config"] = extra
	}
	if GateEnabled(kv) {
		class, module := gatedConnector(connector)
		cfg["kv_connector"], cfg["kv_connector_module_path"] = class, module
	}
	// encoding/json sorts map keys, so the flag (and the config hash) is stable.
	b, err := json.Marshal(cfg)
	if err != nil {
		return "", fmt.Errorf("encode kv-transfer-config: %w", err)
	}
	return string(b), nil
}

// GateEnabled reports whether the engines run the completion-gated connector plugin.
func GateEnabled(kv v1alpha1.KVTransferSpec) bool {
	return orDefault(kv.CompletionGate, v1alpha1.CompletionGateEnabled) == v1alpha1.CompletionGateEnabled
}

// gatedConnector is the plugin's class and module that stand in for connector.
func gatedConnector(connector v1alpha1.Connector) (class, module string) {
	if connector == v1alpha1.ConnectorNixl {
		return vllmplugin.NixlClass, vllmplugin.NixlModule
	}
	return vllmplugin.MooncakeClass, vllmplugin.MooncakeModule
}

// GateObjectName is the ConfigMap of the completion-gate plugin of cluster.
func GateObjectName(cluster string) string { return cluster + "-" + vllmplugin.Package }

// GateConfigMap holds the completion-gate plugin's Python files, mounted into every engine.
func GateConfigMap(pdc *v1alpha1.PDCluster) *corev1.ConfigMap {
	return &corev1.ConfigMap{
		TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "ConfigMap"},
		ObjectMeta: metav1.ObjectMeta{
			Name:      GateObjectName(pdc.Name),
			Namespace: pdc.Namespace,
			Labels:    componentLabels(pdc.Name, vllmplugin.Package),
		},
		Data: vllmplugin.Files(),
	}
}

func orDefault[T ~string](v, def T) T {
	if v == "" {
		return def
	}
	return v
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// EngineArgs is the full `vllm serve` argument list for role.
func EngineArgs(pdc *v1alpha1.PDCluster, role v1alpha1.Role) ([]string, error) {
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
		"serve", ModelArg(spec.Model),
		"--served-model-name", served,
		"--host", "0.0.0.0",
		"--port", strconv.Itoa(int(v1alpha1.DefaultEnginePort)),
		"--block-size", strconv.Itoa(int(ptr.Deref(spec.Engine.BlockSize, v1alpha1.DefaultBlockSize))),
		"--tensor-parallel-size", strconv.Itoa(int(ptr.Deref(p.Parallelism.Tensor, v1alpha1.DefaultParallelism))),
		"--data-parallel-size", strconv.Itoa(int(ptr.Deref(p.Parallelism.Data, v1alpha1.DefaultParallelism))),
		"--pipeline-parallel-size", strconv.Itoa(int(ptr.Deref(p.Parallelism.Pipeline, v1alpha1.DefaultParallelism))),
	}
	if p.Parallelism.Expert {
		args = append(args, "--enable-expert-parallel")
	}
	if ptr.Deref(spec.Engine.EnablePrefixCaching, true) {
		args = append(args, "--enable-prefix-caching")
	} else {
		args = append(args, "--no-enable-prefix-caching")
	}
	args = append(args, "--kv-transfer-config", kvcfg)
	args = append(args, spec.Engine.Args...)
	args = append(args, p.Args...)
	return args, nil
}

// Where the model's volumes appear in the engine container.
const (
	modelVolume = "model"
	ModelDir    = "/models"
	hfVolume    = "hf-cache"
	HFHome      = "/var/cache/huggingface"
)

// ModelArg is the model `vllm serve` loads: the directory inside the mounted weights for a pvc
// or hostPath source, else path as given (a Hugging Face id or a path in the image).
func ModelArg(m v1alpha1.ModelSpec) string {
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
				LocalObjectReference: corev1.LocalObjectReference{Name: t.Name}, Key: orDefault(t.Key, "token"),
			}}})
		}
		return []corev1.Volume{{Name: hfVolume, VolumeSource: src}}, []corev1.VolumeMount{{Name: hfVolume, MountPath: HFHome}}, env
	}
	return nil, nil, nil
}

func objectMeta(pdc *v1alpha1.PDCluster, role v1alpha1.Role) metav1.ObjectMeta {
	return metav1.ObjectMeta{
		Name:      ObjectName(pdc.Name, role),
		Namespace: pdc.Namespace,
		Labels:    Labels(pdc.Name, role),
	}
}

// EngineDeployment is the prefill (kv_producer) or decode (kv_consumer) Deployment: the engine
// and, beside it, the connector sidecar that watches its completion gate.
func EngineDeployment(pdc *v1alpha1.PDCluster, opts Options, role v1alpha1.Role) (*appsv1.Deployment, error) {
	p := pool(pdc, role)
	args, err := EngineArgs(pdc, role)
	if err != nil {
		return nil, err
	}
	resources := *p.Resources.DeepCopy()
	gpus := *resource.NewQuantity(GPUsPerReplica(p.Parallelism), resource.DecimalSI)
	setResource(&resources, corev1.ResourceName(v1alpha1.GPUResourceName), gpus)
	if orDefault(pdc.Spec.KVTransfer.Protocol, v1alpha1.ProtocolRDMA) == v1alpha1.ProtocolRDMA {
		name := p.RDMA.ResourceName
		if name == "" {
			name = v1alpha1.DefaultRDMAResourceName
		}
		count := ptr.Deref(p.RDMA.Count, v1alpha1.DefaultRDMACount)
		setResource(&resources, corev1.ResourceName(name), *resource.NewQuantity(int64(count), resource.DecimalSI))
	}

	env := []corev1.EnvVar{
		podIPEnv(),
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
		env = append(env, corev1.EnvVar{Name: "PYTHONPATH", Value: vllmplugin.MountDir})
		mounts = append(mounts, corev1.VolumeMount{Name: gateVolume, MountPath: vllmplugin.MountDir + "/" + vllmplugin.Package, ReadOnly: true})
		volumes = append(volumes, corev1.Volume{Name: gateVolume, VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{
			LocalObjectReference: corev1.LocalObjectReference{Name: GateObjectName(pdc.Name)},
		}}})
	}

	health := &corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/health", Port: intstr.FromString(portHTTP)}}
	connector := connectorContainer(pdc, opts, role)
	podSpec := corev1.PodSpec{
		Containers: []corev1.Container{{
			Name:      v1alpha1.EngineContainerName,
			Image:     orDefault(p.Image, pdc.Spec.Engine.Image),
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
		}, volumes...),
		NodeSelector: nodeSelector(p.NodeSelector),
		Tolerations:  append([]corev1.Toleration(nil), p.Tolerations...),
	}
	settings := mergePodSettings(pdc.Spec.Engine.Pod, p.Pod)
	applyPodSettings(&podSpec, settings)
	dep, err := deployment(pdc, role, ptr.Deref(p.Replicas, v1alpha1.DefaultReplicas), podSpec)
	if err != nil {
		return nil, err
	}
	// The operator's own keys go in last: CEL refuses user keys under its prefixes, and these
	// must win all the same.
	tmpl := &dep.Spec.Template.ObjectMeta
	tmpl.Labels = mergeMaps(nodeSelector(settings.Labels), tmpl.Labels)
	tmpl.Annotations = mergeMaps(settings.Annotations, tmpl.Annotations)
	if gate {
		tmpl.Annotations[v1alpha1.AnnotationGateHash] = vllmplugin.Hash()
	}
	return dep, nil
}

// validatePodSettings checks what admission cannot (see PodSettings): env names and volume
// names, as the API server would check them in the pods, with the PDCluster field named.
func validatePodSettings(pdc *v1alpha1.PDCluster) error {
	var errs field.ErrorList
	for _, s := range []struct {
		path *field.Path
		pod  *v1alpha1.PodSettings
	}{
		{field.NewPath("spec", "engine", "pod"), pdc.Spec.Engine.Pod},
		{field.NewPath("spec", "prefill", "pod"), pdc.Spec.Prefill.Pod},
		{field.NewPath("spec", "decode", "pod"), pdc.Spec.Decode.Pod},
	} {
		if s.pod == nil {
			continue
		}
		for i, e := range s.pod.Env {
			for _, msg := range utilvalidation.IsEnvVarName(e.Name) {
				errs = append(errs, field.Invalid(s.path.Child("env").Index(i).Child("name"), e.Name, msg))
			}
		}
		for i, v := range s.pod.Volumes {
			for _, msg := range utilvalidation.IsDNS1123Label(v.Name) {
				errs = append(errs, field.Invalid(s.path.Child("volumes").Index(i).Child("name"), v.Name, msg))
			}
		}
	}
	return errs.ToAggregate()
}

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
		out.PriorityClassName = orDefault(s.PriorityClassName, out.PriorityClassName)
		out.ServiceAccountName = orDefault(s.ServiceAccountName, out.ServiceAccountName)
		out.SchedulerName = orDefault(s.SchedulerName, out.SchedulerName)
		if s.TerminationGracePeriodSeconds != nil {
			out.TerminationGracePeriodSeconds = s.TerminationGracePeriodSeconds
		}
		if s.ShmSize != nil {
			out.ShmSize = s.ShmSize
		}
	}
	return out
}

// mergeBy is base with over's items over it: an item whose key base has replaces it in place,
// the others are appended in order.
func mergeBy[T any](base, over []T, key func(T) string) []T {
	for _, o := range over {
		if i := slices.IndexFunc(base, func(b T) bool { return key(b) == key(o) }); i >= 0 {
			base[i] = o
		} else {
			base = append(base, o)
		}
	}
	return base
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

// mergeMaps is a copy of base with over's keys over it; nil when both are empty.
func mergeMaps[K comparable, V any](base, over map[K]V) map[K]V {
	if len(base) == 0 && len(over) == 0 {
		return nil
	}
	out := maps.Clone(base)
	if out == nil {
		out = make(map[K]V, len(over))
	}
	maps.Copy(out, over)
	return out
}

// connectorEnv is the environment vLLM's KV connector reads in role's engine.
func connectorEnv(kv v1alpha1.KVTransferSpec, role v1alpha1.Role) []corev1.EnvVar {
	rdma := orDefault(kv.Protocol, v1alpha1.ProtocolRDMA) == v1alpha1.ProtocolRDMA
	switch orDefault(kv.Connector, v1alpha1.ConnectorMooncake) {
	case v1alpha1.ConnectorNixl:
		env := []corev1.EnvVar{
			// vLLM hands this host to the other side in kv_transfer_params; its default,
			// localhost, makes every handshake from another pod fail.
			{Name: "VLLM_NIXL_SIDE_CHANNEL_HOST", Value: "$(POD_IP)"},
			{Name: "VLLM_NIXL_SIDE_CHANNEL_PORT", Value: strconv.Itoa(int(v1alpha1.DefaultNixlSideChannelPort))},
		}
		if rdma {
			env = append(env, corev1.EnvVar{Name: "UCX_NET_DEVICES", Value: ucxNetDevices(kv.RDMADevices)})
		}
		return env
	default:
		if role != v1alpha1.RolePrefill {
			return nil // only a kv_producer starts the bootstrap server
		}
		return []corev1.EnvVar{{Name: "VLLM_MOONCAKE_BOOTSTRAP_PORT", Value: strconv.Itoa(int(v1alpha1.DefaultBootstrapPort))}}
	}
}

// ucxNetDevices is UCX's device list for NIXL: UCX names an RDMA device with its port
// (mlx5_0:1); a device given without one gets port 1.
func ucxNetDevices(devices []string) string {
	out := make([]string, len(devices))
	for i, d := range devices {
		if !strings.Contains(d, ":") {
			d += ":1"
		}
		out[i] = d
	}
	return strings.Join(out, ",")
}

// enginePorts are the ports vLLM binds in role's engine container: the OpenAI API, and the
// connector's own listeners (Mooncake's bootstrap server on prefill, NIXL's side channel on
// every engine, one port per data-parallel rank).
func enginePorts(pdc *v1alpha1.PDCluster, role v1alpha1.Role) []corev1.ContainerPort {
	ports := []corev1.ContainerPort{{Name: portHTTP, ContainerPort: v1alpha1.DefaultEnginePort, Protocol: corev1.ProtocolTCP}}
	switch orDefault(pdc.Spec.KVTransfer.Connector, v1alpha1.ConnectorMooncake) {
	case v1alpha1.ConnectorNixl:
		dp := ptr.Deref(pool(pdc, role).Parallelism.Data, v1alpha1.DefaultParallelism)
		for rank := range dp {
			ports = append(ports, corev1.ContainerPort{Name: nixlPortName(rank), ContainerPort: v1alpha1.DefaultNixlSideChannelPort + rank, Protocol: corev1.ProtocolTCP})
		}
	default:
		if role == v1alpha1.RolePrefill {
			ports = append(ports, corev1.ContainerPort{Name: portBootstrap, ContainerPort: v1alpha1.DefaultBootstrapPort, Protocol: corev1.ProtocolTCP})
		}
	}
	return ports
}

// connectorPorts are the ports the connector sidecar binds: its public HTTP port (the KV moves
// through vLLM's own transfer engine, on ports it picks at run time).
func connectorPorts() []corev1.ContainerPort {
	return []corev1.ContainerPort{{Name: portConnector, ContainerPort: ConnectorPort, Protocol: corev1.ProtocolTCP}}
}

func nixlPortName(rank int32) string { return portNixlPrefix + strconv.Itoa(int(rank)) }

func podIPEnv() corev1.EnvVar {
	return corev1.EnvVar{Name: "POD_IP", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{APIVersion: "v1", FieldPath: "status.podIP"}}}
}

// connectorContainer is the connector sidecar of role. Its readiness probe runs every
// health.periodSeconds and flips on the first failure: the operator, not the kubelet, decides
// when unready has lasted too long.
func connectorContainer(pdc *v1alpha1.PDCluster, opts Options, role v1alpha1.Role) corev1.Container {
	c := pdc.Spec.Connector
	args := []string{
		"--role=" + string(role.KVRole()),
		"--listen=" + ConnectorSocket,
		fmt.Sprintf("--public-listen=:%d", ConnectorPort),
		// The pod's IP only: the kubelet and the operator come that way, and a second network
		// of the pod (RDMA), which no NetworkPolicy covers, does not reach the port.
		"--bind-address=$(POD_IP)",
	}
	if GateEnabled(pdc.Spec.KVTransfer) {
		// Not ready until the engine's gate has loaded and while its heartbeat is missing.
		args = append(args, "--require-gate")
		if g := c.Health.GateStartupGraceSeconds; g != nil {
			args = append(args, fmt.Sprintf("--gate-startup-grace=%ds", *g))
		}
	}
	resources := *c.Resources.DeepCopy()
	if len(resources.Requests) == 0 && len(resources.Limits) == 0 {
		resources.Requests = corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m"), corev1.ResourceMemory: resource.MustParse("64Mi")}
	}
	period := ptr.Deref(c.Health.PeriodSeconds, v1alpha1.DefaultHealthPeriodSeconds)
	port := intstr.FromString(portConnector)
	return corev1.Container{
		Name:           v1alpha1.ConnectorContainerName,
		Image:          orDefault(c.Image, opts.ConnectorImage),
		Args:           args,
		Env:            []corev1.EnvVar{podIPEnv()},
		Ports:          connectorPorts(),
		Resources:      resources,
		ReadinessProbe: probe(&corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/readyz", Port: port}}, period, 1),
		LivenessProbe:  probe(&corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/healthz", Port: port}}, 10, 3),
		VolumeMounts:   []corev1.VolumeMount{{Name: connectorVolume, MountPath: ConnectorDir}},
		// It writes only its socket, on its volume (the engine, which may run as root, connects).
		SecurityContext:          nonRoot(readOnlyRoot(hardened())),
		Lifecycle:                drain(),
		TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError,
	}
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
			Replicas: ptr.To(replicas),
			Selector: &metav1.LabelSelector{MatchLabels: labels},
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

func hashOf(v any) (string, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return "", fmt.Errorf("hash pod template inputs: %w", err)
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:8]), nil
}

// EngineService is the headless Service of a pool: the router needs each pod's address (the
// Mooncake bootstrap server runs per prefill pod), not a load-balanced VIP.
func EngineService(pdc *v1alpha1.PDCluster, role v1alpha1.Role) *corev1.Service {
	// Every port the pod's containers declare, under the same name: the pods are reached by
	// their own addresses, so the Service publishes the set for discovery and DNS SRV records.
	declared := append(enginePorts(pdc, role), connectorPorts()...)
	ports := make([]corev1.ServicePort, 0, len(declared))
	for _, p := range declared {
		ports = append(ports, corev1.ServicePort{Name: p.Name, Port: p.ContainerPort, TargetPort: intstr.FromString(p.Name), Protocol: p.Protocol})
	}
	return &corev1.Service{
		TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "Service"},
		ObjectMeta: objectMeta(pdc, role),
		Spec: corev1.ServiceSpec{
			ClusterIP:                corev1.ClusterIPNone,
			Selector:                 Labels(pdc.Name, role),
			Ports:                    ports,
			PublishNotReadyAddresses: false,
		},
	}
}

// DisruptionBudget is role's PodDisruptionBudget, or nil when the pool asks for none.
func DisruptionBudget(pdc *v1alpha1.PDCluster, role v1alpha1.Role) *policyv1.PodDisruptionBudget {
	b := pool(pdc, role).DisruptionBudget
	if b == nil {
		return nil
	}
	return &policyv1.PodDisruptionBudget{
		TypeMeta:   metav1.TypeMeta{APIVersion: "policy/v1", Kind: "PodDisruptionBudget"},
		ObjectMeta: objectMeta(pdc, role),
		Spec: policyv1.PodDisruptionBudgetSpec{
			Selector:       &metav1.LabelSelector{MatchLabels: Labels(pdc.Name, role)},
			MaxUnavailable: copyIntOrString(b.MaxUnavailable),
			MinAvailable:   copyIntOrString(b.MinAvailable),
			// A pod that is not running (crash-looping, never scheduled) may always be evicted:
			// holding it would only block the drain that could fix it.
			UnhealthyPodEvictionPolicy: ptr.To(policyv1.AlwaysAllow),
		},
	}
}

func copyIntOrString(v *intstr.IntOrString) *intstr.IntOrString {
	if v == nil {
		return nil
	}
	c := *v
	return &c
}

// RouterConfigMap carries the router's view of the pools: router.json, which cmd/router reads
// with --config.
func RouterConfigMap(pdc *v1alpha1.PDCluster) (*corev1.ConfigMap, error) {
	connector := orDefault(pdc.Spec.KVTransfer.Connector, v1alpha1.ConnectorMooncake)
	cfg := routerconfig.File{
		Flow:        routerconfig.FlowMooncake,
		PrefillHost: fmt.Sprintf("%s.%s.svc", ObjectName(pdc.Name, v1alpha1.RolePrefill), pdc.Namespace),
		DecodeHost:  fmt.Sprintf("%s.%s.svc", ObjectName(pdc.Name, v1alpha1.RoleDecode), pdc.Namespace),
		EnginePort:  v1alpha1.DefaultEnginePort,
		Model:       pdc.Spec.Model.ServedModelName,
	}
	if cfg.Model == "" {
		cfg.Model = pdc.Spec.Model.Path
	}
	// Only round robin is written: least-in-flight is the router's default, and leaving it
	// out keeps router.json (and so the router's pods) as they were before the field existed.
	if pdc.Spec.Router.Balance == v1alpha1.RouterBalanceRoundRobin {
		cfg.Balance = routerconfig.BalanceRoundRobin
	}
	if connector == v1alpha1.ConnectorMooncake {
		cfg.BootstrapPort = v1alpha1.DefaultBootstrapPort
	} else {
		cfg.Flow = routerconfig.FlowNIXL
	}
	b, err := json.MarshalIndent(cfg, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("encode router config: %w", err)
	}
	return &corev1.ConfigMap{
		TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "ConfigMap"},
		ObjectMeta: objectMeta(pdc, v1alpha1.RoleRouter),
		Data:       map[string]string{routerconfig.FileName: string(b)},
	}, nil
}

// RouterDeployment runs the P/D proxy.
func RouterDeployment(pdc *v1alpha1.PDCluster, opts Options, config *corev1.ConfigMap) (*appsv1.Deployment, error) {
	health := &corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/health", Port: intstr.FromString(portHTTP)}}
	podSpec := corev1.PodSpec{
		Containers: []corev1.Container{{
			Name:            v1alpha1.RouterContainerName,
			Image:           opts.RouterImage,
			Args:            []string{"--config=/etc/pdcluster/" + routerconfig.FileName, "--listen=:" + strconv.Itoa(int(v1alpha1.DefaultEnginePort))},
			Ports:           []corev1.ContainerPort{{Name: portHTTP, ContainerPort: v1alpha1.DefaultEnginePort, Protocol: corev1.ProtocolTCP}},
			Resources:       routerResources(pdc.Spec.Router),
			ReadinessProbe:  probe(&corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/ready", Port: intstr.FromString(portHTTP)}}, 5, 3),
			LivenessProbe:   probe(health, 10, 3),
			VolumeMounts:    []corev1.VolumeMount{{Name: "config", MountPath: "/etc/pdcluster", ReadOnly: true}},
			SecurityContext: nonRoot(readOnlyRoot(hardened())),
		}},
		// The router reads its pools from DNS, never from the API server.
		AutomountServiceAccountToken: ptr.To(false),
		Volumes: []corev1.Volume{{Name: "config", VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{
			LocalObjectReference: corev1.LocalObjectReference{Name: ObjectName(pdc.Name, v1alpha1.RoleRouter)},
		}}}},
		NodeSelector: nodeSelector(pdc.Spec.Router.NodeSelector),
		Tolerations:  append([]corev1.Toleration(nil), pdc.Spec.Router.Tolerations...),
	}
	return deployment(pdc, v1alpha1.RoleRouter, ptr.Deref(pdc.Spec.Router.Replicas, v1alpha1.DefaultReplicas), podSpec, config.Data)
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

// routerResources are spec.router.resources, or small defaults: the router only proxies.
func routerResources(r v1alpha1.RouterSpec) corev1.ResourceRequirements {
	if r.Resources != nil {
		return *r.Resources.DeepCopy()
	}
	return corev1.ResourceRequirements{Requests: corev1.ResourceList{
		corev1.ResourceCPU:    resource.MustParse("100m"),
		corev1.ResourceMemory: resource.MustParse("128Mi"),
	}}
}

// RouterService is the client-facing OpenAI endpoint of the cluster.
func RouterService(pdc *v1alpha1.PDCluster) *corev1.Service {
	return &corev1.Service{
		TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "Service"},
		ObjectMeta: objectMeta(pdc, v1alpha1.RoleRouter),
		Spec: corev1.ServiceSpec{
			Selector: Labels(pdc.Name, v1alpha1.RoleRouter),
			Ports:    []corev1.ServicePort{{Name: portHTTP, Port: 80, TargetPort: intstr.FromString(portHTTP), Protocol: corev1.ProtocolTCP}},
		},
	}
}

// Object is a rendered Kubernetes object. It is controller-runtime's client.Object, declared
// here so that pdctl, which renders without a cluster, does not link the client and its
// dependencies (client-go's typed clients and scheme: a third of pdctl's start-up time).
type Object interface {
	metav1.Object
	runtime.Object
}
