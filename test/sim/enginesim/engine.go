// Package enginesim is an OpenAI-compatible engine simulator with vLLM's request states and
// KV-connector hooks (test/sim/vllmsched): a prefill engine (kv_producer) holds KV blocks for
// its consumers, a decode engine (kv_consumer) pulls them through its transfer engine (an
// in-process agent, test/sim/kvtransfer, as vLLM runs Mooncake's in-process) and
// verifies the bytes. A completion for a request that is not waiting kills the engine, as it
// kills vLLM.
package enginesim

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/bootstrap"
	"pdcluster.dev/pdcluster-operator/test/sim/kvpublish"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer/agentapi"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer/kvfile"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer/link"
	"pdcluster.dev/pdcluster-operator/test/sim/vllmsched"
)

// Config configures an Engine.
type Config struct {
	Model     string
	Role      vllm.KVRole // "" for an engine without P/D
	BlockSize int
	// Capacity is the number of KV blocks.
	Capacity    int
	MaxModelLen int
	// MaxNumSeqs is --max-num-seqs (0: only the blocks limit how many run).
	MaxNumSeqs    int
	PrefixCaching bool
	Policy        vllmsched.Policy
	// StepTime is the simulated time of one scheduler step (one token for each running request).
	StepTime time.Duration
	// KV is the KV-cache memory shared with the agent; required with a Role.
	KV *kvfile.File
	// Agent is the in-process transfer agent's local API (http://host:port); required
	// with a Role.
	Agent string
	// BootstrapAddr is how consumers reach this producer's bootstrap registry, returned in
	// kv_transfer_params (the NIXL-style sequential flow needs it).
	BootstrapAddr string
	// WorkerReportsEmptyPulls is vLLM's stock Mooncake worker before 0.32: every settled pull
	// is reported as finished receiving, local blocks or not (the seed bug). The stand-in
	// reports a pull with no local block once its agent took it.
	WorkerReportsEmptyPulls bool
	// Gate runs pdgate's completion gate on the scheduler side, as vLLM does with the plugin
	// loaded; GateTTL is its TTL (0: pdgate's default).
	Gate    bool
	GateTTL time.Duration
	// DropKVTransferParams makes a decode engine ignore every request's kv_transfer_params, as
	// behind a router that drops them (fault injection): it recomputes every prompt.
	DropKVTransferParams bool
	// Connector names the connector whose vLLM transfer counters the engine exports
	// ("mooncake", "nixl"; "" none): failed receives on decode, expired held requests on prefill.
	Connector string
	// DPRank is the engine's data-parallel rank as its worker registers it (and vLLM's
	// metrics' engine label): a `vllm serve` with --data-parallel-size N runs N engines.
	DPRank int
	// Events, if set, publishes the prefix cache's changes as vLLM's KV cache events do
	// (--kv-events-config): the whole blocks of each request, hit or newly cached, and a reset.
	Events *kvpublish.Publisher
	Log    logr.Logger
}

// Engine is one simulated vLLM engine.
type Engine struct {
	cfg   Config
	sched *vllmsched.Scheduler
	link  *link.Link
	// boot asks this producer's bootstrap registry for its engine id (for a second at most: it
	// changes when the agent restarts).
	boot   *bootstrap.Client
	wake   chan struct{}
	nextID atomic.Uint64

	// reports are the worker's finished-receiving reports, held until the scheduler's next
	// step (vLLM's worker hands them over in the model output of a step); gate filters them.
	rmu     sync.Mutex
	reports []kvtransfer.Completion
	gate    *gate

	// failedRecvs and expired are the connector's counters (Collector).
	failedRecvs, expired atomic.Uint64

	mu   sync.Mutex
	reqs map[kvtransfer.RequestID]*request
	// remotes locates the producer of each consumer request with a transfer until its pull is
	// sent: a cleanup pull goes out at the next step, after its request has ended.
	remotes map[kvtransfer.RequestID]remote
	prefix  map[uint64]struct{} // block hashes in the prefix cache
	stats   Stats
	// events hands what cfg.Events publishes to its goroutine in the cache's order (vLLM
	// publishes from a queue on its own thread, off the scheduler's).
	events chan []map[string]any
}

// Stats counts what the engine did.
type Stats struct {
	Requests       uint64
	Completed      uint64
	Errored        uint64
	Aborted        uint64
	BlocksVerified uint64 // pulled blocks whose bytes matched the prompt's KV
}

type request struct {
	id       kvtransfer.RequestID
	tokens   []int
	hashes   []uint64 // every block's, the partial last one included (blockHashes)
	maxTok   int
	ignoreEO bool
	seed     uint64
	out      chan int      // generated tokens, closed when done
	done     chan struct{} // closed when finished; err and finish are set before
	err      error
	finish   string
	pulled   kvtransfer.BlockIDs // blocks the connector pulled into (consumer)
	pullErr  bool
	computed bool
	produced int
	transfer kvtransfer.TransferID
}

type remote struct{ engine, bootstrap string }

// New builds an engine; Run drives it.
func New(cfg Config) (*Engine, error) {
	if cfg.Role != "" && (cfg.KV == nil || cfg.Agent == "") {
		return nil, errors.New("enginesim: a P/D role needs a KV file and an agent address")
	}
	if cfg.KV != nil && cfg.KV.Blocks() < cfg.Capacity {
		return nil, fmt.Errorf("enginesim: KV memory has %d blocks, capacity is %d", cfg.KV.Blocks(), cfg.Capacity)
	}
	if cfg.MaxModelLen <= 0 {
		cfg.MaxModelLen = cfg.Capacity * cfg.BlockSize
	}
	e := &Engine{cfg: cfg, wake: make(chan struct{}, 1), reqs: map[kvtransfer.RequestID]*request{}, remotes: map[kvtransfer.RequestID]remote{}, prefix: map[uint64]struct{}{}, boot: bootstrap.NewClient()}
	e.boot.MaxAge = time.Second
	if cfg.Events != nil {
		e.events = make(chan []map[string]any, 4096)
		go e.publish()
	}
	if cfg.Gate {
		e.gate = newGate(cfg.GateTTL, DefaultGateGrace, nil)
	}
	if cfg.Role != "" {
		e.link = link.New(cfg.Agent, kvtransfer.CompletionFunc(e.finishedReceiving), kvtransfer.ReleaseFunc(e.finishedSending))
		e.link.Log = cfg.Log
	}
	var err error
	e.sched, err = vllmsched.New(vllmsched.Config{
		Role: cfg.Role, BlockSize: cfg.BlockSize, Capacity: cfg.Capacity, MaxNumSeqs: cfg.MaxNumSeqs, Policy: cfg.Policy,
		OnPull: e.onPull, OnHold: e.onHold, OnDrop: e.onDrop,
	})
	if err != nil {
		return nil, fmt.Errorf("enginesim: %w", err)
	}
	return e, nil
}

// Dead is the assertion that killed the engine, or nil.
func (e *Engine) Dead() error { return e.sched.Dead() }

// Scheduler exposes the scheduler state for tests and /debug.
func (e *Engine) Scheduler() vllmsched.Stats { return e.sched.Stats() }

// GateCounts is what the engine's completion gate did (zero without one).
func (e *Engine) GateCounts() vllm.Counts {
	e.rmu.Lock()
	defer e.rmu.Unlock()
	if e.gate == nil {
		return vllm.Counts{}
	}
	return e.gate.counts
}

// HeldSends is how many requests' KV blocks a producer holds for pulls not made yet.
func (e *Engine) HeldSends() int { return e.sched.HeldSends() }

// HasWork is vLLM's EngineCore.has_work: requests running, waiting, or holding blocks for a
// pull. A draining engine exits once it is false.
func (e *Engine) HasWork() bool { return e.sched.HasRequests() }

// Stats returns the engine's counters.
func (e *Engine) Stats() Stats {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.stats
}

// Run drives the scheduler and the connector link until ctx ends.
func (e *Engine) Run(ctx context.Context) {
	if e.link != nil {
		go e.link.Run(ctx)
	}
	for ctx.Err() == nil {
		if err := e.sched.Dead(); err != nil {
			e.failAll(err)
			select {
			case <-ctx.Done():
			case <-e.wake:
			}
			continue
		}
		if !e.sched.HasRequests() {
			// EngineCore with no request blocks on its input queue: no step, so a report the
			// worker holds waits for the next request's step, however late.
			select {
			case <-ctx.Done():
			case <-e.wake:
			}
			continue
		}
		running := e.sched.Schedule()
		delivered := e.deliverReports()
		e.reapFailedLoads()
		if len(running) == 0 {
			if delivered {
				continue // a request may resume at once
			}
			select {
			case <-ctx.Done():
			case <-e.wake:
			case <-time.After(50 * time.Millisecond): // pulls complete without a wake
			}
			continue
		}
		for _, id := range running {
			e.step(id)
		}
		if e.cfg.StepTime > 0 {
			time.Sleep(e.cfg.StepTime)
		}
	}
}

// reapFailedLoads ends requests the scheduler finished with FINISHED_ERROR after a failed KV
// load (policy fail): the scheduler drops them without running them again.
func (e *Engine) reapFailedLoads() {
	if e.cfg.Policy == vllmsched.PolicyRecompute {
		return
	}
	e.mu.Lock()
	var failed []*request
	for _, r := range e.reqs {
		if r.pullErr {
			if _, ok := e.sched.Lookup(r.id); !ok {
				failed = append(failed, r)
			}
		}
	}
	e.mu.Unlock()
	for _, r := range failed {
		e.end(r, fmt.Errorf("KV load from the prefill engine failed (kv_load_failure_policy=fail)"), "error")
	}
}

func (e *Engine) kick() {
	select {
	case e.wake <- struct{}{}:
	default:
	}
}

// step runs one request for one step: prefill on its first, then one token.
func (e *Engine) step(id kvtransfer.RequestID) {
	e.mu.Lock()
	r, ok := e.reqs[id]
	e.mu.Unlock()
	if !ok {
		return
	}
	if !r.computed {
		if err := e.prefill(r); err != nil {
			_ = e.sched.Finish(id, vllmsched.FinishedError)
			e.end(r, err, "error")
			return
		}
		r.computed = true
	}
	tok := nextToken(r.seed, r.produced)
	r.produced++
	// An abort may end the request between two steps; sending on its closed channel would panic.
	e.mu.Lock()
	_, live := e.reqs[id]
	if live {
		r.out <- tok // buffered to maxTok: never blocks
	}
	e.mu.Unlock()
	if !live {
		return
	}
	switch {
	case r.produced >= r.maxTok:
		_ = e.sched.Finish(id, vllmsched.FinishedLengthCapped)
		e.end(r, nil, "length")
	case !r.ignoreEO && tok%211 == 0: // a simulated end-of-sequence token
		_ = e.sched.Finish(id, vllmsched.FinishedStopped)
		e.end(r, nil, "stop")
	}
}

// prefill verifies the pulled KV (consumer) and computes the rest of the prompt's blocks.
func (e *Engine) prefill(r *request) error {
	st, ok := e.sched.Lookup(r.id)
	if !ok {
		return fmt.Errorf("request %s vanished from the scheduler", r.id)
	}
	if e.cfg.KV == nil {
		e.remember(r)
		return nil
	}
	buf := make([]byte, e.cfg.KV.BlockBytes())
	want := make([]byte, e.cfg.KV.BlockBytes())
	pulled := map[kvtransfer.BlockID]bool{}
	if !r.pullErr {
		for _, b := range r.pulled.Flatten() {
			pulled[b] = true
		}
	}
	for i, b := range st.Blocks {
		if i >= len(r.hashes) {
			break
		}
		blockContent(r.hashes[i], want)
		if pulled[b] {
			if err := e.cfg.KV.Read(int64(b), buf); err != nil {
				return fmt.Errorf("read pulled block %d: %w", b, err)
			}
			if string(buf) != string(want) {
				return fmt.Errorf("pulled KV block %d (prompt block %d) does not hold this prompt's KV", b, i)
			}
			e.mu.Lock()
			e.stats.BlocksVerified++
			e.mu.Unlock()
			continue
		}
		if err := e.cfg.KV.Write(int64(b), want); err != nil {
			return fmt.Errorf("write block %d: %w", b, err)
		}
	}
	e.remember(r)
	return nil
}

// remember adds the prompt's whole blocks to the prefix cache (bounded: cleared when full) and
// publishes them as vLLM's KV events do, in one batch: the leading blocks the cache held
// already as stored again (vLLM reports a request's prefix-cache hits, from the prompt's first
// block), then the blocks it did not hold, after the block before them.
func (e *Engine) remember(r *request) {
	if !e.cfg.PrefixCaching {
		return
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.prefix) > 100_000 {
		clear(e.prefix)
		e.emit(kvpublish.Cleared())
	}
	whole := len(r.tokens) / e.cfg.BlockSize
	held := 0
	for held < whole {
		if _, ok := e.prefix[r.hashes[held]]; !ok {
			break
		}
		held++
	}
	for _, h := range r.hashes[held:whole] {
		e.prefix[h] = struct{}{}
	}
	if e.events == nil {
		return
	}
	var events []map[string]any
	blocks := func(from, to int, parent *uint64) map[string]any {
		tokens := make([]uint32, 0, (to-from)*e.cfg.BlockSize)
		for _, t := range r.tokens[from*e.cfg.BlockSize : to*e.cfg.BlockSize] {
			tokens = append(tokens, uint32(t))
		}
		return kvpublish.Stored(r.hashes[from:to], parent, tokens, e.cfg.BlockSize)
	}
	if held > 0 {
		events = append(events, blocks(0, held, nil))
	}
	if held < whole {
		var parent *uint64
		if held > 0 {
			parent = &r.hashes[held-1]
		}
		events = append(events, blocks(held, whole, parent))
	}
	e.emit(events...)
}

// emit queues a batch of events for publishing (e.mu held: in the cache's order); a full queue
// drops it, as a publisher past its high-water mark does.
func (e *Engine) emit(events ...map[string]any) {
	if e.events == nil || len(events) == 0 {
		return
	}
	select {
	case e.events <- events:
	default:
	}
}

// publish sends the queued events for the engine's lifetime, what queued since the last send
// as one batch: vLLM publishes one batch per engine step, every request's events of the step
// in it, so under load a batch carries several requests'.
func (e *Engine) publish() {
	for events := range e.events {
		for more := true; more; {
			select {
			case next := <-e.events:
				events = append(events, next...)
			default:
				more = false
			}
		}
		if err := e.cfg.Events.Publish(events...); err != nil {
			e.cfg.Log.Error(err, "publish KV cache events")
		}
	}
}

func (e *Engine) localHit(hashes []uint64) int {
	if !e.cfg.PrefixCaching {
		return 0
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	n := 0
	for _, h := range hashes {
		if _, ok := e.prefix[h]; !ok {
			break
		}
		n++
	}
	return n * e.cfg.BlockSize
}

func (e *Engine) end(r *request, err error, finish string) {
	e.mu.Lock()
	if _, ok := e.reqs[r.id]; !ok {
		e.mu.Unlock()
		return
	}
	delete(e.reqs, r.id)
	switch {
	case err != nil:
		e.stats.Errored++
	case finish == "abort":
		e.stats.Aborted++
	default:
		e.stats.Completed++
	}
	r.err, r.finish = err, finish
	close(r.out) // under e.mu, so step never sends on it after this
	e.mu.Unlock()
	close(r.done)
}

func (e *Engine) failAll(err error) {
	e.mu.Lock()
	var all []*request
	for _, r := range e.reqs {
		all = append(all, r)
	}
	e.mu.Unlock()
	for _, r := range all {
		e.end(r, fmt.Errorf("EngineCore died: %w", err), "error")
	}
}

// The scheduler's connector hooks.

func (e *Engine) onPull(meta kvtransfer.PullMeta) {
	e.mu.Lock()
	if r := e.reqs[meta.Request]; r != nil {
		r.pulled = meta.LocalBlock.Clone()
	}
	at := e.remotes[meta.Request]
	delete(e.remotes, meta.Request)
	e.mu.Unlock()
	p := agentapi.Pull{Request: meta.Request, Transfer: meta.Transfer, Blocks: meta.LocalBlock, WaitingForRemote: meta.WaitingForRemote,
		RemoteEngine: at.engine, RemoteBootstrap: at.bootstrap}
	if e.gate != nil {
		e.rmu.Lock()
		e.gate.observe(meta)
		e.rmu.Unlock()
	}
	go func() {
		err := e.link.Pull(context.Background(), p)
		if err != nil {
			e.cfg.Log.Info("pull not taken by the transfer engine", "request", p.Request, "err", err.Error())
		}
		if err == nil && e.cfg.WorkerReportsEmptyPulls && !meta.NotifiesScheduler() {
			e.finishedReceiving(kvtransfer.Completion{Request: meta.Request})
		}
	}()
}

func (e *Engine) onHold(transfer kvtransfer.TransferID, req kvtransfer.RequestID, blocks kvtransfer.BlockIDs) {
	go func() {
		if err := e.link.Ready(context.Background(), transfer, req, blocks); err != nil {
			e.cfg.Log.Info("hold not taken by the transfer engine; blocks freed", "request", req, "err", err.Error())
		}
	}()
}

func (e *Engine) onDrop(transfer kvtransfer.TransferID, req kvtransfer.RequestID, aborted bool) {
	go func() {
		var err error
		if aborted {
			err = e.link.Abort(context.Background(), transfer)
		} else {
			err = e.link.Ready(context.Background(), transfer, req, nil) // consumers still hear back
		}
		if err != nil {
			e.cfg.Log.Info("drop not delivered to the transfer engine", "request", req, "err", err.Error())
		}
	}()
}

// finishedReceiving is the worker's report of a pull: held until the scheduler's next step.
func (e *Engine) finishedReceiving(c kvtransfer.Completion) {
	if c.Err != nil {
		e.failedRecvs.Add(1)
	}
	e.rmu.Lock()
	e.reports = append(e.reports, c)
	e.rmu.Unlock()
	e.kick()
}

// deliverReports is the step's model output reaching the scheduler: the held reports, through
// the gate when there is one. It reports whether any reached the scheduler.
func (e *Engine) deliverReports() bool {
	e.rmu.Lock()
	reports := e.reports
	e.reports = nil
	if e.gate != nil {
		e.gate.tick()
		kept := reports[:0]
		for _, c := range reports {
			if e.gate.pass(c) {
				kept = append(kept, c)
			}
		}
		reports = kept
	}
	e.rmu.Unlock()
	for _, c := range reports {
		e.mu.Lock()
		if r := e.reqs[c.Request]; r != nil && c.Err != nil {
			r.pullErr = true
		}
		e.mu.Unlock()
		e.sched.FinishedReceiving(c)
		if c.Err != nil {
			e.cfg.Log.Info("KV pull failed", "request", c.Request, "policy", e.cfg.Policy, "err", c.Err.Error())
		}
	}
	return len(reports) > 0
}

func (e *Engine) finishedSending(rel kvtransfer.Release) {
	if rel.Reason == kvtransfer.ReleaseExpired {
		e.expired.Add(1)
	}
	e.sched.FinishedSending(rel)
	e.kick()
}

func (e *Engine) newID() kvtransfer.RequestID {
	return kvtransfer.RequestID("cmpl-" + strconv.FormatUint(e.nextID.Add(1), 10))
}

func seedOf(tokens []int) uint64 {
	h := fnv.New64a()
	for _, t := range tokens {
		_, _ = h.Write([]byte(strconv.Itoa(t)))
	}
	return h.Sum64()
}
