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
	var st vllm.State
	if _, err := getJSON(ctx, h.Client, podAddr(pod, h.Port, h.Addr), vllm.StatePath, &st, http.StatusOK); err != nil {
		return vllm.State{}, err
	}
	return st, nil
}

// podAddr is host:port of pod's port, or addr(pod) when addr is set (tests); "" without an IP.
func podAddr(pod *corev1.Pod, port int32, addr func(*corev1.Pod) string) string {
	if addr != nil {
		return addr(pod)
	}
	if pod.Status.PodIP == "" {
		return ""
	}
	return net.JoinHostPort(pod.Status.PodIP, strconv.Itoa(int(port)))
}

// getJSON decodes GET http://addr+path into v (at most maxGateAnswer bytes) when the status is
// want, and returns the status; any other status is an error naming it.
func getJSON(ctx context.Context, c *http.Client, addr, path string, v any, want int) (int, error) {
	if addr == "" {
		return 0, errors.New("pod has no IP yet")
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+path, nil)
	if err != nil {
		return 0, err
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != want {
		return resp.StatusCode, fmt.Errorf("GET %s: %s", path, resp.Status)
	}
	b, err := bounded.ReadAll(resp.Body, maxGateAnswer)
	if err != nil {
		return resp.StatusCode, fmt.Errorf("read %s: %w", path, err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		return resp.StatusCode, fmt.Errorf("decode %s: %w", path, err)
	}
	return resp.StatusCode, nil
}
