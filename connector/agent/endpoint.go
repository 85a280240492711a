package agent

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
	return net.Listen("unix", path)
}

// endpointClient returns the base URL and the HTTP client that reach endpoint, an http:// URL
// or unix:///path.
func endpointClient(endpoint string, timeout time.Duration) (string, *http.Client) {
	path, ok := strings.CutPrefix(endpoint, unixScheme)
	if !ok {
		return strings.TrimSuffix(endpoint, "/"), &http.Client{Timeout: timeout}
	}
	var d net.Dialer
	tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return d.DialContext(ctx, "unix", path)
	}}
	return "http://agent", &http.Client{Timeout: timeout, Transport: tr}
}
