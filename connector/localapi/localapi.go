// Package localapi is the local API between an engine and its connector agent: JSON over HTTP,
// on a Unix socket on the volume the two containers of a pod share. The agent serves it
// (connector/agent), the engine's side calls it (connector/link, and the vLLM plugin).
package localapi

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"pdcluster.dev/pdcluster-operator/connector"
	"pdcluster.dev/pdcluster-operator/connector/bootstrap"
)

// Paths of the local API.
const (
	PathPulls  = "/v1/pulls"
	PathExpect = "/v1/expect"
	PathReady  = "/v1/ready"
	PathAbort  = "/v1/abort"
	PathEvents = "/v1/events"
)

// PathInfo is GET /v1/info: the agent's run, the KV file layout the engine opens beside it,
// and, on a producer started with --engine-registers, the worker registration the engine puts
// in its bootstrap server (as vLLM's prefill workers register their transfer engines there).
const PathInfo = "/v1/info"

// Info is the answer to GET /v1/info.
type Info struct {
	Epoch      string `json:"epoch"`
	KVBlocks   int    `json:"kv_blocks"`
	BlockBytes int    `json:"block_bytes"`
	// Registration is set on a producer whose engine registers it; its engine id changes with
	// every run of the agent.
	Registration *bootstrap.Registration `json:"registration,omitempty"`
}

// EpochReply is the answer to every POST: the run of the agent that took it.
type EpochReply struct {
	Epoch string `json:"epoch"`
}

// Pull is POST /v1/pulls: the consumer engine's update_state_after_alloc or cleanup pull.
type Pull struct {
	Request          connector.RequestID  `json:"request_id"`
	Transfer         connector.TransferID `json:"transfer_id"`
	Blocks           connector.BlockIDs   `json:"local_block_ids"`
	WaitingForRemote bool                 `json:"waiting_for_remote_kvs"`
	RemoteEngine     string               `json:"remote_engine_id"`
	RemoteBootstrap  string               `json:"remote_bootstrap_addr"`
}

// Meta is the pull as the connector core sees it.
func (p Pull) Meta() connector.PullMeta {
	return connector.PullMeta{Request: p.Request, Transfer: p.Transfer, LocalBlock: p.Blocks, WaitingForRemote: p.WaitingForRemote, RemoteEngine: p.RemoteEngine, RemoteBootstrap: p.RemoteBootstrap}
}

// Hold is POST /v1/expect, /v1/ready and /v1/abort on a producer.
type Hold struct {
	Transfer connector.TransferID `json:"transfer_id"`
	Request  connector.RequestID  `json:"request_id,omitempty"`
	Blocks   connector.BlockIDs   `json:"block_ids,omitempty"`
}

// Completion is a finished_recving report (with failed blocks or failed_recving on error).
type Completion struct {
	Request       connector.RequestID `json:"request_id"`
	Error         string              `json:"error,omitempty"`
	InvalidBlocks []connector.BlockID `json:"invalid_block_ids,omitempty"`
	FailedRequest bool                `json:"failed_request,omitempty"`
}

// CompletionOf is the report of the core's completion c.
func CompletionOf(c connector.Completion) *Completion {
	out := &Completion{Request: c.Request, InvalidBlocks: c.InvalidBlocks, FailedRequest: c.FailedRequest}
	if c.Err != nil {
		out.Error = c.Err.Error()
	}
	return out
}

// Release is a finished_sending report: the producer engine may free the request's blocks.
type Release struct {
	Request  connector.RequestID  `json:"request_id"`
	Transfer connector.TransferID `json:"transfer_id"`
	Blocks   int                  `json:"blocks"`
	Reason   string               `json:"reason"`
}

// Events is GET /v1/events: what happened since the last call, and the agent's epoch.
type Events struct {
	Epoch       string       `json:"epoch"`
	Completions []Completion `json:"completions,omitempty"`
	Releases    []Release    `json:"releases,omitempty"`
}

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
