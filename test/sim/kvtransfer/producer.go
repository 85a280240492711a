package kvtransfer

import (
	"errors"
	"fmt"
	"hash/maphash"
	"sync"
	"time"

	"k8s.io/utils/clock"
)

// ProducerConfig configures the prefill-side tracker of one producer worker.
type ProducerConfig struct {
	// Sink is the prefill scheduler; it is told exactly once to free each held request.
	Sink ReleaseSink
	// Clock drives expiry; tests inject a fake one.
	Clock clock.PassiveClock
	// Rank is this worker's producer rank.
	Rank ProducerRank
	// HoldTimeout frees blocks that no consumer came for (Mooncake's ABORT_REQUEST_TIMEOUT, 480 s).
	HoldTimeout time.Duration
	// ReadyTimeout bounds how long a pull may wait for an admitted request to finish prefill.
	ReadyTimeout time.Duration
	// TombstoneTTL is how long at least a released transfer is remembered, so a late pull
	// hears ErrReleased rather than ErrUnknownTransfer. Tombstones are the only state a late
	// pull meets; they are forgotten a generation at a time, within twice the TTL.
	TombstoneTTL time.Duration
}

// PullRequest is a consumer's pull as the producer sees it.
type PullRequest struct {
	Transfer TransferID
	Consumer ConsumerRank
	// Consumers is how many decode ranks pull this transfer from this producer rank (the TP
	// fan-in): blocks are released once that many were served.
	Consumers int
	// Blocks are the consumer's local destination blocks; empty for a notify-only pull.
	Blocks BlockIDs
}

// BlockCopy is one block to write: the producer's Src into the consumer's Dst, in Group.
type BlockCopy struct {
	Group int
	Src   BlockID
	Dst   BlockID
}

// Action is what the transport must do with a pull.
type Action uint8

const (
	// ActionWait parks the pull: the request has not finished prefill. A later Ready, Abort or
	// Expire returns its decision.
	ActionWait Action = iota + 1
	// ActionSend writes Copies (possibly none, for a notify-only pull), then calls SendDone.
	ActionSend
	// ActionReject answers the consumer with Err at once; nothing else is owed.
	ActionReject
)

// Decision answers one pull.
type Decision struct {
	Pull   PullRequest
	Action Action
	Copies []BlockCopy
	Err    error
}

type waiter struct {
	pull     PullRequest
	deadline time.Time
}

type transfer struct {
	request  RequestID
	blocks   BlockIDs
	ready    bool
	aborted  bool
	need     int         // consumers to serve; 0 until the first pull says
	served   consumerSet // each consumer is notified once (invariant 2)
	inflight consumerSet // sends in progress: expiry and abort wait for them
	deadline time.Time   // expiry of a held transfer, or of an admitted one
	waiting  []waiter
	retired  bool            // released and back in the free list: nothing may decide on it any more
	ranks    [4]ConsumerRank // backing store of served and inflight for the usual small fan-in
	store    blockStore      // backs blocks; kept when the transfer is reused
}

// maxFree bounds the producer's free list of retired transfers.
const maxFree = 256

// newTransferLocked takes a retired transfer from the free list, or allocates one: a busy
// producer retires one transfer per request, and reusing them (with their block storage) is
// most of what keeps the garbage collector out of the pull path.
func (p *Producer) newTransferLocked() *transfer {
	var t *transfer
	if n := len(p.free); n > 0 {
		t = p.free[n-1]
		p.free = p.free[:n-1]
		*t = transfer{store: t.store, waiting: t.waiting[:0]}
	} else {
		t = &transfer{}
	}
	t.served, t.inflight = t.ranks[:0:2], t.ranks[2:2:4]
	return t
}

// consumerSet is the set of decode ranks of one transfer: a handful at most (the TP fan-in),
// so a slice is faster than a map and, backed by the transfer itself, allocates nothing.
type consumerSet []ConsumerRank

func (s consumerSet) has(c ConsumerRank) bool {
	for _, x := range s {
		if x == c {
			return true
		}
	}
	return false
}

func (s *consumerSet) add(c ConsumerRank) {
	if !s.has(c) {
		*s = append(*s, c)
	}
}

func (s *consumerSet) remove(c ConsumerRank) {
	for i, x := range *s {
		if x == c {
			last := len(*s) - 1
			(*s)[i] = (*s)[last]
			*s = (*s)[:last]
			return
		}
	}
}

// tombstones remembers released transfers in two generations: Expire drops the older one
// whole, so forgetting costs nothing per transfer (a per-entry sweep over a map of every
// transfer of the last ten minutes was the producer's largest cost at high rates). Entries are
// 64-bit hashes of the transfer id, so the garbage collector has no pointers to scan in them;
// a collision would turn one late pull's ErrUnknownTransfer into ErrReleased, both rejections.
//
// A transfer id used again after its release (never, with vLLM's unique request ids) keeps
// its tombstone: pulls look at live transfers first, so a stale tombstone changes nothing and
// a Ready need not pay for a delete in a large map.
type tombstones struct {
	seed      maphash.Seed
	cur, prev map[uint64]struct{}
	since     time.Time // when cur started
}

func newTombstones(now time.Time) tombstones {
	return tombstones{seed: maphash.MakeSeed(), cur: map[uint64]struct{}{}, prev: map[uint64]struct{}{}, since: now}
}

func (ts *tombstones) add(id TransferID) { ts.cur[maphash.String(ts.seed, string(id))] = struct{}{} }

func (ts *tombstones) has(id TransferID) bool {
	h := maphash.String(ts.seed, string(id))
	if _, ok := ts.cur[h]; ok {
		return true
	}
	_, ok := ts.prev[h]
	return ok
}

// rotate starts a new generation every ttl: an entry lives between ttl and 2*ttl (plus the
// time between two calls). The new generation is sized like the last one, to grow no more.
func (ts *tombstones) rotate(now time.Time, ttl time.Duration) {
	switch age := now.Sub(ts.since); {
	case age >= 2*ttl:
		ts.cur, ts.prev, ts.since = map[uint64]struct{}{}, map[uint64]struct{}{}, now
	case age >= ttl:
		ts.cur, ts.prev, ts.since = make(map[uint64]struct{}, len(ts.cur)), ts.cur, now
	}
}

// ProducerStats counts what the Producer did since it started.
type ProducerStats struct {
	Pulls        uint64 // pulls received
	Served       uint64 // consumers served (acknowledged; empty pulls included)
	SendFailures uint64 // sends that failed (the consumer is told; it counts as served)
	Rejected     uint64 // pulls answered with an error at once
	Released     uint64 // releases sent to the scheduler
	Expired      uint64 // of which by expiry
	BlocksPinned int    // blocks held for consumers now
	Transfers    int    // transfers tracked now
	Tombstones   int    // released transfers remembered now
}

// Producer tracks the transfers one prefill worker holds blocks for: it pairs pulls with held
// blocks, counts consumers, and releases every held request exactly once (invariant 2).
type Producer struct {
	cfg        ProducerConfig
	mu         sync.Mutex
	transfers  map[TransferID]*transfer
	tombstones tombstones
	free       []*transfer
	stats      ProducerStats
}

// NewProducer validates cfg and returns an empty Producer.
func NewProducer(cfg ProducerConfig) (*Producer, error) {
	if cfg.Sink == nil {
		return nil, errors.New("producer: Sink is required")
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	if cfg.HoldTimeout <= 0 || cfg.ReadyTimeout <= 0 || cfg.TombstoneTTL <= 0 {
		return nil, fmt.Errorf("producer: HoldTimeout, ReadyTimeout and TombstoneTTL must be positive, got %v, %v, %v",
			cfg.HoldTimeout, cfg.ReadyTimeout, cfg.TombstoneTTL)
	}
	return &Producer{cfg: cfg, transfers: map[TransferID]*transfer{}, tombstones: newTombstones(cfg.Clock.Now())}, nil
}

// Expect announces a request admitted with do_remote_decode: pulls for its transfer may now
// wait for it. Pulls for a transfer never expected are answered at once with ErrUnknownTransfer.
func (p *Producer) Expect(id TransferID, req RequestID) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.transfers[id]; ok {
		return
	}
	t := p.newTransferLocked()
	t.request, t.deadline = req, p.cfg.Clock.Now().Add(p.cfg.ReadyTimeout+p.cfg.HoldTimeout)
	p.transfers[id] = t
}

// Ready says prefill finished and the request's blocks are held for the consumers (vLLM's
// request_finished with FINISHED_LENGTH_CAPPED). blocks may be empty: nothing is then pinned,
// but consumers are still answered. It returns the decisions for pulls that were waiting.
func (p *Producer) Ready(id TransferID, req RequestID, blocks BlockIDs) []Decision {
	p.mu.Lock()
	t, ok := p.transfers[id]
	if !ok {
		t = p.newTransferLocked()
		p.transfers[id] = t
	}
	if t.ready || t.aborted {
		p.mu.Unlock()
		return nil
	}
	t.request, t.ready = req, true
	t.blocks = t.store.set(blocks)
	t.deadline = p.cfg.Clock.Now().Add(p.cfg.HoldTimeout)
	if len(t.waiting) == 0 {
		p.mu.Unlock()
		return nil
	}
	out := make([]Decision, 0, len(t.waiting))
	var rels []Release
	waiting := t.waiting
	t.waiting = nil
	for _, w := range waiting {
		if t.retired {
			// More waiters than the consumers they announced: the blocks are released.
			out = append(out, p.rejectLocked(w.pull, ErrReleased))
			continue
		}
		d, rel, ok := p.decideLocked(id, t, w.pull)
		out = append(out, d)
		if ok {
			rels = append(rels, rel)
		}
	}
	p.mu.Unlock()
	for _, r := range rels {
		p.cfg.Sink.FinishedSending(r)
	}
	return out
}

// Abort drops a prefill request that will never be ready (aborted or failed on the prefill
// side), or lets go of a ready one early. Waiting pulls are rejected with ErrAborted; held
// blocks are released once the sends in progress end.
func (p *Producer) Abort(id TransferID) []Decision {
	p.mu.Lock()
	t, ok := p.transfers[id]
	if !ok {
		p.mu.Unlock()
		return nil
	}
	t.aborted = true
	out := p.rejectWaitersLocked(t, func(waiter) bool { return true }, ErrAborted)
	var rel Release
	var released bool
	if len(t.inflight) == 0 {
		rel, released = p.retireLocked(id, t, ReleaseAborted)
	}
	p.mu.Unlock()
	p.release(rel, released)
	return out
}

// Pull decides what to do with a consumer's pull (invariants 2 and 4): unknown and released
// transfers and repeated consumers are rejected at once; a pull for an admitted request that
// has not finished prefill waits; otherwise the blocks to write are returned.
func (p *Producer) Pull(req PullRequest) Decision {
	p.mu.Lock()
	d, rel, ok := p.pullLocked(req)
	p.mu.Unlock()
	p.release(rel, ok)
	return d
}

func (p *Producer) pullLocked(req PullRequest) (Decision, Release, bool) {
	p.stats.Pulls++
	t, ok := p.transfers[req.Transfer]
	switch {
	case !ok:
		err := ErrUnknownTransfer
		if p.tombstones.has(req.Transfer) {
			err = ErrReleased
		}
		return p.rejectLocked(req, err), Release{}, false
	case t.aborted:
		return p.rejectLocked(req, ErrAborted), Release{}, false
	case !t.ready:
		for _, w := range t.waiting {
			if w.pull.Consumer == req.Consumer {
				return p.rejectLocked(req, ErrDuplicatePull), Release{}, false
			}
		}
		t.waiting = append(t.waiting, waiter{pull: req, deadline: p.cfg.Clock.Now().Add(p.cfg.ReadyTimeout)})
		return Decision{Pull: req, Action: ActionWait}, Release{}, false
	}
	return p.decideLocked(req.Transfer, t, req)
}

func (p *Producer) rejectLocked(req PullRequest, err error) Decision {
	p.stats.Rejected++
	return Decision{Pull: req, Action: ActionReject, Err: err}
}

// decideLocked pairs a pull with the held blocks of a ready transfer. A pull whose blocks do
// not fit is answered with the error and counts as served: the consumer will not pull again.
func (p *Producer) decideLocked(id TransferID, t *transfer, req PullRequest) (Decision, Release, bool) {
	if t.served.has(req.Consumer) || t.inflight.has(req.Consumer) {
		return p.rejectLocked(req, ErrDuplicatePull), Release{}, false
	}
	copies, err := matchBlocks(t.blocks, req.Blocks)
	if err != nil {
		p.stats.SendFailures++
		rel, ok := p.serveLocked(id, t, req)
		return Decision{Pull: req, Action: ActionReject, Err: err}, rel, ok
	}
	t.inflight.add(req.Consumer)
	return Decision{Pull: req, Action: ActionSend, Copies: copies}, Release{}, false
}

// matchBlocks maps the consumer's blocks onto the producer's per group. A consumer that hit
// part of the prefix locally asks for fewer blocks: it gets the producer's last ones.
func matchBlocks(src, dst BlockIDs) ([]BlockCopy, error) {
	if !dst.HasLocal() {
		return nil, nil
	}
	if len(src) != len(dst) {
		return nil, fmt.Errorf("%w: producer has %d groups, consumer %d", ErrGroupMismatch, len(src), len(dst))
	}
	copies := make([]BlockCopy, 0, dst.Count())
	for g := range dst {
		s, d := src[g], dst[g]
		if len(d) > len(s) {
			return nil, fmt.Errorf("%w: group %d: producer %d, consumer %d", ErrBlockMismatch, g, len(s), len(d))
		}
		s = s[len(s)-len(d):]
		for i := range d {
			copies = append(copies, BlockCopy{Group: g, Src: s[i], Dst: d[i]})
		}
	}
	return copies, nil
}

// SendDone ends a send started by an ActionSend decision. Either way the consumer has been
// answered once; the transfer is released when every consumer was, or when an abort waited.
func (p *Producer) SendDone(id TransferID, consumer ConsumerRank, consumers int, err error) {
	p.mu.Lock()
	t, ok := p.transfers[id]
	if !ok || !t.inflight.has(consumer) {
		p.mu.Unlock()
		return
	}
	t.inflight.remove(consumer)
	if err != nil {
		p.stats.SendFailures++
	}
	rel, released := p.serveLocked(id, t, PullRequest{Transfer: id, Consumer: consumer, Consumers: consumers})
	if _, live := p.transfers[id]; live && t.aborted && len(t.inflight) == 0 {
		rel, released = p.retireLocked(id, t, ReleaseAborted)
	}
	p.mu.Unlock()
	p.release(rel, released)
}

// serveLocked marks a consumer answered and retires the transfer after the last one.
func (p *Producer) serveLocked(id TransferID, t *transfer, req PullRequest) (Release, bool) {
	if t.served.has(req.Consumer) {
		return Release{}, false
	}
	t.served.add(req.Consumer)
	p.stats.Served++
	// Every consumer states the fan-in; take the largest so no rank is left out.
	t.need = max(t.need, req.Consumers, 1)
	if len(t.served) >= t.need && len(t.inflight) == 0 {
		return p.retireLocked(id, t, ReleaseServed)
	}
	return Release{}, false
}

// retireLocked forgets a transfer and returns the release owed to the scheduler, if it held
// blocks. Called once per transfer: the transfer leaves the map here.
// The transfer goes back to the free list: callers must not use t afterwards.
func (p *Producer) retireLocked(id TransferID, t *transfer, reason ReleaseReason) (Release, bool) {
	delete(p.transfers, id)
	p.tombstones.add(id)
	t.retired = true
	if len(p.free) < maxFree {
		p.free = append(p.free, t)
	}
	if !t.ready || !t.blocks.HasLocal() {
		return Release{}, false
	}
	p.stats.Released++
	if reason == ReleaseExpired {
		p.stats.Expired++
	}
	return Release{Request: t.request, Transfer: id, Blocks: t.blocks.Count(), Reason: reason}, true
}

func (p *Producer) rejectWaitersLocked(t *transfer, match func(waiter) bool, err error) []Decision {
	var out []Decision
	kept := t.waiting[:0]
	for _, w := range t.waiting {
		if match(w) {
			out = append(out, p.rejectLocked(w.pull, err))
		} else {
			kept = append(kept, w)
		}
	}
	t.waiting = kept
	return out
}

func (p *Producer) release(r Release, ok bool) {
	if ok {
		p.cfg.Sink.FinishedSending(r)
	}
}

// Expire rejects pulls that waited too long for prefill, releases held blocks no consumer
// came for (never during a send), drops admitted requests that never became ready, and
// forgets old tombstones. It returns the decisions for the rejected pulls.
func (p *Producer) Expire() []Decision {
	now := p.cfg.Clock.Now()
	p.mu.Lock()
	var out []Decision
	var rels []Release
	for id, t := range p.transfers {
		out = append(out, p.rejectWaitersLocked(t, func(w waiter) bool { return !now.Before(w.deadline) }, ErrTimeout)...)
		if len(t.inflight) == 0 && !now.Before(t.deadline) {
			out = append(out, p.rejectWaitersLocked(t, func(waiter) bool { return true }, ErrTimeout)...)
			if r, ok := p.retireLocked(id, t, ReleaseExpired); ok {
				rels = append(rels, r)
			}
		}
	}
	p.tombstones.rotate(now, p.cfg.TombstoneTTL)
	p.mu.Unlock()
	for _, r := range rels {
		p.cfg.Sink.FinishedSending(r)
	}
	return out
}

// Stats returns a snapshot of the counters.
func (p *Producer) Stats() ProducerStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := p.stats
	s.Transfers = len(p.transfers)
	s.Tombstones = len(p.tombstones.cur) + len(p.tombstones.prev)
	for _, t := range p.transfers {
		if t.ready {
			s.BlocksPinned += t.blocks.Count()
		}
	}
	return s
}
