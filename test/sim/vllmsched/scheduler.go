// Package vllmsched models vLLM v1's scheduler as far as KV transfer is concerned: request
// states, block allocation, the KV connector hooks (update_state_after_alloc, request_finished)
// and, above all, the assertions of _update_from_kv_xfer_finished. A completion for a request
// that is not waiting for remote KV kills the engine, as it kills vLLM's EngineCore; the
// connector tests and the engine simulator run against this model.
//
// What it models was measured on vLLM itself (test/realengine, full attention): every prompt
// token's KV moves, a partial last block included, so a pull made when a request is scheduled
// always has a local block; the pulls with none are the cleanup pulls of a request that ends
// before it is scheduled (a decode leg the API server refused, a client abort while the
// request waits). Their reports reach the scheduler with the engine's next step (measured);
// the model sends the pulls at once (vLLM's connector queues them for the next step's
// metadata, which an idle engine does not build: a prefill then holds that KV until decode's
// next request or its own timeout).
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
	// MaxNumSeqs is --max-num-seqs: at most this many requests run at once; a request past it
	// waits in WAITING without blocks (0: no limit but the blocks).
	MaxNumSeqs int
	Policy     Policy
	// OnPull receives the pull the connector must run (consumer): built by
	// update_state_after_alloc and by request_finished of a request never scheduled.
	OnPull func(kvtransfer.PullMeta)
	// OnHold receives the blocks a finished prefill request keeps for its consumers (producer);
	// OnDrop says a prefill request ended without holding blocks: aborted, or stopped before
	// its length cap.
	OnHold func(kvtransfer.TransferID, kvtransfer.RequestID, kvtransfer.BlockIDs)
	OnDrop func(id kvtransfer.TransferID, req kvtransfer.RequestID, aborted bool)
}

// Request is one request's scheduler state.
type Request struct {
	ID       kvtransfer.RequestID
	Transfer kvtransfer.TransferID
	Prompt   int // prompt tokens
	// LocalHit is the number of prompt tokens found in the local prefix cache: whole blocks,
	// never the last prompt token (vLLM computes it).
	LocalHit int
	// External is the number of prompt tokens the connector loads (consumer).
	External    int
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

// countPromptLocked records r's sources as it starts running: r.LocalHit tokens were in the
// local prefix cache, external were pulled, the rest of the prompt is computed here. As in
// vLLM, the last prompt token, recomputed after a pull, counts as pulled.
func (s *Scheduler) countPromptLocked(r *Request, external int) {
	s.tokens.LocalCacheHit += uint64(r.LocalHit)
	s.tokens.ExternalKV += uint64(external)
	s.tokens.LocalCompute += uint64(r.Prompt - r.LocalHit - external)
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
	// vLLM's prefix cache hits whole blocks and leaves the last prompt token to compute.
	hit := min(localHit, prompt-1) / s.cfg.BlockSize * s.cfg.BlockSize
	s.requests[id] = &Request{ID: id, Transfer: transfer, Prompt: prompt, LocalHit: hit, Status: Waiting, Remote: transfer != ""}
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

// Schedule runs one scheduler step: waiting requests get blocks (while fewer than MaxNumSeqs
// run) and either start running or start waiting for remote KV; requests whose pull completed
// resume. It returns the ids that run in this step.
func (s *Scheduler) Schedule() []kvtransfer.RequestID {
	s.mu.Lock()
	var pulls []kvtransfer.PullMeta
	var running []kvtransfer.RequestID
	seqs := 0
	for _, r := range s.requests {
		if r.Status == Running {
			seqs++
		}
	}
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
			external := r.External
			if r.failedRecving {
				external = 0 // policy recompute: the prompt past the local hit is computed here
			} else {
				// Every prompt token's KV is here; vLLM computes the last one again for its logits.
				r.NumComputed = r.Prompt - 1
			}
			r.failedRecving = false
			s.countPromptLocked(r, external)
			r.Status = Running
			seqs++
			running = append(running, r.ID)
		case Waiting:
			if s.cfg.MaxNumSeqs > 0 && seqs >= s.cfg.MaxNumSeqs {
				continue // every sequence slot taken: stays WAITING, without blocks
			}
			blocks, ok := s.allocLocked(s.blocksFor(r.Prompt))
			if !ok {
				continue // no room: stays WAITING, as vLLM's allocate_slots returning None
			}
			r.Blocks = blocks
			r.NumComputed = r.LocalHit
			if s.cfg.Role == vllm.KVConsumer && r.Remote {
				pulls = append(pulls, s.updateStateAfterAllocLocked(r))
				continue
			}
			s.countPromptLocked(r, 0)
			r.Status = Running
			seqs++
			running = append(running, r.ID)
		case Running:
			running = append(running, r.ID)
		}
	}
	s.mu.Unlock()
	s.emitPulls(pulls)
	return running
}

// updateStateAfterAllocLocked is get_num_new_matched_tokens plus update_state_after_alloc on a
// full-attention model: every prompt token past the local hit is loaded, the partial last
// block included. The local hit never covers the last token, so the pull always has a local
// block and the request always waits for it.
func (s *Scheduler) updateStateAfterAllocLocked(r *Request) kvtransfer.PullMeta {
	r.Remote = false // "only 1 KV transfer per request"
	r.External = r.Prompt - r.LocalHit
	first := r.LocalHit / s.cfg.BlockSize
	r.Status = WaitingForRemoteKVs
	return kvtransfer.PullMeta{Request: r.ID, Transfer: r.Transfer, WaitingForRemote: true,
		LocalBlock: kvtransfer.BlockIDs{append([]kvtransfer.BlockID(nil), r.Blocks[first:]...)}}
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

// Finish ends a running request (stop or length cap). A producer request capped at its length
// (a prefill leg's max_tokens 1) keeps its blocks for the consumers (delay_free_blocks).
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
		// Every block the prompt filled, the partial last one included.
		if n := s.blocksFor(r.Prompt); n > 0 {
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
// becomes a cleanup pull with no local block; one waiting for remote KV keeps its blocks until
// the connector reports.
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
