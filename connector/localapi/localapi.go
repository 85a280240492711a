// Package localapi is the pod-local API of the connector sidecar: JSON over HTTP on a Unix
// socket on the volume the engine and the sidecar share, so only the engine of the same pod
// reaches it. The sidecar serves it (connector/sidecar); the engine's completion-gate plugin
// (connector/vllm/pdgate) heartbeats to it.
package localapi

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"time"
)

// unixScheme marks a local API endpoint on a Unix socket: unix:///var/run/pdcluster/agent.sock.
// In a pod the socket lives on the volume the engine and the agent share, so only the engine
// reaches the API that moves and releases KV.
const unixScheme = "unix://"

// Listen opens the local API listener for addr, a host:port or unix:///path. A socket file left
// by an earlier run of the agent is removed first, or the bind would fail after a restart.
func Listen(addr string) (net.Listener, error) {
	path, ok := strings.CutPrefix(addr, unixScheme)
	if !ok {
		return net.Listen("tcp", addr)
	}
	if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
		return nil, fmt.Errorf("remove stale socket %s: %w", path, err)
	}
	l, err := net.Listen("unix", path)
	if err != nil {
		return nil, err
	}
	// Connecting needs write permission on the socket, and the engine runs as another user than
	// the agent (often root with every capability dropped, which cannot reach another user's
	// socket): any user of the pod may connect. The socket is on the pod's own volume, which no
	// other pod mounts.
	if err := os.Chmod(path, 0o666); err != nil {
		l.Close()
		return nil, fmt.Errorf("open socket %s to the engine's user: %w", path, err)
	}
	return l, nil
}

// Client returns the base URL and the HTTP client that reach endpoint, an http:// URL
// or unix:///path.
func Client(endpoint string, timeout time.Duration) (string, *http.Client) {
	// One agent, many requests at once (a pull or a hold per request, and the events long
	// poll): keep as many connections as are busy, not net/http's default two, which made
	// the engine dial the agent again for most calls under load.
	tr := &http.Transport{MaxIdleConnsPerHost: maxIdleConns, MaxIdleConns: maxIdleConns}
	path, ok := strings.CutPrefix(endpoint, unixScheme)
	if !ok {
		return strings.TrimSuffix(endpoint, "/"), &http.Client{Timeout: timeout, Transport: tr}
	}
	var d net.Dialer
	tr.DialContext = func(ctx context.Context, _, _ string) (net.Conn, error) {
		return d.DialContext(ctx, "unix", path)
	}
	return "http://agent", &http.Client{Timeout: timeout, Transport: tr}
}

const maxIdleConns = 256

// PathGate is POST /v1/gate: the engine's completion-gate plugin (pdgate) reports that it is
// loaded, with its counts so far, every few seconds (body: connector/vllm.Report).
const PathGate = "/v1/gate"

// PathDrain is POST /v1/drain?min=15s&timeout=135s: the pod is being deleted (the sidecar's
// preStop hook, `connector drain`). The sidecar turns unready and answers once its engine holds
// no KV for a pull not made yet and min has passed, or at timeout.
const PathDrain = "/v1/drain"
