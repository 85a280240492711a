package kvevents

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"

	"pdcluster.dev/pdcluster-operator/test/sim/kvpublish"
)

// startStandIn is a publisher on loopback, as vLLM's ZmqEventPublisher does, for what vLLM's own
// cannot be made to do: restart in place without the connection dropping.
func startStandIn(t *testing.T) (*kvpublish.Publisher, string, string) {
	t.Helper()
	p, err := kvpublish.Listen("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "kv", 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p, "tcp://" + p.Addr(), "tcp://" + p.ReplayAddr()
}

// followEngine follows the publisher at pubAt (replay at replayAt) as engine "e" until the test
// ends.
func followEngine(t *testing.T, pubAt, replayAt string) *Follower {
	t.Helper()
	f := &Follower{Index: NewIndex(0, 0), Topic: "kv", Log: testr.New(t)}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); f.Follow(ctx, Source{Engine: "e", Endpoint: pubAt, Replay: replayAt}) }()
	t.Cleanup(func() { cancel(); <-done })
	return f
}

// holdsBlock reports whether f's index says engine "e" holds ts as one leading block of 4.
func holdsBlock(f *Follower, ts []uint32) bool {
	m := make([]int, 1)
	f.Index.MatchLeading(ts, 4, [][]string{{"e"}}, m)
	return m[0] == 1
}

// store publishes one block of tokens, as the first block of a prompt.
func store(t *testing.T, p *kvpublish.Publisher, hash uint64, tokens []uint32) {
	t.Helper()
	if err := p.Publish(kvpublish.Stored([]uint64{hash}, nil, tokens, len(tokens))); err != nil {
		t.Fatal(err)
	}
}

// An engine restarted while the subscriber stayed connected, whose first batch is numbered
// inside what the subscriber's replay applied: past the moment duplicates of the replay can
// arrive, that is a new process, and what the old one held is dropped.
func TestARestartInsideTheReplayedSpanIsARestart(t *testing.T) {
	old := dupWindow
	dupWindow = 200 * time.Millisecond
	t.Cleanup(func() { dupWindow = old })
	p, pubAt, replayAt := startStandIn(t)
	store(t, p, 1, tokens(0, 4))
	store(t, p, 2, tokens(10, 4))
	f := followEngine(t, pubAt, replayAt)
	holds := func(ts []uint32) bool { return holdsBlock(f, ts) }
	wait := func(what string, ok func() bool) { t.Helper(); waitFor(t, f, what, ok) }
	wait("the replayed history", func() bool { return holds(tokens(0, 4)) && holds(tokens(10, 4)) })
	time.Sleep(2 * dupWindow)
	p.Restart()
	// The subscriber is connected: it gets the new process's first batch, sequence 0.
	store(t, p, 3, tokens(20, 4))
	wait("the new process's block, the old ones dropped", func() bool {
		return holds(tokens(20, 4)) && !holds(tokens(0, 4)) && !holds(tokens(10, 4))
	})
	if s := f.Streams()["e"]; s.Restarts != 1 {
		t.Errorf("stream %+v: want 1 restart", s)
	}
}

// What a live batch's number means, from what Follow knows of the sequence: in order, a
// duplicate of what the last replay applied (until a live batch past it, or dupWindow), a
// publisher that restarted (the number went back), or a gap.
func TestSequenceClassifies(t *testing.T) {
	t0 := time.Date(2026, 12, 7, 3, 0, 0, 0, time.UTC)
	fresh := func() sequence { var s sequence; s.reset(); return s }
	at := func(next uint64) sequence { s := fresh(); s.applied(next - 1); return s }
	replayed := func(first, last uint64) sequence { s := fresh(); s.replayedSpan(first, last, t0); return s }
	pastIt := func() sequence { s := replayed(2, 6); s.applied(7); return s }
	for _, tc := range []struct {
		name string
		s    sequence
		seq  uint64
		now  time.Time
		want seqVerdict
	}{
		{"fresh: any number starts the sequence", fresh(), 41, t0, seqInOrder},
		{"the next one", at(5), 5, t0, seqInOrder},
		{"past the next one", at(5), 7, t0, seqGap},
		{"before the next one", at(5), 3, t0, seqRestarted},
		{"inside the replayed span, soon after", replayed(2, 6), 4, t0.Add(time.Second), seqDuplicate},
		{"inside the replayed span, past the window", replayed(2, 6), 4, t0.Add(dupWindow + time.Second), seqRestarted},
		{"before the replayed span", replayed(2, 6), 1, t0, seqRestarted},
		{"right after the replayed span", replayed(2, 6), 7, t0, seqInOrder},
		{"past the replayed span", replayed(2, 6), 9, t0, seqGap},
		{"inside the span once a live batch went past it", pastIt(), 4, t0.Add(time.Second), seqRestarted},
	} {
		if got := tc.s.classify(tc.seq, tc.now); got != tc.want {
			t.Errorf("%s: classify(%d) = %d, want %d", tc.name, tc.seq, got, tc.want)
		}
	}
}

// What TestFollowsVLLMsPublisher proves on vLLM's own publisher, on the stand-in too (issue 57:
// those claims rested on a test that runs only with vLLM): batches lost past the replay buffer
// drop what the engine was said to hold (counted), and so does a dropped connection, after
// which the follower reconnects and rebuilds from the new publisher.
func TestALossOrAReconnectDropsTheEnginesIndex(t *testing.T) {
	p, pubAt, replayAt := startStandIn(t)
	f := followEngine(t, pubAt, replayAt)
	holds := func(ts []uint32) bool { return holdsBlock(f, ts) }
	wait := func(what string, ok func() bool) { t.Helper(); waitFor(t, f, what, ok) }
	store(t, p, 1, tokens(0, 4))
	wait("the first block", func() bool { return holds(tokens(0, 4)) })
	p.Lose(5)
	store(t, p, 2, tokens(10, 4))
	wait("the block after the loss, the one before it dropped", func() bool { return holds(tokens(10, 4)) && !holds(tokens(0, 4)) })
	if s := f.Streams()["e"]; s.Lost != 1 || s.LastLoss.IsZero() {
		t.Errorf("stream %+v: want one loss", s)
	}
	// The engine's publisher goes and another listens where it was.
	at := strings.TrimPrefix(pubAt, "tcp://")
	replay := strings.TrimPrefix(replayAt, "tcp://")
	p.Close()
	wait("the connection lost and the index dropped", func() bool { return !holds(tokens(10, 4)) })
	again, err := kvpublish.Listen("tcp://"+at, "tcp://"+replay, "kv", 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(again.Close)
	wait("the new publisher's block", func() bool {
		store(t, again, 3, tokens(20, 4))
		return holds(tokens(20, 4)) && !holds(tokens(10, 4))
	})
	if s := f.Streams()["e"]; s.Reconnects < 1 {
		t.Errorf("stream %+v: want a reconnect", s)
	}
}
