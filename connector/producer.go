package connector

import (
	"errors"
	"fmt"
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
	// TombstoneTTL is how long a released transfer is remembered, so a late pull hears
	// ErrReleased rather than ErrUnknownTransfer. Tombstones are the only state a late pull
	// meets, and they expire.
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
	need     int                       // consumers to serve; 0 until the first pull says
	served   map[ConsumerRank]struct{} // each consumer is notified once (invariant 2)
	inflight map[ConsumerRank]struct{} // sends in progress: expiry and abort wait for them
	deadline time.Time                 // expiry of a held transfer, or of an admitted one
	waiting  []waiter
}

type tombstone struct {
	reason ReleaseReason
	until  time.Time
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
	tombstones map[TransferID]tombstone
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
	return &Producer{cfg: cfg, transfers: map[TransferID]*transfer{}, tombstones: map[TransferID]tombstone{}}, nil
}

// Expect announces a request admitted with do_remote_decode: pulls for its transfer may now
// wait for it. Pulls for a transfer never expected are answered at once with ErrUnknownTransfer.
func (p *Producer) Expect(id TransferID, req RequestID) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.transfers[id]; ok {
		return
	}
	delete(p.tombstones, id)
	p.transfers[id] = &transfer{
		request:  req,
		served:   map[ConsumerRank]struct{}{},
		inflight: map[ConsumerRank]struct{}{},
		deadline: p.cfg.Clock.Now().Add(p.cfg.ReadyTimeout + p.cfg.HoldTimeout),
	}
}

// Ready says prefill finished and the request's blocks are held for the consumers (vLLM's
// request_finished with FINISHED_LENGTH_CAPPED). blocks may be empty: nothing is then pinned,
// but consumers are still answered. It returns the decisions for pulls that were waiting.
func (p *Producer) Ready(id TransferID, req RequestID, blocks BlockIDs) []Decision {
	p.mu.Lock()
	t, ok := p.transfers[id]
	if !ok {
		t = &transfer{served: map[ConsumerRank]struct{}{}, inflight: map[ConsumerRank]struct{}{}}
		p.transfers[id] = t
		delete(p.tombstones, id)
	}
	if t.ready || t.aborted {
		p.mu.Unlock()
		return nil
	}
	t.request, t.blocks, t.ready = req, blocks.Clone(), true
	t.deadline = p.cfg.Clock.Now().Add(p.cfg.HoldTimeout)
	var out []Decision
	var rels []*Release
	for _, w := range t.waiting {
		d, rel := p.decideLocked(id, t, w.pull)
		out = append(out, d)
		rels = append(rels, rel)
	}
	t.waiting = nil
	p.mu.Unlock()
	for _, r := range rels {
		p.release(r)
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
	var rel *Release
	if len(t.inflight) == 0 {
		rel = p.retireLocked(id, t, ReleaseAborted)
	}
	p.mu.Unlock()
	p.release(rel)
	return out
}

// Pull decides what to do with a consumer's pull (invariants 2 and 4): unknown and released
// transfers and repeated consumers are rejected at once; a pull for an admitted request that
// has not finished prefill waits; otherwise the blocks to write are returned.
func (p *Producer) Pull(req PullRequest) Decision {
	p.mu.Lock()
	d, rel := p.pullLocked(req)
	p.mu.Unlock()
	p.release(rel)
	return d
}

func (p *Producer) pullLocked(req PullRequest) (Decision, *Release) {
	p.stats.Pulls++
	t, ok := p.transfers[req.Transfer]
	switch {
	case !ok:
		err := ErrUnknownTransfer
		if _, late := p.tombstones[req.Transfer]; late {
			err = ErrReleased
		}
		return p.rejectLocked(req, err), nil
	case t.aborted:
		return p.rejectLocked(req, ErrAborted), nil
	case !t.ready:
		for _, w := range t.waiting {
			if w.pull.Consumer == req.Consumer {
				return p.rejectLocked(req, ErrDuplicatePull), nil
			}
		}
		t.waiting = append(t.waiting, waiter{pull: req, deadline: p.cfg.Clock.Now().Add(p.cfg.ReadyTimeout)})
		return Decision{Pull: req, Action: ActionWait}, nil
	}
	return p.decideLocked(req.Transfer, t, req)
}

func (p *Producer) rejectLocked(req PullRequest, err error) Decision {
	p.stats.Rejected++
	return Decision{Pull: req, Action: ActionReject, Err: err}
}

// decideLocked pairs a pull with the held blocks of a ready transfer. A pull whose blocks do
// not fit is answered with the error and counts as served: the consumer will not pull again.
func (p *Producer) decideLocked(id TransferID, t *transfer, req PullRequest) (Decision, *Release) {
	if _, dup := t.served[req.Consumer]; dup {
		return p.rejectLocked(req, ErrDuplicatePull), nil
	}
	if _, dup := t.inflight[req.Consumer]; dup {
		return p.rejectLocked(req, ErrDuplicatePull), nil
	}
	copies, err := matchBlocks(t.blocks, req.Blocks)
	if err != nil {
		p.stats.SendFailures++
		return Decision{Pull: req, Action: ActionReject, Err: err}, p.serveLocked(id, t, req)
	}
	t.inflight[req.Consumer] = struct{}{}
	return Decision{Pull: req, Action: ActionSend, Copies: copies}, nil
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
	if ok {
		_, ok = t.inflight[consumer]
	}
	if !ok {
		p.mu.Unlock()
		return
	}
	delete(t.inflight, consumer)
	if err != nil {
		p.stats.SendFailures++
	}
	rel := p.serveLocked(id, t, PullRequest{Transfer: id, Consumer: consumer, Consumers: consumers})
	if rel == nil && t.aborted && len(t.inflight) == 0 {
		rel = p.retireLocked(id, t, ReleaseAborted)
	}
	p.mu.Unlock()
	p.release(rel)
}

// serveLocked marks a consumer answered and retires the transfer after the last one.
func (p *Producer) serveLocked(id TransferID, t *transfer, req PullRequest) *Release {
	if _, dup := t.served[req.Consumer]; dup {
		return nil
	}
	t.served[req.Consumer] = struct{}{}
	p.stats.Served++
	// Every consumer states the fan-in; take the largest so no rank is left out.
	t.need = max(t.need, req.Consumers, 1)
	if len(t.served) >= t.need && len(t.inflight) == 0 {
		return p.retireLocked(id, t, ReleaseServed)
	}
	return nil
}

// retireLocked forgets a transfer and returns the release owed to the scheduler, if it held
// blocks. Called once per transfer: the transfer leaves the map here.
func (p *Producer) retireLocked(id TransferID, t *transfer, reason ReleaseReason) *Release {
	delete(p.transfers, id)
	p.tombstones[id] = tombstone{reason: reason, until: p.cfg.Clock.Now().Add(p.cfg.TombstoneTTL)}
	if !t.ready || !t.blocks.HasLocal() {
		return nil
	}
	p.stats.Released++
	if reason == ReleaseExpired {
		p.stats.Expired++
	}
	return &Release{Request: t.request, Transfer: id, Blocks: t.blocks.Count(), Reason: reason}
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

func (p *Producer) release(r *Release) {
	if r != nil {
		p.cfg.Sink.FinishedSending(*r)
	}
}

// Expire rejects pulls that waited too long for prefill, releases held blocks no consumer
// came for (never during a send), drops admitted requests that never became ready, and
// forgets old tombstones. It returns the decisions for the rejected pulls.
func (p *Producer) Expire() []Decision {
	now := p.cfg.Clock.Now()
	p.mu.Lock()
	var out []Decision
	var rels []*Release
	for id, t := range p.transfers {
		out = append(out, p.rejectWaitersLocked(t, func(w waiter) bool { return !now.Before(w.deadline) }, ErrTimeout)...)
		if len(t.inflight) == 0 && !now.Before(t.deadline) {
			out = append(out, p.rejectWaitersLocked(t, func(waiter) bool { return true }, ErrTimeout)...)
			if r := p.retireLocked(id, t, ReleaseExpired); r != nil {
				rels = append(rels, r)
			}
		}
	}
	for id, ts := range p.tombstones {
		if !now.Before(ts.until) {
			delete(p.tombstones, id)
		}
	}
	p.mu.Unlock()
	for _, r := range rels {
		p.release(r)
	}
	return out
}

// Stats returns a snapshot of the counters.
func (p *Producer) Stats() ProducerStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := p.stats
	s.Transfers = len(p.transfers)
	s.Tombstones = len(p.tombstones)
	for _, t := range p.transfers {
		if t.ready {
			s.BlocksPinned += t.blocks.Count()
		}
	}
	return s
}
