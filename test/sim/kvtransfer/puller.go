package kvtransfer

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"k8s.io/utils/clock"
)

// PullerConfig configures the decode-side state machine.
type PullerConfig struct {
	// Sink is the decode scheduler; it hears at most one Completion per pull.
	Sink CompletionSink
	// Clock drives deadlines; tests inject a fake one.
	Clock clock.PassiveClock
	// Timeout bounds a pull: a task still pending then fails with ErrTimeout. It should exceed
	// the producer's ready timeout, so the producer answers first (Mooncake: 540 s > 480 s).
	Timeout time.Duration
}

type taskState uint8

// The zero value is no task at all, so a lookup of an unknown producer is never pending.
const (
	taskPending taskState = iota + 1
	taskOK
	taskFailed
)

type pull struct {
	meta     PullMeta
	notify   bool
	deadline time.Time
	tasks    []task // one per distinct producer rank: a handful, so a slice beats a map
	pending  int
	err      error // the first task error; later ones add nothing the scheduler can use
	taskBuf  [2]task
	// gate is held shared by each write into the pull's blocks and exclusively by the end of
	// its last task, which so waits for the writes in progress (only a task failed from
	// outside, by Expire or FailTasks, can end during one of its writes).
	gate  sync.RWMutex
	store blockStore // backs meta.LocalBlock; kept when the pull is reused
}

// maxFreePulls bounds the Puller's free list of finished pulls.
const maxFreePulls = 256

// newPullLocked takes a finished pull from the free list, or allocates one: reusing them
// (with their block storage) keeps the garbage collector out of the pull path.
func (p *Puller) newPullLocked() *pull {
	if n := len(p.free); n > 0 {
		pl := p.free[n-1]
		p.free = p.free[:n-1]
		*pl = pull{store: pl.store}
		return pl
	}
	return &pull{}
}

// freeLocked returns a finished pull to the free list; it must not be used afterwards.
func (p *Puller) freeLocked(pl *pull) {
	if len(p.free) < maxFreePulls {
		p.free = append(p.free, pl)
	}
}

type task struct {
	producer ProducerRank
	state    taskState
}

// task returns producer's task, nil when the pull has none for it.
func (pl *pull) task(producer ProducerRank) *task {
	for i := range pl.tasks {
		if pl.tasks[i].producer == producer {
			return &pl.tasks[i]
		}
	}
	return nil
}

func (pl *pull) pendingFor(producer ProducerRank) bool {
	t := pl.task(producer)
	return t != nil && t.state == taskPending
}

// PullerStats counts what the Puller did since it started.
type PullerStats struct {
	Started          uint64 // pulls begun
	Empty            uint64 // pulls without local blocks (notify-only)
	Completed        uint64 // completions reported to the scheduler as success
	Failed           uint64 // completions reported as failed
	FailedSilent     uint64 // failed pulls that carried no local block, so reported nothing
	NotifiedOnly     uint64 // drained pulls that only told the producer (no report)
	TimedOutTasks    uint64 // tasks failed by Expire
	IgnoredTaskDones uint64 // task results for unknown, finished or already-ended tasks
	InFlight         int    // pulls not drained yet
}

// Puller is the decode side: one pull per request, fanned out to one task per producer
// worker. It reports to the scheduler exactly once, after the last task ended, and only for a
// pull that the scheduler waits on and that has local destination blocks.
type Puller struct {
	cfg   PullerConfig
	mu    sync.Mutex
	pulls map[RequestID]*pull
	free  []*pull
	stats PullerStats
}

// NewPuller validates cfg and returns an empty Puller.
func NewPuller(cfg PullerConfig) (*Puller, error) {
	if cfg.Sink == nil {
		return nil, errors.New("puller: Sink is required")
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	if cfg.Timeout <= 0 {
		return nil, fmt.Errorf("puller: Timeout must be positive, got %v", cfg.Timeout)
	}
	return &Puller{cfg: cfg, pulls: map[RequestID]*pull{}}, nil
}

// Begin starts the pull of meta with one task per distinct producer. A pull with no producer
// (the bootstrap lookup failed) ends at once as failed, so it is reported like any failure.
// Only a second pull for a request still in flight is refused: vLLM does one transfer per request.
func (p *Puller) Begin(meta PullMeta, producers []ProducerRank) error {
	deadline := p.cfg.Clock.Now().Add(p.cfg.Timeout)
	p.mu.Lock()
	if _, busy := p.pulls[meta.Request]; busy {
		p.mu.Unlock()
		return fmt.Errorf("begin pull of %s: %w", meta.Request, ErrDuplicateRequest)
	}
	pl := p.newPullLocked()
	pl.meta, pl.notify, pl.deadline = meta, meta.NotifiesScheduler(), deadline
	pl.meta.LocalBlock = pl.store.set(meta.LocalBlock)
	pl.tasks = pl.taskBuf[:0]
	for _, r := range producers {
		if pl.task(r) == nil {
			pl.tasks = append(pl.tasks, task{producer: r, state: taskPending})
			pl.pending++
		}
	}
	p.stats.Started++
	if !meta.LocalBlock.HasLocal() {
		p.stats.Empty++
	}
	var done *Completion
	if pl.pending == 0 {
		pl.err = ErrNoProducers
		done = p.finishLocked(pl)
		p.freeLocked(pl)
	} else {
		p.pulls[meta.Request] = pl
	}
	p.mu.Unlock()
	p.deliver(done)
	return nil
}

// TaskDone records the end of one task: err nil when the producer acknowledged the pull (and
// wrote every block), otherwise why it failed. It returns false for a result that changes
// nothing: an unknown or already finished request, another transfer, a task that already ended.
func (p *Puller) TaskDone(req RequestID, transfer TransferID, producer ProducerRank, err error) bool {
	p.mu.Lock()
	pl := p.acceptingLocked(req, transfer, producer)
	if pl == nil {
		p.stats.IgnoredTaskDones++
		p.mu.Unlock()
		return false
	}
	done := p.endTaskLocked(pl, producer, err)
	p.mu.Unlock()
	p.deliver(done)
	return true
}

// endTaskLocked moves a pending task to its end state and finishes the pull after the last one.
func (p *Puller) endTaskLocked(pl *pull, producer ProducerRank, err error) *Completion {
	t := pl.task(producer)
	if err != nil {
		t.state = taskFailed
		if pl.err == nil {
			pl.err = &TaskError{Producer: producer, Err: err}
		}
	} else {
		t.state = taskOK
	}
	pl.pending--
	if pl.pending > 0 {
		return nil
	}
	// Wait for the writes in progress; none starts after (they check the task under p.mu).
	pl.gate.Lock()
	delete(p.pulls, pl.meta.Request)
	c := p.finishLocked(pl)
	pl.gate.Unlock()
	p.freeLocked(pl)
	return c
}

// finishLocked decides what the scheduler hears about a drained pull (invariants 1 and 3).
func (p *Puller) finishLocked(pl *pull) *Completion {
	switch {
	case !pl.notify && pl.err != nil:
		p.stats.FailedSilent++
		return nil
	case !pl.notify:
		p.stats.NotifiedOnly++
		return nil
	case pl.err == nil:
		p.stats.Completed++
		return &Completion{Request: pl.meta.Request}
	}
	p.stats.Failed++
	c := &Completion{Request: pl.meta.Request, Err: pl.err}
	if len(pl.meta.LocalBlock) > 1 {
		c.FailedRequest = true
	} else {
		c.InvalidBlocks = pl.meta.LocalBlock.Flatten()
	}
	return c
}

func (p *Puller) deliver(c *Completion) {
	if c != nil {
		p.cfg.Sink.FinishedReceiving(*c)
	}
}

// AcceptWrite reports whether producer may still write into req's blocks for transfer: only
// while its task is pending. The data plane checks it before every write, so no byte lands
// after the scheduler was told (invariant 3).
func (p *Puller) AcceptWrite(req RequestID, transfer TransferID, producer ProducerRank) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.acceptingLocked(req, transfer, producer) != nil
}

// acceptingLocked is req's pull if producer's task for transfer is pending, else nil.
func (p *Puller) acceptingLocked(req RequestID, transfer TransferID, producer ProducerRank) *pull {
	pl, ok := p.pulls[req]
	if !ok || pl.meta.Transfer != transfer || !pl.pendingFor(producer) {
		return nil
	}
	return pl
}

// WriteIfAccepted runs write only while producer's task for req is pending, and no completion
// of req is reported while a write runs: a byte either lands before the scheduler hears of the
// pull or not at all (invariant 3, Mooncake's I8). Writes of different pulls, and of one pull's
// tasks, run concurrently: each holds its pull's gate shared, and the last task's end takes it
// exclusively. It reports whether write ran.
func (p *Puller) WriteIfAccepted(req RequestID, transfer TransferID, producer ProducerRank, write func() error) (bool, error) {
	p.mu.Lock()
	pl := p.acceptingLocked(req, transfer, producer)
	if pl == nil {
		p.mu.Unlock()
		return false, nil
	}
	pl.gate.RLock()
	p.mu.Unlock()
	defer pl.gate.RUnlock()
	return true, write()
}

// FailTasks ends every pending task for which match is true with err (a producer connection
// was lost, a producer engine restarted). It returns how many tasks it ended.
func (p *Puller) FailTasks(match func(PullMeta, ProducerRank) bool, err error) int {
	return p.failTasks(func(pl *pull, r ProducerRank) bool { return match(pl.meta, r) }, err)
}

// Expire fails every pending task of every pull past its deadline with ErrTimeout
// (invariant 4). It returns how many tasks it ended.
func (p *Puller) Expire() int {
	now := p.cfg.Clock.Now()
	return p.failTasks(func(pl *pull, _ ProducerRank) bool { return !now.Before(pl.deadline) }, ErrTimeout)
}

func (p *Puller) failTasks(match func(*pull, ProducerRank) bool, err error) int {
	p.mu.Lock()
	var done []*Completion
	n := 0
	for _, pl := range p.pulls {
		for _, t := range pl.tasks {
			if t.state == taskPending && match(pl, t.producer) {
				n++
				if c := p.endTaskLocked(pl, t.producer, err); c != nil {
					done = append(done, c)
				}
			}
		}
	}
	if errors.Is(err, ErrTimeout) {
		p.stats.TimedOutTasks += uint64(n)
	}
	p.mu.Unlock()
	for _, c := range done {
		p.deliver(c)
	}
	return n
}

// Deadline is when req's pull times out; false when it is not in flight.
func (p *Puller) Deadline(req RequestID) (time.Time, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	pl, ok := p.pulls[req]
	if !ok {
		return time.Time{}, false
	}
	return pl.deadline, true
}

// PendingTasks is the number of req's tasks that have not ended (0 when not in flight).
func (p *Puller) PendingTasks(req RequestID) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if pl, ok := p.pulls[req]; ok {
		return pl.pending
	}
	return 0
}

// Stats returns a snapshot of the counters.
func (p *Puller) Stats() PullerStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := p.stats
	s.InFlight = len(p.pulls)
	return s
}
