package controllers

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/bounded"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

// gateRefresh is how often the gate counts in status are read again: counts change with every
// request, so status follows them on a clock rather than on every change.
const gateRefresh = time.Minute

// GateReader reads the completion gate's state from an engine pod's connector sidecar.
type GateReader interface {
	ReadGate(ctx context.Context, pod *corev1.Pod) (vllm.State, error)
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
	// A pod is read at its own IP only: its redirects are not followed.
	return &HTTPGateReader{Client: &http.Client{Timeout: 2 * time.Second, CheckRedirect: bounded.NoRedirect}, Port: render.ConnectorPort}
}

// maxGateAnswer bounds a sidecar's /gate answer (a few hundred bytes of counts).
const maxGateAnswer = 64 << 10

// ReadGate implements GateReader.
func (h *HTTPGateReader) ReadGate(ctx context.Context, pod *corev1.Pod) (vllm.State, error) {
	addr := ""
	if h.Addr != nil {
		addr = h.Addr(pod)
	} else if pod.Status.PodIP != "" {
		addr = net.JoinHostPort(pod.Status.PodIP, strconv.Itoa(int(h.Port)))
	}
	if addr == "" {
		return vllm.State{}, errors.New("pod has no IP yet")
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+vllm.StatePath, nil)
	if err != nil {
		return vllm.State{}, err
	}
	resp, err := h.Client.Do(req)
	if err != nil {
		return vllm.State{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return vllm.State{}, fmt.Errorf("GET %s: %s", vllm.StatePath, resp.Status)
	}
	b, err := bounded.ReadAll(resp.Body, maxGateAnswer)
	if err != nil {
		return vllm.State{}, fmt.Errorf("read %s: %w", vllm.StatePath, err)
	}
	var st vllm.State
	if err := json.Unmarshal(b, &st); err != nil {
		return vllm.State{}, fmt.Errorf("decode %s: %w", vllm.StatePath, err)
	}
	return st, nil
}
