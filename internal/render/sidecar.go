// The connector sidecar beside each engine.

package render

import (
	"cmp"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/util/intstr"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
)

// connectorPorts are the ports the connector sidecar binds: its public HTTP port (the KV moves
// through vLLM's own transfer engine, on ports it picks at run time).
func connectorPorts() []corev1.ContainerPort {
	return []corev1.ContainerPort{{Name: portConnector, ContainerPort: ConnectorPort, Protocol: corev1.ProtocolTCP}}
}

// connectorContainer is the connector sidecar of role. Its readiness probe runs every
// health.periodSeconds and flips on the first failure: the operator, not the kubelet, decides
// when unready has lasted too long.
func connectorContainer(pdc *v1alpha1.PDCluster, opts Options, role v1alpha1.Role) corev1.Container {
	return connectorContainerOf(pdc, opts, role, GateEnabled(pdc.Spec.KVTransfer))
}

// connectorContainerOf is connectorContainer beside an engine that runs a completion gate
// (gated: the gate is enabled and the engine runs vLLM's scheduler) or none.
func connectorContainerOf(pdc *v1alpha1.PDCluster, opts Options, role v1alpha1.Role, gated bool) corev1.Container {
	c := pdc.Spec.Connector
	args := []string{
		"--role=" + string(KVRole(role)),
		"--listen=" + ConnectorSocket,
		"--control-listen=" + ControlSocket,
		fmt.Sprintf("--public-listen=:%d", ConnectorPort),
		// The pod's IP only: the kubelet and the operator come that way, and a second network
		// of the pod (RDMA), which no NetworkPolicy covers, does not reach the port.
		"--bind-address=$(POD_IP)",
	}
	if gated {
		// Not ready until the engine's gate has loaded and while its heartbeat is missing.
		args = append(args, "--require-gate")
		if g := c.Health.GateStartupGraceSeconds; g != nil {
			args = append(args, fmt.Sprintf("--gate-startup-grace=%ds", *g))
		}
		// vLLM runs one EngineCore, and so one gate, per data-parallel rank of the pod (of a
		// replica across pods, each pod runs data/nodes): the sidecar waits for each and
		// refuses a rank the pod does not run.
		if dp := podDataParallel(pool(pdc, role).Parallelism); dp > 1 {
			args = append(args, fmt.Sprintf("--gate-ranks=%d", dp))
		}
	}
	if pdc.Spec.KVTransfer.Verification.Mode != v1alpha1.KVVerificationDisabled {
		// The engine's own counts of where its prompts' KV came from, on loopback: vLLM's API
		// server binds every interface of the pod, and the operator needs no path to it.
		args = append(args, "--engine-metrics-url="+EngineMetricsURL)
	}
	// The container's memory limit bounds the sidecar's Go heap (90% of it).
	args = append(args, memoryLimitArg)
	resources := *c.Resources.DeepCopy()
	if len(resources.Requests) == 0 && len(resources.Limits) == 0 {
		resources.Requests = corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m"), corev1.ResourceMemory: resource.MustParse("64Mi")}
		resources.Limits = corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("256Mi")}
	}
	period := *c.Health.PeriodSeconds
	port := intstr.FromString(portConnector)
	return corev1.Container{
		Name:           v1alpha1.ConnectorContainerName,
		Image:          cmp.Or(c.Image, opts.ConnectorImage),
		Args:           args,
		Env:            []corev1.EnvVar{podIPEnv(), memoryLimitEnv(v1alpha1.ConnectorContainerName)},
		Ports:          connectorPorts(),
		Resources:      resources,
		ReadinessProbe: probe(&corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/readyz", Port: port}}, period, 1),
		LivenessProbe:  probe(&corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/healthz", Port: port}}, 10, 3),
		VolumeMounts:   []corev1.VolumeMount{{Name: connectorVolume, MountPath: ConnectorDir}, {Name: controlVolume, MountPath: ControlDir}},
		// It writes only its socket, on its volume (the engine, which may run as root, connects).
		SecurityContext:          nonRoot(readOnlyRoot(hardened())),
		Lifecycle:                connectorDrain(pdc, role),
		TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError,
	}
}

// connectorDrain is the sidecar's preStop hook: unready at once, and serving (metrics, the
// gate's heartbeat) through the engine's drain: at least the routers' window, then until the
// engine holds no KV for a pull not made yet, within the pool's drain timeout.
func connectorDrain(pdc *v1alpha1.PDCluster, role v1alpha1.Role) *corev1.Lifecycle {
	return &corev1.Lifecycle{PreStop: &corev1.LifecycleHandler{Exec: &corev1.ExecAction{Command: []string{
		ConnectorBinary, "drain",
		"--listen=" + ControlSocket,
		fmt.Sprintf("--min=%ds", drainSeconds),
		fmt.Sprintf("--timeout=%ds", drainSeconds+drainTimeout(pdc, role)),
	}}}}
}
