// Package vllmsched models vLLM v1's scheduler as far as KV transfer is concerned: request
// states, block allocation, the KV connector hooks (update_state_after_alloc, request_finished)
// and, above all, the assertions of _update_from_kv_xfer_finished. A completion for a request
// that is not waiting for remote KV kills the engine, as it kills vLLM's EngineCore; the
// connector tests and the engine simulator run against this model.
package vllmsched

import (
	"errors"
	"fmt"
	"sync"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer"
)

// Status is a request's state, named as in vLLM's RequestStatus.
type Status int

const (
	Waiting Status = iota + 1
	WaitingForRemoteKVs
	Running
	FinishedStopped
	FinishedLengthCapped
	FinishedAborted
	FinishedError
)

var statusNames = map[Status]string{
	Waiting: "WAITING", WaitingForRemoteKVs: "WAITING_FOR_REMOTE_KVS", Running: "RUNNING",
	FinishedStopped: "FINISHED_STOPPED", FinishedLengthCapped: "FINISHED_LENGTH_CAPPED",
	FinishedAborted: "FINISHED_ABORTED", FinishedError: "FINISHED_ERROR",
}

func (s Status) String() string { return statusNames[s] }

// Finished reports whether s is a terminal state.
func (s Status) Finished() bool { return s >= FinishedStopped }

// Policy is kv_load_failure_policy.
type Policy string

const (
	PolicyFail      Policy = "fail"
	PolicyRecompute Policy = "recompute"
)

// ErrEngineDead is returned by every call after an assertion failed.
var ErrEngineDead = errors.New("engine dead")

// Config configures a Scheduler.
type Config struct {
	Role      vllm.KVRole
	BlockSize int
	// Capacity is the number of KV blocks.
	Capacity int
	Policy   Policy
	// OnPull receives the pull the connector must run (consumer): built by
	// update_state_after_alloc and by request_finished of a request never scheduled.
	OnPull func(kvtransfer.PullMeta)
	// OnHold receives the blocks a finished prefill request keeps for its consumers (producer);
	// OnDrop says a prefill request ended without holding blocks: aborted, or finished with no
	// whole block to send.
	OnHold func(kvtransfer.TransferID, kvtransfer.RequestID, kvtransfer.BlockIDs)
	OnDrop func(id kvtransfer.TransferID, req kvtransfer.RequestID, aborted bool)
}

// Request is one request's scheduler state.
type Request struct {
	ID       kvtransfer.RequestID
	Transfer kvtransfer.TransferID
	Prompt   int // prompt tokens
	// LocalHit is the number of prompt tokens found in the local prefix cache.
	LocalHit    int
	Status      Status
	Blocks      []kvtransfer.BlockID
	NumComputed int
	// Remote is do_remote_prefill (consumer) or do_remote_decode (producer).
	Remote bool
	// delayFree: the blocks stay allocated until the connector reports (aborted while waiting).
	delayFree bool
	// FinishedRecving: the connector reported; the next Schedule moves it on.
	finishedRecving bool
	failedRecving   bool
}

// Scheduler is the model. It is safe for concurrent use.
type Scheduler struct {
	cfg      Config
	mu       sync.Mutex
	free     []kvtransfer.BlockID
	requests map[kvtransfer.RequestID]*Request
	dead     error
	// Completions counts connector completions accepted, for tests.
	completions int
	errored     int
	tokens      PromptTokens
}

// PromptTokens counts prompt tokens by where their KV came from, as vLLM's PromptTokenStats
// does (vllm:prompt_tokens_by_source_total) when a request's prefill is scheduled: found in the
// local prefix cache, pulled from another engine, or computed here.
type PromptTokens struct {
	LocalCompute, LocalCacheHit, ExternalKV uint64
}

// countPromptLocked records r's sources as it starts running: hit tokens were in the local
// prefix cache, r.NumComputed-hit were pulled, the rest of the prompt is computed here.
func (s *Scheduler) countPromptLocked(r *Request, hit int) {
	s.tokens.LocalCacheHit += uint64(hit)
	s.tokens.ExternalKV += uint64(r.NumComputed - hit)
	s.tokens.LocalCompute += uint64(r.Prompt - r.NumComputed)
}

// New returns a Scheduler with every block free.
func New(cfg Config) (*Scheduler, error) {
	if cfg.BlockSize <= 0 || cfg.Capacity <= 0 {
		return nil, fmt.Errorf("vllmsched: BlockSize and Capacity must be positive, got %d and %d", cfg.BlockSize, cfg.Capacity)
	}
	if cfg.Policy == "" {
		cfg.Policy = PolicyFail
	}
	s := &Scheduler{cfg: cfg, requests: map[kvtransfer.RequestID]*Request{}}
	for i := cfg.Capacity - 1; i >= 0; i-- {
		s.free = append(s.free, kvtransfer.BlockID(i))
	}
	return s, nil
}

// Dead returns the assertion that killed the engine, or nil.
func (s *Scheduler) Dead() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.dead
}

func (s *Scheduler) crashLocked(format string, args ...any) error {
	if s.dead == nil {
		s.dead = fmt.Errorf("%w: AssertionError: "+format, append([]any{ErrEngineDead}, args...)...)
	}
	return s.dead
}

// Add queues a request in WAITING. transfer is empty for a request without P/D.
func (s *Scheduler) Add(id kvtransfer.RequestID, transfer kvtransfer.TransferID, prompt, localHit int) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.dead != nil {
		return s.dead
	}
	if _, dup := s.requests[id]; dup {
		return fmt.Errorf("request %s already exists", id)
	}
	if prompt <= 0 {
		return fmt.Errorf("request %s: prompt must have at least one token", id)
	}
	s.requests[id] = &Request{ID: id, Transfer: transfer, Prompt: prompt, LocalHit: min(localHit, prompt), Status: Waiting, Remote: transfer != ""}
	return nil
}

// AddAborted is a consumer request submitted with abort_immediately (vLLM's
// notify_kv_transfer_request_rejected): it is never scheduled, and request_finished turns it
// into a cleanup pull with no local block that only tells the producer to release.
func (s *Scheduler) AddAborted(id kvtransfer.RequestID, transfer kvtransfer.TransferID) error {
	s.mu.Lock()
	if s.dead != nil {
		defer s.mu.Unlock()
		return s.dead
	}
	if _, dup := s.requests[id]; dup {
		s.mu.Unlock()
		return fmt.Errorf("request %s already exists", id)
	}
	s.mu.Unlock()
	if s.cfg.Role == vllm.KVConsumer && transfer != "" {
		s.emitPulls([]kvtransfer.PullMeta{{Request: id, Transfer: transfer}})
	}
	return nil
}

// transferableTokens is the part of a prompt that moves between engines: whole blocks only, as
// a partial last block is recomputed on decode. A 13-token prompt with 64-token blocks has none.
func (s *Scheduler) transferableTokens(prompt int) int {
	return prompt / s.cfg.BlockSize * s.cfg.BlockSize
}

func (s *Scheduler) blocksFor(tokens int) int {
	return (tokens + s.cfg.BlockSize - 1) / s.cfg.BlockSize
}

func (s *Scheduler) allocLocked(n int) ([]kvtransfer.BlockID, bool) {
	if n > len(s.free) {
		return nil, false
	}
	out := append([]kvtransfer.BlockID(nil), s.free[len(s.free)-n:]...)
	s.free = s.free[:len(s.free)-n]
	return out, true
}

func (s *Scheduler) freeLocked(r *Request) {
	s.free = append(s.free, r.Blocks...)
	r.Blocks = nil
}

// Schedule runs one scheduler step: waiting requests get blocks and either start running or
// start waiting for remote KV; requests whose pull completed resume. It returns the ids that
// run in this step.
func (s *Scheduler) Schedule() []kvtransfer.RequestID {
	s.mu.Lock()
	var pulls []kvtransfer.PullMeta
	var running []kvtransfer.RequestID
	for _, r := range s.requests {
		switch r.Status {
		case WaitingForRemoteKVs:
			if !r.finishedRecving {
				continue
			}
			// _update_waiting_for_remote_kv: the pulled blocks count as computed.
			r.finishedRecving = false
			if r.failedRecving && s.cfg.Policy == PolicyFail {
				r.Status = FinishedError
				s.errored++
				s.freeLocked(r)
				delete(s.requests, r.ID)
				continue
			}
			if !r.failedRecving {
				r.NumComputed = min(s.transferableTokens(r.Prompt), r.Prompt-1)
			}
			r.failedRecving = false
			s.countPromptLocked(r, s.transferableTokens(r.LocalHit))
			r.Status = Running
			running = append(running, r.ID)
		case Waiting:
			blocks, ok := s.allocLocked(s.blocksFor(r.Prompt))
			if !ok {
				continue // no room: stays WAITING, as vLLM's allocate_slots returning None
			}
			r.Blocks = blocks
			r.NumComputed = s.transferableTokens(r.LocalHit)
			if s.cfg.Role == vllm.KVConsumer && r.Remote {
				pulls = append(pulls, s.updateStateAfterAllocLocked(r))
				if r.Status == WaitingForRemoteKVs {
					continue
				}
			}
			s.countPromptLocked(r, r.NumComputed)
			r.Status = Running
			running = append(running, r.ID)
		case Running:
			running = append(running, r.ID)
		}
	}
	s.mu.Unlock()
	s.emitPulls(pulls)
	return running
}

// updateStateAfterAllocLocked is get_num_new_matched_tokens plus update_state_after_alloc.
// Only whole remote blocks beyond the local hit are pulled; with none, the request runs now and
// the pull only tells the producer to release (the empty pull of the seed bug).
func (s *Scheduler) updateStateAfterAllocLocked(r *Request) kvtransfer.PullMeta {
	r.Remote = false // "only 1 KV transfer per request"
	ext := s.transferableTokens(r.Prompt) - r.NumComputed
	meta := kvtransfer.PullMeta{Request: r.ID, Transfer: r.Transfer}
	if ext <= 0 {
		return meta
	}
	first := r.NumComputed / s.cfg.BlockSize
	meta.LocalBlock = kvtransfer.BlockIDs{append([]kvtransfer.BlockID(nil), r.Blocks[first:first+ext/s.cfg.BlockSize]...)}
	meta.WaitingForRemote = true
	r.Status = WaitingForRemoteKVs
	return meta
}

func (s *Scheduler) emitPulls(pulls []kvtransfer.PullMeta) {
	if s.cfg.OnPull == nil {
		return
	}
	for _, p := range pulls {
		s.cfg.OnPull(p)
	}
}

// FinishedReceiving implements kvtransfer.CompletionSink with vLLM's assertions.
func (s *Scheduler) FinishedReceiving(c kvtransfer.Completion) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.dead != nil {
		return
	}
	r, ok := s.requests[c.Request]
	if !ok {
		_ = s.crashLocked("assert req_id in self.requests (%s)", c.Request)
		return
	}
	switch {
	case r.Status == WaitingForRemoteKVs && !r.finishedRecving:
		s.completions++
		r.finishedRecving = true
		r.failedRecving = c.Err != nil
	case r.Status.Finished() && r.delayFree:
		s.completions++
		r.delayFree = false
		s.freeLocked(r)
		delete(s.requests, r.ID)
	default:
		_ = s.crashLocked("assert request.is_finished() (%s is %s)", c.Request, r.Status)
	}
}

// Finish ends a running request (stop or length cap). A producer request keeps its blocks for
// the consumers (delay_free_blocks) when it has whole blocks to send.
func (s *Scheduler) Finish(id kvtransfer.RequestID, status Status) error {
	s.mu.Lock()
	r, ok := s.requests[id]
	if s.dead != nil || !ok || r.Status != Running || !status.Finished() {
		defer s.mu.Unlock()
		if s.dead != nil {
			return s.dead
		}
		return fmt.Errorf("finish %s: not running", id)
	}
	r.Status = status
	hold := s.requestFinishedLocked(r)
	s.mu.Unlock()
	s.emitHold(r, hold)
	return nil
}

// requestFinishedLocked is the producer's request_finished: it returns the blocks to hold, or
// nil when the request's blocks are freed now.
func (s *Scheduler) requestFinishedLocked(r *Request) kvtransfer.BlockIDs {
	if s.cfg.Role == vllm.KVProducer && r.Transfer != "" && r.Status == FinishedLengthCapped {
		n := s.transferableTokens(r.Prompt) / s.cfg.BlockSize
		if n > 0 {
			r.delayFree = true
			return kvtransfer.BlockIDs{append([]kvtransfer.BlockID(nil), r.Blocks[:n]...)}
		}
	}
	s.freeLocked(r)
	delete(s.requests, r.ID)
	return nil
}

func (s *Scheduler) emitHold(r *Request, hold kvtransfer.BlockIDs) {
	if s.cfg.Role != vllm.KVProducer || r.Transfer == "" {
		return
	}
	if hold != nil && s.cfg.OnHold != nil {
		s.cfg.OnHold(r.Transfer, r.ID, hold)
	} else if hold == nil && s.cfg.OnDrop != nil {
		s.cfg.OnDrop(r.Transfer, r.ID, false)
	}
}

// Abort is a client abort. A consumer request not yet scheduled is freed at once and its pull
// becomes an empty cleanup pull; one waiting for remote KV keeps its blocks until the
// connector reports.
func (s *Scheduler) Abort(id kvtransfer.RequestID) error {
	s.mu.Lock()
	if s.dead != nil {
		defer s.mu.Unlock()
		return s.dead
	}
	r, ok := s.requests[id]
	if !ok || r.Status.Finished() {
		s.mu.Unlock()
		return nil // already gone: aborts race with completion
	}
	var pull *kvtransfer.PullMeta
	wasWaiting := r.Status == WaitingForRemoteKVs
	r.Status = FinishedAborted
	switch {
	case wasWaiting && !r.finishedRecving:
		// finish_requests: delay_free_blocks = id not in finished_recving_kv_req_ids.
		r.delayFree = true
	case s.cfg.Role == vllm.KVConsumer && r.Remote:
		// request_finished with do_remote_prefill still set: notify-only cleanup pull.
		pull = &kvtransfer.PullMeta{Request: r.ID, Transfer: r.Transfer}
		s.freeLocked(r)
		delete(s.requests, r.ID)
	default:
		s.freeLocked(r)
		delete(s.requests, r.ID)
	}
	s.mu.Unlock()
	if pull != nil {
		s.emitPulls([]kvtransfer.PullMeta{*pull})
	}
	if s.cfg.Role == vllm.KVProducer && r.Transfer != "" && !wasWaiting && s.cfg.OnDrop != nil {
		s.cfg.OnDrop(r.Transfer, r.ID, true)
	}
	return nil
}

// FinishedSending implements kvtransfer.ReleaseSink: the producer frees a held request.
func (s *Scheduler) FinishedSending(rel kvtransfer.Release) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.dead != nil {
		return
	}
	r, ok := s.requests[rel.Request]
	if !ok || !r.delayFree {
		_ = s.crashLocked("finished_sending for %s, which holds no blocks", rel.Request)
		return
	}
	r.delayFree = false
	s.freeLocked(r)
	delete(s.requests, r.ID)
}

// HasRequests is vLLM's has_requests: whether the engine has anything to step for.
func (s *Scheduler) HasRequests() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.requests) > 0
}

// HeldSends is how many finished requests a producer keeps blocks of for a pull not made yet
// (the scheduler's requests waiting on delayed free, which vLLM's drain waits for).
func (s *Scheduler) HeldSends() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cfg.Role != vllm.KVProducer {
		return 0
	}
	n := 0
	for _, r := range s.requests {
		if r.Status.Finished() && r.delayFree {
			n++
		}
	}
	return n
}

// Stats is a snapshot for tests and metrics.
type Stats struct {
	Requests    int
	FreeBlocks  int
	Completions int
	Errored     int
	ByStatus    map[Status]int
	Tokens      PromptTokens
}

// Stats returns a snapshot.
func (s *Scheduler) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := Stats{Requests: len(s.requests), FreeBlocks: len(s.free), Completions: s.completions, Errored: s.errored, ByStatus: map[Status]int{}, Tokens: s.tokens}
	for _, r := range s.requests {
		st.ByStatus[r.Status]++
	}
	return st
}

// Lookup returns a copy of a request's state.
func (s *Scheduler) Lookup(id kvtransfer.RequestID) (Request, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.requests[id]
	if !ok {
		return Request{}, false
	}
	cp := *r
	cp.Blocks = append([]kvtransfer.BlockID(nil), r.Blocks...)
	return cp, true
}
