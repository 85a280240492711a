// Package kvtransfer is the stand-in transfer engine's gating core: the decode-side pull state
// machine (Puller) and the producer-side tracker (Producer). Both are transport-free and
// driven by explicit events and an injected clock, so every invariant is testable; the agent
// wires them to a network.
//
// The invariants (see docs/design/stand-in-transfer.md):
//  1. The scheduler hears a completion for a pull iff the request was waiting for remote KV
//     and the pull has at least one local destination block, and only once every task drained.
//  2. The producer is notified exactly once per (transfer, decode rank, producer rank) and
//     frees its blocks exactly once; expiry never fires during a send.
//  3. A failed pull reports failed blocks only when it has local blocks, and only after no
//     producer can still write into them.
//  4. Every pull ends within a bounded time; unknown or late transfers are answered at once.
package kvtransfer

import (
	"errors"
	"fmt"
	"slices"
)

// TransferID is the id the router gives both legs of one request (Mooncake's transfer_id).
type TransferID string

// RequestID is an engine-local request id.
type RequestID string

// BlockID is a KV-cache block id, unique within one KV-cache group.
type BlockID int64

// BlockIDs are block ids per KV-cache group. Empty pulls come as nil, [[]] or [[],[]].
type BlockIDs [][]BlockID

// HasLocal reports whether any group holds a block: only such a pull moves data and so only
// such a pull may complete in the scheduler. Deliberately by count, as vLLM's any(): a group of
// placeholder (null) blocks is the engine's to filter before it builds the pull.
func (b BlockIDs) HasLocal() bool {
	for _, g := range b {
		if len(g) > 0 {
			return true
		}
	}
	return false
}

// Count is the number of blocks over all groups.
func (b BlockIDs) Count() int {
	n := 0
	for _, g := range b {
		n += len(g)
	}
	return n
}

// Flatten lists every block id of every group.
func (b BlockIDs) Flatten() []BlockID {
	out := make([]BlockID, 0, b.Count())
	for _, g := range b {
		out = append(out, g...)
	}
	return out
}

// Clone copies the ids so callers can keep mutating their own slices.
func (b BlockIDs) Clone() BlockIDs {
	var s blockStore
	return s.set(b)
}

// blockStore keeps a copy of BlockIDs in storage that is reused, with the transfer or pull
// that owns it, from one request to the next.
type blockStore struct {
	groups [][]BlockID
	flat   []BlockID
}

// set copies blocks into the store (the caller keeps its slices) and returns the copy: one
// backing array for every group, so a new store allocates twice whatever the group count.
func (s *blockStore) set(blocks BlockIDs) BlockIDs {
	if blocks == nil {
		return nil
	}
	s.flat = slices.Grow(s.flat[:0], blocks.Count())
	s.groups = slices.Grow(s.groups[:0], len(blocks))
	for _, g := range blocks {
		start := len(s.flat)
		s.flat = append(s.flat, g...)
		s.groups = append(s.groups, s.flat[start:len(s.flat):len(s.flat)])
	}
	return s.groups
}

// ProducerRank identifies one producer (prefill) worker a pull fans out to.
type ProducerRank int

// ConsumerRank identifies one decode worker.
type ConsumerRank int

// PullMeta is what the decode engine hands its connector for one request.
type PullMeta struct {
	Request    RequestID
	Transfer   TransferID
	LocalBlock BlockIDs
	// WaitingForRemote is true when the scheduler put the request into WAITING_FOR_REMOTE_KVS
	// (load_async). Cleanup pulls of aborted or rejected requests and pulls of requests that
	// went straight to RUNNING carry false: they only tell the producer to release.
	WaitingForRemote bool
	// RemoteEngine and RemoteBootstrap locate the producer (Mooncake's remote_engine_id and
	// remote_bootstrap_addr).
	RemoteEngine    string
	RemoteBootstrap string
}

// NotifiesScheduler is invariant 1, decided once when the pull starts.
func (m PullMeta) NotifiesScheduler() bool { return m.WaitingForRemote && m.LocalBlock.HasLocal() }

// Completion is what the scheduler hears about a pull that notifies it.
type Completion struct {
	Request RequestID
	// Err is nil for a pull whose every task succeeded.
	Err error
	// InvalidBlocks are the local blocks left without valid KV by a failed pull with a single
	// KV-cache group (vLLM's get_block_ids_with_load_errors).
	InvalidBlocks []BlockID
	// FailedRequest marks a failed pull with several KV-cache groups: block ids are unique only
	// per group, so the whole request is reported failed (vLLM's failed_recving).
	FailedRequest bool
}

// CompletionSink is implemented by the decode engine's scheduler. Report is called at most
// once per pull, never under a connector lock.
type CompletionSink interface {
	FinishedReceiving(Completion)
}

// CompletionFunc adapts a function to CompletionSink.
type CompletionFunc func(Completion)

// FinishedReceiving calls f.
func (f CompletionFunc) FinishedReceiving(c Completion) { f(c) }

// ReleaseSink is implemented by the prefill engine's scheduler: it frees a held request's
// blocks. Release is called exactly once per held transfer.
type ReleaseSink interface {
	FinishedSending(Release)
}

// ReleaseFunc adapts a function to ReleaseSink.
type ReleaseFunc func(Release)

// FinishedSending calls f.
func (f ReleaseFunc) FinishedSending(r Release) { f(r) }

// ReleaseReason says why a producer let go of its blocks.
type ReleaseReason string

const (
	ReleaseServed  ReleaseReason = "served"  // every paired consumer was served
	ReleaseExpired ReleaseReason = "expired" // no consumer came in time
	ReleaseAborted ReleaseReason = "aborted" // the prefill request was aborted
)

// Release tells the prefill scheduler to free a request's blocks.
type Release struct {
	Request  RequestID
	Transfer TransferID
	Blocks   int
	Reason   ReleaseReason
}

// Errors a pull or a task can end with. Callers match them with errors.Is.
var (
	ErrTimeout          = errors.New("timed out")
	ErrPeerGone         = errors.New("producer connection lost")
	ErrUnknownTransfer  = errors.New("unknown transfer id")
	ErrReleased         = errors.New("transfer already released")
	ErrAborted          = errors.New("prefill request aborted")
	ErrDuplicatePull    = errors.New("duplicate pull")
	ErrBlockMismatch    = errors.New("producer has fewer blocks than the consumer asked for")
	ErrGroupMismatch    = errors.New("KV-cache group count mismatch")
	ErrDuplicateRequest = errors.New("request already has a pull in flight")
	ErrNoProducers      = errors.New("pull has no producer workers")
)

// TaskError is a task's failure, with where it happened.
type TaskError struct {
	Producer ProducerRank
	Err      error
}

func (e *TaskError) Error() string { return fmt.Sprintf("producer rank %d: %v", e.Producer, e.Err) }
func (e *TaskError) Unwrap() error { return e.Err }
