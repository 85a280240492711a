// Package agentapi is the API between the stand-in engine and its in-process KV transfer agent
// (test/sim/kvtransfer/agent): JSON over HTTP on a loopback listener of the engine's own
// process, as vLLM's connector worker calls its transfer engine in-process. The agent serves it,
// the engine's side calls it (test/sim/kvtransfer/link).
package agentapi

import (
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer"
)

// Paths of the local API.
const (
	PathPulls  = "/v1/pulls"
	PathExpect = "/v1/expect"
	PathReady  = "/v1/ready"
	PathAbort  = "/v1/abort"
	PathEvents = "/v1/events"
)

// EpochReply is the answer to every POST: the run of the agent that took it.
type EpochReply struct {
	Epoch string `json:"epoch"`
}

// Pull is POST /v1/pulls: the consumer engine's update_state_after_alloc or cleanup pull.
type Pull struct {
	Request          kvtransfer.RequestID  `json:"request_id"`
	Transfer         kvtransfer.TransferID `json:"transfer_id"`
	Blocks           kvtransfer.BlockIDs   `json:"local_block_ids"`
	WaitingForRemote bool                  `json:"waiting_for_remote_kvs"`
	RemoteEngine     string                `json:"remote_engine_id"`
	RemoteBootstrap  string                `json:"remote_bootstrap_addr"`
}

// Meta is the pull as the connector core sees it.
func (p Pull) Meta() kvtransfer.PullMeta {
	return kvtransfer.PullMeta{Request: p.Request, Transfer: p.Transfer, LocalBlock: p.Blocks, WaitingForRemote: p.WaitingForRemote, RemoteEngine: p.RemoteEngine, RemoteBootstrap: p.RemoteBootstrap}
}

// Hold is POST /v1/expect, /v1/ready and /v1/abort on a producer.
type Hold struct {
	Transfer kvtransfer.TransferID `json:"transfer_id"`
	Request  kvtransfer.RequestID  `json:"request_id,omitempty"`
	Blocks   kvtransfer.BlockIDs   `json:"block_ids,omitempty"`
}

// Completion is a finished_recving report (with failed blocks or failed_recving on error).
type Completion struct {
	Request       kvtransfer.RequestID `json:"request_id"`
	Error         string               `json:"error,omitempty"`
	InvalidBlocks []kvtransfer.BlockID `json:"invalid_block_ids,omitempty"`
	FailedRequest bool                 `json:"failed_request,omitempty"`
}

// CompletionOf is the report of the core's completion c.
func CompletionOf(c kvtransfer.Completion) *Completion {
	out := &Completion{Request: c.Request, InvalidBlocks: c.InvalidBlocks, FailedRequest: c.FailedRequest}
	if c.Err != nil {
		out.Error = c.Err.Error()
	}
	return out
}

// Release is a finished_sending report: the producer engine may free the request's blocks.
type Release struct {
	Request  kvtransfer.RequestID  `json:"request_id"`
	Transfer kvtransfer.TransferID `json:"transfer_id"`
	Blocks   int                   `json:"blocks"`
	Reason   string                `json:"reason"`
}

// Events is GET /v1/events: what happened since the last call, and the agent's epoch.
type Events struct {
	Epoch       string       `json:"epoch"`
	Completions []Completion `json:"completions,omitempty"`
	Releases    []Release    `json:"releases,omitempty"`
}
