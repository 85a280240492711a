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

// podHTTP reads JSON answers from one port of a pod, at the pod's own IP.
type podHTTP struct {
	Client *http.Client
	// Port is the pod's port read.
	Port int32
	// Addr overrides host:port for a pod (tests); nil: the pod IP and Port.
	Addr func(*corev1.Pod) string
}

// newPodHTTP reads port with a short timeout: a pod that does not answer is left out, not
// waited for. A pod is read at its own IP only: its redirects are not followed, no proxy of
// the manager's environment stands between, and its headers are bounded as its answer is (Go's
// client takes 10 MiB of them).
func newPodHTTP(port int32) podHTTP {
	transport := &http.Transport{
		DialContext:            (&net.Dialer{Timeout: 2 * time.Second}).DialContext,
		MaxIdleConnsPerHost:    2,
		IdleConnTimeout:        90 * time.Second,
		MaxResponseHeaderBytes: maxPodHeaders,
	}
	return podHTTP{Client: &http.Client{Transport: transport, Timeout: 2 * time.Second, CheckRedirect: bounded.NoRedirect}, Port: port}
}

// maxPodHeaders bounds a pod's answer's headers: a sidecar's or a router's are a few lines.
const maxPodHeaders = 16 << 10

// HTTPGateReader reads GET /gate on the sidecar's public port (render.ConnectorPort) at the
// pod's IP.
type HTTPGateReader struct{ podHTTP }

// NewHTTPGateReader reads the sidecars rendered by this operator.
func NewHTTPGateReader() *HTTPGateReader { return &HTTPGateReader{newPodHTTP(render.ConnectorPort)} }

// maxPodAnswer bounds a pod's answer: a sidecar's /gate or a router's /canary is a few hundred bytes.
const maxPodAnswer = 64 << 10

// ReadGate implements GateReader.
func (h *HTTPGateReader) ReadGate(ctx context.Context, pod *corev1.Pod) (vllm.State, error) {
	var st vllm.State
	if _, err := h.getJSON(ctx, pod, vllm.StatePath, &st); err != nil {
		return vllm.State{}, err
	}
	return st, nil
}

// getJSON decodes the pod's answer to GET path into v (at most maxPodAnswer bytes) when it is
// 200, and returns the status; any other status is an error naming it.
func (h podHTTP) getJSON(ctx context.Context, pod *corev1.Pod, path string, v any) (int, error) {
	addr := ""
	switch {
	case h.Addr != nil:
		addr = h.Addr(pod)
	case pod.Status.PodIP != "":
		addr = net.JoinHostPort(pod.Status.PodIP, strconv.Itoa(int(h.Port)))
	}
	if addr == "" {
		return 0, errors.New("pod has no IP yet")
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+path, nil)
	if err != nil {
		return 0, err
	}
	resp, err := h.Client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return resp.StatusCode, fmt.Errorf("GET %s: %s", path, resp.Status)
	}
	b, err := bounded.ReadAll(resp.Body, maxPodAnswer)
	if err != nil {
		return resp.StatusCode, fmt.Errorf("read %s: %w", path, err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		return resp.StatusCode, fmt.Errorf("decode %s: %w", path, err)
	}
	return resp.StatusCode, nil
}
