package controllers

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	vllmplugin "pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

// gateRefresh is how often the gate counts in status are read again: counts change with every
// request, so status follows them on a clock rather than on every change.
const gateRefresh = time.Minute

// gateReads bounds the sidecars read at once.
const gateReads = 16

// GateReader reads the completion gate's state from an engine pod's connector sidecar.
type GateReader interface {
	ReadGate(ctx context.Context, pod *corev1.Pod) (vllmplugin.State, error)
}

// HTTPGateReader reads GET /gate on the sidecar's public port at the pod's IP.
type HTTPGateReader struct {
	Client *http.Client
	// Port is the sidecar's public port (render.ConnectorPort).
	Port int32
	// Addr overrides host:port for a pod (tests); nil: the pod IP and Port.
	Addr func(*corev1.Pod) string
}

// NewHTTPGateReader reads the sidecars rendered by this operator, with a short timeout: a pod
// that does not answer is left out of the counts, not waited for.
func NewHTTPGateReader() *HTTPGateReader {
	return &HTTPGateReader{Client: &http.Client{Timeout: 2 * time.Second}, Port: render.ConnectorPort}
}

// ReadGate implements GateReader.
func (h *HTTPGateReader) ReadGate(ctx context.Context, pod *corev1.Pod) (vllmplugin.State, error) {
	addr := ""
	if h.Addr != nil {
		addr = h.Addr(pod)
	} else if pod.Status.PodIP != "" {
		addr = net.JoinHostPort(pod.Status.PodIP, strconv.Itoa(int(h.Port)))
	}
	if addr == "" {
		return vllmplugin.State{}, errors.New("pod has no IP yet")
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+vllmplugin.StatePath, nil)
	if err != nil {
		return vllmplugin.State{}, err
	}
	resp, err := h.Client.Do(req)
	if err != nil {
		return vllmplugin.State{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return vllmplugin.State{}, fmt.Errorf("GET %s: %s", vllmplugin.StatePath, resp.Status)
	}
	var st vllmplugin.State
	if err := json.NewDecoder(io.LimitReader(resp.Body, 64<<10)).Decode(&st); err != nil {
		return vllmplugin.State{}, fmt.Errorf("decode %s: %w", vllmplugin.StatePath, err)
	}
	return st, nil
}

// reconcileGateStatus sums the gate counts of each pool's running engines into status and
// returns when to read them again, and the pods whose connector is unready while their gate is
// silent (the gate is why). Sidecars that do not answer are left out.
func (r *PDClusterReconciler) reconcileGateStatus(ctx context.Context, pdc *v1alpha1.PDCluster, status *v1alpha1.PDClusterStatus) (time.Duration, []string, error) {
	status.Prefill.Gate, status.Decode.Gate = nil, nil
	if r.GateReader == nil || !render.GateEnabled(pdc.Spec.KVTransfer) {
		return 0, nil, nil
	}
	var list corev1.PodList
	if err := r.List(ctx, &list, client.InNamespace(pdc.Namespace), client.MatchingLabels{v1alpha1.LabelCluster: pdc.Name}); err != nil {
		return 0, nil, fmt.Errorf("list pods: %w", err)
	}
	type read struct {
		role v1alpha1.Role
		pod  *corev1.Pod
		st   vllmplugin.State
	}
	var (
		mu    sync.Mutex
		reads []read
		wg    sync.WaitGroup
		slots = make(chan struct{}, gateReads)
	)
	for i := range list.Items {
		pod := &list.Items[i]
		role := v1alpha1.Role(pod.Labels[v1alpha1.LabelRole])
		if (role != v1alpha1.RolePrefill && role != v1alpha1.RoleDecode) || pod.Status.Phase != corev1.PodRunning || pod.DeletionTimestamp != nil {
			continue
		}
		wg.Add(1)
		slots <- struct{}{}
		go func() {
			defer func() { <-slots; wg.Done() }()
			st, err := r.GateReader.ReadGate(ctx, pod)
			if err != nil {
				log.FromContext(ctx).V(1).Info("gate counts not read", "pod", pod.Name, "error", err.Error())
				return
			}
			mu.Lock()
			reads = append(reads, read{role, pod, st})
			mu.Unlock()
		}()
	}
	wg.Wait()
	var silent []string
	for _, rd := range reads {
		out := &status.Prefill.Gate
		if rd.role == v1alpha1.RoleDecode {
			out = &status.Decode.Gate
		}
		if *out == nil {
			*out = &v1alpha1.PoolGateStatus{}
		}
		g := *out
		if !rd.st.Loaded || rd.st.Report == nil {
			g.SilentPods++
			if !connectorReady(rd.pod) {
				silent = append(silent, rd.pod.Name)
			}
			continue
		}
		c := rd.st.Report.Counts
		g.ReportingPods++
		g.GatedCompletions += c.Gated
		g.PassedCompletions += c.Passed
		g.FailedPulls += c.Failed
	}
	slices.Sort(silent)
	return gateRefresh, silent, nil
}

// connectorReady is the kubelet's readiness of the pod's connector container.
func connectorReady(pod *corev1.Pod) bool {
	for _, cs := range pod.Status.ContainerStatuses {
		if cs.Name == v1alpha1.ConnectorContainerName {
			return cs.Ready
		}
	}
	return false
}
