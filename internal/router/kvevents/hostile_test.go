package kvevents

import (
	"context"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"

	"pdcluster.dev/pdcluster-operator/test/sim/kvpublish"
)

// followStandIn follows a stand-in publisher as engine "e" until the test ends, once before has
// published what the follower is to find in the replay buffer.
func followStandIn(t *testing.T, before func(*kvpublish.Publisher)) (*kvpublish.Publisher, *Follower) {
	t.Helper()
	p, pubAt, replayAt := startStandIn(t)
	before(p)
	f := &Follower{Index: NewIndex(0, 0), Topic: "kv", Log: testr.New(t)}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); f.Follow(ctx, Source{Engine: "e", Endpoint: pubAt, Replay: replayAt}) }()
	t.Cleanup(func() { cancel(); <-done })
	return p, f
}

// waitFor polls ok for 10 s.
func waitFor(t *testing.T, f *Follower, what string, ok func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !ok(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: streams %+v", what, f.Streams())
		}
	}
}

// holds is whether f's index holds ts as a prompt's first block of 4.
func holds(f *Follower, ts []uint32) bool {
	m := make([]int, 1)
	f.Index.MatchLeading(ts, 4, [][]string{{"e"}}, m)
	return m[0] == 1
}

func publish(t *testing.T, p *kvpublish.Publisher, event map[string]any) {
	t.Helper()
	if err := p.Publish(event); err != nil {
		t.Fatal(err)
	}
}

func forgedStored(hashes []any, ts []uint32, size int64) map[string]any {
	return map[string]any{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": nil, "token_ids": anyTokens(ts), "block_size": size}
}

// Issue 56's forged BlockStored (hashes times block size wrapping to the token ids' count), by
// replay and live, neither stops the follower nor reaches the index; the batches after it do.
// On the old code the index sliced 2^62 token ids in Follow's goroutine and the process died.
func TestFollowSurvivesForgedBlockSizes(t *testing.T) {
	p, f := followStandIn(t, func(p *kvpublish.Publisher) {
		publish(t, p, forgedStored([]any{1, 2, 3, 4}, nil, 1<<62))
		store(t, p, 10, tokens(0, 4))
	})
	waitFor(t, f, "the batch replayed after the forged one", func() bool { return holds(f, tokens(0, 4)) })
	publish(t, p, forgedStored([]any{1, 2, 3}, tokens(0, 2), 6148914691236517206))
	store(t, p, 11, tokens(10, 4))
	waitFor(t, f, "the live batch after the forged one", func() bool { return holds(f, tokens(10, 4)) })
	if s := f.Streams()["e"]; s.Batches != 2 || !holds(f, tokens(0, 4)) {
		t.Errorf("stream %+v: want the 2 valid batches applied and held, the forged ones refused", s)
	}
}

// A batch whose decoding panics, however it got past the checks, costs the engine its index and
// its pool's trust for a while, not the router: the follower counts it and goes on.
func TestFollowRecoversFromAPanic(t *testing.T) {
	old := decodeBatch
	decodeBatch = func(p []byte) (Batch, error) {
		b, err := Decode(p)
		if err == nil && len(b.Events) == 1 && b.Events[0].(Stored).BlockHashes[0] == 666 {
			panic("a batch no check foresaw")
		}
		return b, err
	}
	t.Cleanup(func() { decodeBatch = old })
	p, f := followStandIn(t, func(p *kvpublish.Publisher) { store(t, p, 1, tokens(0, 4)) })
	waitFor(t, f, "the replayed batch", func() bool { return holds(f, tokens(0, 4)) })
	store(t, p, 666, tokens(20, 4))
	waitFor(t, f, "the panic counted", func() bool { return f.Streams()["e"].Panics == 1 })
	if holds(f, tokens(0, 4)) || f.Trusted([][]string{{"e"}}, time.Now(), time.Minute) {
		t.Errorf("after a panic the engine's index is kept or trusted: streams %+v", f.Streams())
	}
	store(t, p, 2, tokens(10, 4))
	waitFor(t, f, "a batch after the panic", func() bool { return holds(f, tokens(10, 4)) })
}
