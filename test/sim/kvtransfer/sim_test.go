package kvtransfer_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer"
	"pdcluster.dev/pdcluster-operator/test/sim/vllmsched"
)

// sim wires a decode engine (vLLM scheduler model + Puller) to a prefill engine (model + one
// Producer per worker rank) through an in-memory network whose messages are delivered, delayed,
// duplicated or lost in an order chosen by a seeded source. It checks the invariants as it goes.
type sim struct {
	t         testing.TB
	rng       *rand.Rand
	clock     *clocktesting.FakeClock
	decode    *vllmsched.Scheduler
	prefill   *vllmsched.Scheduler
	puller    *kvtransfer.Puller
	producers []*kvtransfer.Producer
	msgs      []msg

	seq         int
	metas       map[kvtransfer.RequestID]kvtransfer.PullMeta // every pull begun
	completions map[kvtransfer.RequestID]int
	releases    map[kvtransfer.RequestID]int // per producer rank, aggregated
	answered    map[string]int               // (transfer, consumer, producer) -> answers that count as served
	violations  []string
}

type msgKind int

const (
	msgPull msgKind = iota
	msgSend
	msgAnswer
)

type msg struct {
	kind msgKind
	rank kvtransfer.ProducerRank
	pull kvtransfer.PullRequest
	req  kvtransfer.RequestID // the decode request of a pull
	dec  kvtransfer.Decision
	err  error
}

const (
	blockSize    = 64
	pullTimeout  = 540 * time.Second
	readyTimeout = 480 * time.Second
	holdTimeout  = 480 * time.Second
)

func newSim(t testing.TB, seed uint64, ranks int, policy vllmsched.Policy) *sim {
	s := &sim{
		t: t, rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)),
		clock:       clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0)),
		metas:       map[kvtransfer.RequestID]kvtransfer.PullMeta{},
		completions: map[kvtransfer.RequestID]int{},
		releases:    map[kvtransfer.RequestID]int{},
		answered:    map[string]int{},
	}
	var err error
	s.decode, err = vllmsched.New(vllmsched.Config{
		Role: vllm.KVConsumer, BlockSize: blockSize, Capacity: 4096, Policy: policy, OnPull: s.beginPull,
	})
	if err != nil {
		t.Fatal(err)
	}
	s.prefill, err = vllmsched.New(vllmsched.Config{
		Role: vllm.KVProducer, BlockSize: blockSize, Capacity: 4096, OnHold: s.hold, OnDrop: s.drop,
	})
	if err != nil {
		t.Fatal(err)
	}
	s.puller, err = kvtransfer.NewPuller(kvtransfer.PullerConfig{Sink: kvtransfer.CompletionFunc(s.complete), Clock: s.clock, Timeout: pullTimeout})
	if err != nil {
		t.Fatal(err)
	}
	for r := 0; r < ranks; r++ {
		rank := kvtransfer.ProducerRank(r)
		p, err := kvtransfer.NewProducer(kvtransfer.ProducerConfig{
			Sink: kvtransfer.ReleaseFunc(func(rel kvtransfer.Release) { s.release(rank, rel) }), Clock: s.clock, Rank: rank,
			HoldTimeout: holdTimeout, ReadyTimeout: readyTimeout, TombstoneTTL: time.Minute,
		})
		if err != nil {
			t.Fatal(err)
		}
		s.producers = append(s.producers, p)
	}
	return s
}

func (s *sim) violate(format string, args ...any) {
	s.violations = append(s.violations, fmt.Sprintf(format, args...))
}

func (s *sim) ranks() []kvtransfer.ProducerRank {
	out := make([]kvtransfer.ProducerRank, len(s.producers))
	for i := range out {
		out[i] = kvtransfer.ProducerRank(i)
	}
	return out
}

// beginPull is the decode connector's start_load_kv: one task per producer rank.
func (s *sim) beginPull(meta kvtransfer.PullMeta) {
	if _, dup := s.metas[meta.Request]; dup {
		s.violate("second pull for %s", meta.Request)
	}
	s.metas[meta.Request] = meta
	if err := s.puller.Begin(meta, s.ranks()); err != nil {
		s.violate("begin %s: %v", meta.Request, err)
	}
	for _, r := range s.ranks() {
		s.msgs = append(s.msgs, msg{kind: msgPull, rank: r, req: meta.Request,
			pull: kvtransfer.PullRequest{Transfer: meta.Transfer, Consumer: 0, Consumers: 1, Blocks: meta.LocalBlock}})
	}
}

// complete checks invariants 1 and 3 at the moment the scheduler hears of a pull.
func (s *sim) complete(c kvtransfer.Completion) {
	s.completions[c.Request]++
	meta := s.metas[c.Request]
	if !meta.NotifiesScheduler() {
		s.violate("completion for %s whose pull must not notify (waiting=%v blocks=%v)", c.Request, meta.WaitingForRemote, meta.LocalBlock)
	}
	if n := s.puller.PendingTasks(c.Request); n != 0 {
		s.violate("completion for %s with %d tasks still pending", c.Request, n)
	}
	for _, r := range s.ranks() {
		if s.puller.AcceptWrite(c.Request, meta.Transfer, r) {
			s.violate("rank %d may still write into %s after its completion", r, c.Request)
		}
	}
	if c.Err != nil && c.InvalidBlocks == nil && !c.FailedRequest {
		s.violate("failed completion for %s names no failed blocks", c.Request)
	}
	s.decode.FinishedReceiving(c)
}

func (s *sim) hold(id kvtransfer.TransferID, req kvtransfer.RequestID, blocks kvtransfer.BlockIDs) {
	for i, p := range s.producers {
		s.decided(kvtransfer.ProducerRank(i), p.Ready(id, req, blocks))
	}
}

func (s *sim) drop(id kvtransfer.TransferID, req kvtransfer.RequestID, aborted bool) {
	for i, p := range s.producers {
		if aborted {
			s.decided(kvtransfer.ProducerRank(i), p.Abort(id))
		} else {
			s.decided(kvtransfer.ProducerRank(i), p.Ready(id, req, nil))
		}
	}
}

// release aggregates per-rank releases like vLLM's KVOutputAggregator: the scheduler frees
// once every rank has let go.
func (s *sim) release(rank kvtransfer.ProducerRank, rel kvtransfer.Release) {
	s.releases[rel.Request]++
	switch n := s.releases[rel.Request]; {
	case n > len(s.producers):
		s.violate("rank %d released %s again (%d releases)", rank, rel.Request, n)
	case n == len(s.producers):
		s.prefill.FinishedSending(rel)
	}
}

func (s *sim) decided(rank kvtransfer.ProducerRank, ds []kvtransfer.Decision) {
	for _, d := range ds {
		s.decision(rank, d)
	}
}

func (s *sim) requestOf(id kvtransfer.TransferID) kvtransfer.RequestID {
	return kvtransfer.RequestID("d-" + string(id))
}

func (s *sim) decision(rank kvtransfer.ProducerRank, d kvtransfer.Decision) {
	key := fmt.Sprintf("%s/%d/%d", d.Pull.Transfer, d.Pull.Consumer, rank)
	switch d.Action {
	case kvtransfer.ActionWait:
	case kvtransfer.ActionSend:
		s.msgs = append(s.msgs, msg{kind: msgSend, rank: rank, pull: d.Pull, dec: d, req: s.requestOf(d.Pull.Transfer)})
	case kvtransfer.ActionReject:
		if errors.Is(d.Err, kvtransfer.ErrBlockMismatch) || errors.Is(d.Err, kvtransfer.ErrGroupMismatch) {
			s.answered[key]++
		}
		s.msgs = append(s.msgs, msg{kind: msgAnswer, rank: rank, pull: d.Pull, err: d.Err, req: s.requestOf(d.Pull.Transfer)})
	}
}

// deliver handles the message at i; a lost message is the peer dying mid-transfer.
func (s *sim) deliver(i int, lose bool) {
	m := s.msgs[i]
	s.msgs = append(s.msgs[:i], s.msgs[i+1:]...)
	switch m.kind {
	case msgPull:
		if lose {
			return // the consumer's task times out
		}
		s.decision(m.rank, s.producers[m.rank].Pull(m.pull))
	case msgSend:
		// The data plane writes only while the consumer's task accepts writes.
		var err error
		if lose {
			err = kvtransfer.ErrPeerGone
		}
		for range m.dec.Copies {
			if !lose && !s.puller.AcceptWrite(m.req, m.pull.Transfer, m.rank) {
				err = kvtransfer.ErrTimeout // the consumer gave up: the write is refused
				break
			}
		}
		s.producers[m.rank].SendDone(m.pull.Transfer, m.pull.Consumer, m.pull.Consumers, err)
		if err == nil {
			s.answered[fmt.Sprintf("%s/%d/%d", m.pull.Transfer, m.pull.Consumer, m.rank)]++
		}
		if !lose {
			s.msgs = append(s.msgs, msg{kind: msgAnswer, rank: m.rank, pull: m.pull, err: err, req: m.req})
		}
	case msgAnswer:
		if errors.Is(m.err, kvtransfer.ErrUnknownTransfer) && s.rng.IntN(2) == 0 {
			// The pull raced ahead of the prefill request: retry, as the agent does.
			s.msgs = append(s.msgs, msg{kind: msgPull, rank: m.rank, req: m.req, pull: m.pull})
			return
		}
		s.puller.TaskDone(m.req, m.pull.Transfer, m.rank, m.err)
		if s.rng.IntN(10) == 0 { // a duplicate answer must change nothing
			if s.puller.TaskDone(m.req, m.pull.Transfer, m.rank, m.err) {
				s.violate("duplicate answer for %s rank %d accepted", m.req, m.rank)
			}
		}
	}
}

func (s *sim) newRequest() {
	s.seq++
	tid := kvtransfer.TransferID(fmt.Sprintf("xfer-%d", s.seq))
	prompt := []int{13, 64, 65, 100, 128, 200, 640, 1000}[s.rng.IntN(8)]
	hit := []int{0, 0, 0, 64, prompt, prompt / 2}[s.rng.IntN(6)]
	preq := kvtransfer.RequestID("p-" + string(tid))
	for _, p := range s.producers {
		p.Expect(tid, preq)
	}
	if err := s.prefill.Add(preq, tid, prompt, 0); err != nil {
		s.t.Fatal(err)
	}
	// A decode leg the API server refused is submitted pre-aborted: its cleanup pull is the
	// only thing decode does for it (test/realengine testRejectedDecodeLeg on vLLM itself).
	if s.rng.IntN(8) == 0 {
		if err := s.decode.AddAborted(s.requestOf(tid), tid); err != nil {
			s.t.Fatal(err)
		}
		return
	}
	if err := s.decode.Add(s.requestOf(tid), tid, prompt, hit); err != nil {
		s.t.Fatal(err)
	}
}

func (s *sim) randomRunning(sched *vllmsched.Scheduler) (kvtransfer.RequestID, bool) {
	ids := sched.Schedule()
	if len(ids) == 0 {
		return "", false
	}
	return ids[s.rng.IntN(len(ids))], true
}

// step performs one random event.
func (s *sim) step() {
	switch k := s.rng.IntN(100); {
	case k < 12:
		s.newRequest()
	case k < 20:
		s.decode.Schedule()
	case k < 30:
		s.prefillStep()
	case k < 35:
		if id, ok := s.randomRunning(s.decode); ok {
			s.decode.Finish(id, vllmsched.FinishedStopped)
		}
	case k < 39:
		s.decode.Abort(kvtransfer.RequestID(fmt.Sprintf("d-xfer-%d", 1+s.rng.IntN(s.seq+1))))
	case k < 41:
		s.prefill.Abort(kvtransfer.RequestID(fmt.Sprintf("p-xfer-%d", 1+s.rng.IntN(s.seq+1))))
	case k < 43:
		s.clock.Step(time.Duration(s.rng.IntN(120)) * time.Second)
		s.expire()
	case k < 44:
		// A pull for a transfer nobody knows, or one long gone: answered at once, no state.
		p := s.producers[s.rng.IntN(len(s.producers))]
		before := p.Stats()
		d := p.Pull(kvtransfer.PullRequest{Transfer: "xfer-stale", Consumer: 3, Consumers: 1})
		after := p.Stats()
		if d.Action != kvtransfer.ActionReject || after.Transfers != before.Transfers {
			s.violate("unknown transfer: action %v, transfers %d -> %d", d.Action, before.Transfers, after.Transfers)
		}
	default:
		// The network delivers a burst, in any order; now and then a message is lost.
		for n := 1 + s.rng.IntN(6); n > 0 && len(s.msgs) > 0; n-- {
			s.deliver(s.rng.IntN(len(s.msgs)), s.rng.IntN(40) == 0)
		}
	}
}

func (s *sim) expire() {
	s.puller.Expire()
	for i, p := range s.producers {
		s.decided(kvtransfer.ProducerRank(i), p.Expire())
	}
}

// prefillStep is one prefill engine step: every scheduled request computes its prompt and
// finishes with its single token, holding its blocks for decode.
func (s *sim) prefillStep() {
	ids := s.prefill.Schedule()
	for _, id := range ids {
		s.prefill.Finish(id, vllmsched.FinishedLengthCapped)
	}
}

// drain ends the run: the engines and the network run until nothing moves, then time passes
// every timeout, until all state must be gone.
func (s *sim) drain() {
	for round := 0; round < 20; round++ {
		for quiet := 0; quiet < 3; {
			before := len(s.msgs)
			for len(s.msgs) > 0 {
				s.deliver(0, false)
			}
			s.prefillStep()
			ids := s.decode.Schedule()
			for _, id := range ids {
				s.decode.Finish(id, vllmsched.FinishedStopped)
			}
			if before == 0 && len(s.msgs) == 0 {
				quiet++
			}
		}
		s.clock.Step(pullTimeout + holdTimeout + time.Minute)
		s.expire()
	}
}

// check asserts the end state: no engine died, nothing is pinned or in flight, and each pull
// was reported exactly as often as the invariants say.
func (s *sim) check() {
	t := s.t
	t.Helper()
	for _, v := range s.violations {
		t.Error(v)
	}
	if err := s.decode.Dead(); err != nil {
		t.Errorf("decode engine died: %v", err)
	}
	if err := s.prefill.Dead(); err != nil {
		t.Errorf("prefill engine died: %v", err)
	}
	if st := s.puller.Stats(); st.InFlight != 0 {
		t.Errorf("%d pulls still in flight", st.InFlight)
	}
	for i, p := range s.producers {
		if st := p.Stats(); st.Transfers != 0 || st.BlocksPinned != 0 {
			t.Errorf("producer rank %d still tracks %d transfers, %d blocks pinned", i, st.Transfers, st.BlocksPinned)
		}
	}
	for name, sched := range map[string]*vllmsched.Scheduler{"decode": s.decode, "prefill": s.prefill} {
		if st := sched.Stats(); st.Requests != 0 || st.FreeBlocks != 4096 {
			t.Errorf("%s scheduler left %d requests, %d/4096 blocks free: %v", name, st.Requests, st.FreeBlocks, st.ByStatus)
		}
	}
	for id, meta := range s.metas {
		want := 0
		if meta.NotifiesScheduler() {
			want = 1
		}
		if got := s.completions[id]; got != want {
			t.Errorf("%s: %d completions, want %d (waiting=%v, blocks=%v)", id, got, want, meta.WaitingForRemote, meta.LocalBlock)
		}
	}
	for key, n := range s.answered {
		if n > 1 {
			t.Errorf("producer notified %d times for %s", n, key)
		}
	}
}

func runSim(t testing.TB, seed uint64, steps, ranks int, policy vllmsched.Policy) *sim {
	s := newSim(t, seed, ranks, policy)
	for i := 0; i < steps; i++ {
		s.step()
	}
	s.drain()
	s.check()
	return s
}

// TestRandomizedEventSequences checks every invariant over many random interleavings of
// requests, aborts on both sides, lost and duplicated messages, retries and timeouts.
func TestRandomizedEventSequences(t *testing.T) {
	for seed := uint64(1); seed <= 60; seed++ {
		ranks := 1 + int(seed%3)
		policy := []vllmsched.Policy{vllmsched.PolicyFail, vllmsched.PolicyRecompute}[seed%2]
		t.Run(fmt.Sprintf("seed=%d/ranks=%d/%s", seed, ranks, policy), func(t *testing.T) {
			s := runSim(t, seed, 1500, ranks, policy)
			st := s.puller.Stats()
			if st.Started == 0 || st.Empty == 0 || st.Completed == 0 {
				t.Errorf("run exercised too little: %+v", st)
			}
		})
	}
}

// FuzzEventSequences lets `go test -fuzz` search seeds and shapes; the seed corpus runs in
// every `go test`.
func FuzzEventSequences(f *testing.F) {
	f.Add(uint64(7), uint8(1), uint16(400))
	f.Add(uint64(42), uint8(2), uint16(800))
	f.Add(uint64(1234), uint8(3), uint16(300))
	f.Fuzz(func(t *testing.T, seed uint64, ranks uint8, steps uint16) {
		runSim(t, seed, int(steps%2000), 1+int(ranks%4), vllmsched.PolicyRecompute)
	})
}
