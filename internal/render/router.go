// The P/D router: its configuration and Deployment.

package render

import (
	"cmp"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// RouterConfigMap carries the router's view of the pools: router.json, which cmd/router reads
// with --config. The pools are the update revision's Services; while older revisions run
// (serving.Old) it lists every revision with its pair of Services.
func RouterConfigMap(pdc *v1alpha1.PDCluster, serving Serving) (*corev1.ConfigMap, error) {
	pdc = defaulted(pdc)
	rev, err := kvRevision(pdc)
	if err != nil {
		return nil, err
	}
	return routerConfigMap(pdc, serving, rev)
}

// routerConfigMap is RouterConfigMap of a defaulted PDCluster whose KV revision is rev.
func routerConfigMap(pdc *v1alpha1.PDCluster, serving Serving, rev string) (*corev1.ConfigMap, error) {
	connector := pdc.Spec.KVTransfer.Connector
	update := routerconfig.RevisionHosts{
		Revision:    rev,
		PrefillHost: ServiceHost(pdc.Namespace, EngineObjectName(pdc.Name, v1alpha1.RolePrefill, rev, !serving.Suffixed)),
		DecodeHost:  ServiceHost(pdc.Namespace, EngineObjectName(pdc.Name, v1alpha1.RoleDecode, rev, !serving.Suffixed)),
	}
	// Written only past one rank, the router's default: router.json stays as it was.
	if d := podDataParallel(pool(pdc, v1alpha1.RolePrefill).Parallelism); d > 1 {
		update.PrefillDataParallel = d
	}
	cfg := routerconfig.File{
		Flow:                routerconfig.FlowMooncake,
		PrefillHost:         update.PrefillHost,
		DecodeHost:          update.DecodeHost,
		EnginePort:          vllm.APIPort,
		PrefillDataParallel: update.PrefillDataParallel,
	}
	if p := pdc.Spec.Scheduling.Pairing; p != nil {
		cfg.Pairing = &routerconfig.Pairing{Mode: routerconfig.PairingMode(p.Mode)}
		old := slices.Clone(serving.Old)
		for _, r := range pairedRevisions(pdc, rev, serving) {
			hosts := domainHosts(pdc.Namespace, r, serving.Domains)
			if r.old < 0 {
				cfg.Domains, update.Domains = hosts, hosts
			} else {
				old[r.old].Domains = hosts
			}
		}
		serving.Old = old
	}
	if len(serving.Old) > 0 {
		cfg.Revisions = append(slices.Clone(serving.Old), update)
		cfg.Domains = nil // the revisions' own
	}
	// Only round robin is written: least-in-flight is the router's default, and leaving it
	// out keeps router.json (and so the router's pods) as they were before the field existed.
	if pdc.Spec.Router.Balance == v1alpha1.RouterBalanceRoundRobin {
		cfg.Balance = routerconfig.BalanceRoundRobin
	}
	cfg.Routing = routerRouting(pdc)
	// Written only when it is not the router's default (which equals the API's): router.json,
	// and so the router's pods, stay as they were before the field existed.
	if fp := routerFailurePolicy(pdc); fp != routerconfig.DefaultFailurePolicy() {
		cfg.FailurePolicy = &fp
	}
	if v := pdc.Spec.KVTransfer.Verification; v.Mode == v1alpha1.KVVerificationCanary {
		served := cmp.Or(pdc.Spec.Model.ServedModelName, pdc.Spec.Model.Path)
		// Four blocks of words: at least four blocks of tokens, whatever the tokenizer, so the
		// canary moves whole blocks from prefill.
		cfg.Canary = &routerconfig.Canary{IntervalSeconds: *v.CanaryIntervalSeconds, Model: served, PromptWords: 4 * *pdc.Spec.Engine.BlockSize}
	}
	if connector == v1alpha1.ConnectorMooncake {
		cfg.BootstrapPort = vllm.MooncakeBootstrapPort
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

// DataParallelOf is how many data-parallel ranks a rendered engine pod runs (0 when one, as
// vLLM's default): its engine's --data-parallel-size, or on a pod of a replica across pods
// the launcher's --local-ranks (podDataParallel). router.json names an older revision's from
// its Deployment's or LeaderWorkerSet's pods.
func DataParallelOf(pod *corev1.PodSpec) int32 {
	for _, c := range pod.Containers {
		if c.Name != v1alpha1.EngineContainerName {
			continue
		}
		v := flagValues(c.Args, map[string]string{"--data-parallel-size": "dp"})["dp"]
		if local, ok := flagValues(launcherFlags(c.Command), map[string]string{"--local-ranks": "dp"})["dp"]; ok {
			v = local
		}
		if n, err := strconv.ParseInt(v, 10, 32); err == nil && n > 1 {
			return int32(n)
		}
	}
	return 0
}

// launcherFlags are the flags of a `connector launch` command before its "--" (none for
// another command).
func launcherFlags(command []string) []string {
	if len(command) < 2 || command[0] != Launcher || command[1] != "launch" {
		return nil
	}
	flags := command[2:]
	if i := slices.Index(flags, "--"); i >= 0 {
		flags = flags[:i]
	}
	return flags
}

// ServiceHost is the DNS name of Service name in namespace.
func ServiceHost(namespace, name string) string { return fmt.Sprintf("%s.%s.svc", name, namespace) }

// RoutesByHold reports whether pdc's routers weigh what the engines hold (spec.router.routing
// PrefixAware or KVEvents): they remember or follow it, count it for status, and the
// operator reads the counts.
func RoutesByHold(pdc *v1alpha1.PDCluster) bool {
	switch pdc.Spec.Router.Routing.Strategy {
	case v1alpha1.RoutingPrefixAware, v1alpha1.RoutingKVEvents:
		return true
	}
	return false
}

// routerRouting is spec.router.routing in router.json's words: nil for LeastInFlight, the
// router's default (router.json, and so the router's pods, stay as they were before the field
// existed). The sizes the spec leaves unset stay 0, the router's defaults; loadSlack, which 0
// would set, is written.
func routerRouting(pdc *v1alpha1.PDCluster) *routerconfig.Routing {
	if !RoutesByHold(pdc) {
		return nil
	}
	r := pdc.Spec.Router.Routing
	pa := ptr.Deref(r.PrefixAware, v1alpha1.PrefixAwareRouting{})
	out := &routerconfig.Routing{
		Strategy:   routerconfig.RoutingPrefixAware,
		ChunkBytes: ptr.Deref(pa.ChunkBytes, 0), MaxChunks: ptr.Deref(pa.MaxChunks, 0), ChunksPerEngine: ptr.Deref(pa.ChunksPerEngine, 0),
		LoadSlack: ptr.Deref(pa.LoadSlack, v1alpha1.DefaultRouterLoadSlack),
	}
	if r.Strategy == v1alpha1.RoutingKVEvents {
		out.Strategy = routerconfig.RoutingKVEvents
		out.KVEvents = &routerconfig.KVEventsEndpoints{
			Port: vllm.KVEventsPort, ReplayPort: vllm.KVEventsReplayPort, Topic: vllm.KVEventsTopic,
			BlocksPerEngine: ptr.Deref(ptr.Deref(r.KVEvents, v1alpha1.KVEventsRouting{}).BlocksPerEngine, 0),
		}
	}
	return out
}

// RouterFailurePolicy is spec.router.failurePolicy in router.json's words.
func RouterFailurePolicy(pdc *v1alpha1.PDCluster) routerconfig.FailurePolicy {
	return routerFailurePolicy(defaulted(pdc))
}

// routerFailurePolicy is RouterFailurePolicy of a defaulted PDCluster.
func routerFailurePolicy(pdc *v1alpha1.PDCluster) routerconfig.FailurePolicy {
	fp := pdc.Spec.Router.FailurePolicy
	p := routerconfig.FailurePolicy{
		Retries: *fp.Retries, RetryBudgetPercent: *fp.RetryBudgetPercent, EjectSeconds: *fp.EjectSeconds,
		ConsecutiveFailures:      *fp.ConsecutiveFailures,
		FirstTokenTimeoutSeconds: ptr.Deref(fp.FirstTokenTimeoutSeconds, 0), // unset: streams' alone
		OnPrefillFailure:         routerconfig.OnPrefillFailure(fp.OnPrefillFailure),
	}
	if fp.FirstTokenTimeoutSeconds == nil {
		p.StreamFirstTokenTimeoutSeconds = streamFirstTokenTimeout(pdc)
	}
	return p
}

// StreamFirstTokenTimeout is a streaming request's first-byte budget when
// failurePolicy.firstTokenTimeoutSeconds is unset: a minute for the queue and the KV's move,
// plus a prefill of the longest prompt the engines take (the largest --max-model-len of their
// arguments) at 100 tokens a second, at most the router's 10-minute wait for an answer;
// without --max-model-len (the model's own length, which the operator cannot read), 300 s.
func StreamFirstTokenTimeout(pdc *v1alpha1.PDCluster) int32 {
	return streamFirstTokenTimeout(defaulted(pdc))
}

// streamFirstTokenTimeout is StreamFirstTokenTimeout of a defaulted PDCluster.
func streamFirstTokenTimeout(pdc *v1alpha1.PDCluster) int32 {
	var longest int64
	for _, args := range [][]string{pdc.Spec.Engine.Args, pdc.Spec.Prefill.Args, pdc.Spec.Decode.Args} {
		longest = max(longest, maxModelLen(args))
	}
	if longest == 0 {
		return routerconfig.DefaultStreamFirstTokenTimeoutSeconds
	}
	return int32(min(60+(longest+99)/100, 600))
}

// maxModelLen is the --max-model-len of args (vLLM's forms: 8192, 8k, 8K, 1m, 1M, as
// --flag=value or --flag value; k is 1000, K 1024); 0 when absent or unreadable.
func maxModelLen(args []string) int64 {
	v := flagValues(args, map[string]string{"--max-model-len": "len"})["len"]
	mult := int64(1)
	if n := len(v); n > 0 {
		if m, ok := map[byte]int64{'k': 1000, 'K': 1024, 'm': 1000 * 1000, 'M': 1024 * 1024}[v[n-1]]; ok {
			v, mult = v[:n-1], m
		}
	}
	n, err := strconv.ParseFloat(v, 64)
	if err != nil || n <= 0 {
		return 0
	}
	return int64(n * float64(mult))
}

// RouterDeployment runs the P/D proxy.
func RouterDeployment(pdc *v1alpha1.PDCluster, opts Options, config *corev1.ConfigMap) (*appsv1.Deployment, error) {
	return routerDeployment(defaulted(pdc), opts, config)
}

// routerDeployment is RouterDeployment of a defaulted PDCluster.
func routerDeployment(pdc *v1alpha1.PDCluster, opts Options, config *corev1.ConfigMap) (*appsv1.Deployment, error) {
	health := &corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/health", Port: intstr.FromString(portHTTP)}}
	podSpec := corev1.PodSpec{
		Containers: []corev1.Container{{
			Name:  v1alpha1.RouterContainerName,
			Image: opts.RouterImage,
			Args:  routerArgs(pdc),
			Env:   []corev1.EnvVar{memoryLimitEnv(v1alpha1.RouterContainerName)},
			// A router pod that goes (a rollout restarts it with each new router.json) serves on
			// while its Service drops it, then lets its requests in flight end.
			Lifecycle: &corev1.Lifecycle{PreStop: &corev1.LifecycleHandler{Sleep: &corev1.SleepAction{Seconds: routerDrainSeconds}}},
			Ports: []corev1.ContainerPort{
				{Name: portHTTP, ContainerPort: RouterPort, Protocol: corev1.ProtocolTCP},
				{Name: portMetrics, ContainerPort: RouterMetricsPort, Protocol: corev1.ProtocolTCP},
			},
			Resources:       routerResources(pdc.Spec.Router),
			ReadinessProbe:  probe(&corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/ready", Port: intstr.FromString(portHTTP)}}, 5, 3),
			LivenessProbe:   probe(health, 10, 3),
			VolumeMounts:    []corev1.VolumeMount{{Name: "config", MountPath: "/etc/pdcluster", ReadOnly: true}},
			SecurityContext: nonRoot(readOnlyRoot(hardened())),
		}},
		TerminationGracePeriodSeconds: ptr.To(int64(routerDrainSeconds + routerShutdown(pdc) + graceMarginSeconds)),
		// The router reads its pools from DNS, never from the API server.
		AutomountServiceAccountToken: ptr.To(false),
		Volumes: []corev1.Volume{{Name: "config", VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{
			LocalObjectReference: corev1.LocalObjectReference{Name: ObjectName(pdc.Name, v1alpha1.RoleRouter)},
		}}}},
		NodeSelector: nodeSelector(pdc.Spec.Router.NodeSelector),
		Tolerations:  append([]corev1.Toleration(nil), pdc.Spec.Router.Tolerations...),
	}
	return deployment(pdc, v1alpha1.RoleRouter, *pdc.Spec.Router.Replicas, podSpec, config.Data)
}

// routerArgs are cmd/router's flags: router.json, the clients' port and the observers', the
// drain, the container's memory limit (its heap and body budget follow it) and
// spec.router.maxRequestBody when set.
func routerArgs(pdc *v1alpha1.PDCluster) []string {
	args := []string{"--config=/etc/pdcluster/" + routerconfig.FileName, "--listen=:" + strconv.Itoa(int(RouterPort)),
		"--metrics-listen=:" + strconv.Itoa(int(RouterMetricsPort)),
		"--shutdown-timeout=" + strconv.Itoa(int(routerShutdown(pdc))) + "s", memoryLimitArg}
	if q := pdc.Spec.Router.MaxRequestBody; q != nil {
		args = append(args, "--max-body-bytes="+strconv.FormatInt(q.Value(), 10))
	}
	return args
}

// memoryLimitVar carries a container's memory limit in bytes (the downward API's
// limits.memory: the node's allocatable memory when the container has no limit) to the
// --memory-limit of the router and the sidecar, which keep their Go heap under it.
const memoryLimitVar = "PDCLUSTER_MEMORY_LIMIT"

const memoryLimitArg = "--memory-limit=$(" + memoryLimitVar + ")"

func memoryLimitEnv(container string) corev1.EnvVar {
	return corev1.EnvVar{Name: memoryLimitVar, ValueFrom: &corev1.EnvVarSource{ResourceFieldRef: &corev1.ResourceFieldSelector{
		ContainerName: container, Resource: "limits.memory", Divisor: resource.MustParse("1"),
	}}}
}

// routerShutdown is how long a router pod's requests in flight may take to end once it is
// told to stop: the decode pool's drain, which bounds them there too.
func routerShutdown(pdc *v1alpha1.PDCluster) int32 { return drainTimeout(pdc, v1alpha1.RoleDecode) }

// routerResources are spec.router.resources, or small defaults: the router only proxies.
func routerResources(r v1alpha1.RouterSpec) corev1.ResourceRequirements {
	if r.Resources != nil {
		return *r.Resources.DeepCopy()
	}
	return corev1.ResourceRequirements{
		Requests: corev1.ResourceList{
			corev1.ResourceCPU:    resource.MustParse("100m"),
			corev1.ResourceMemory: resource.MustParse("128Mi"),
		},
		// Bodies in flight (a quarter of it), each pool's KV index (3/16) and the Go heap (90%)
		// are sized from it.
		Limits: corev1.ResourceList{corev1.ResourceMemory: resource.MustParse(v1alpha1.DefaultRouterMemoryLimit)},
	}
}
