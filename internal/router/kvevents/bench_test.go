package kvevents

import (
	"context"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/vmihailenco/msgpack/v5"

	"pdcluster.dev/pdcluster-operator/test/sim/kvpublish"
)

// benchBatch is what an engine publishes for one request of BenchmarkPrefixRouting's (a 64-token
// prompt in 4 blocks of 16, held already): one BlockStored of the 4 blocks.
func benchBatch(b *testing.B) []byte {
	hs, ids := make([]any, 4), make([]any, 64)
	for i := range hs {
		hs[i] = uint64(1000 + i)
	}
	for i := range ids {
		ids[i] = uint32(100 + i)
	}
	payload, err := msgpack.Marshal([]any{1.0, []any{map[string]any{"type": "BlockStored", "block_hashes": hs, "parent_block_hash": nil,
		"token_ids": ids, "block_size": 16, "lora_id": nil, "medium": "GPU", "lora_name": nil}}, 0})
	if err != nil {
		b.Fatal(err)
	}
	return payload
}

// The router's work per batch an engine publishes: decode it and apply it to the index.
func BenchmarkIngest(b *testing.B) {
	payload := benchBatch(b)
	ix := NewIndex(0)
	b.ReportAllocs()
	for b.Loop() {
		batch, err := Decode(payload)
		if err != nil {
			b.Fatal(err)
		}
		ix.Apply("e", batch.Events)
	}
}

// The router's work per request and pool: hash the prompt's blocks and match them on two
// engines.
func BenchmarkMatch(b *testing.B) {
	batch, err := Decode(benchBatch(b))
	if err != nil {
		b.Fatal(err)
	}
	ix := NewIndex(0)
	ix.Apply("e0", batch.Events)
	ix.Apply("e1", batch.Events)
	tokens := make([]uint32, 64)
	for i := range tokens {
		tokens[i] = uint32(100 + i)
	}
	urls := []string{"e0", "e1"}
	matched := make([]int, 2)
	b.ReportAllocs()
	for b.Loop() {
		ix.Match(Hashes(tokens, 16), func(i int) string { return urls[i] }, matched)
	}
	if matched[0] != 4 {
		b.Fatalf("matched %v", matched)
	}
}

// The router's whole work per batch an engine publishes, the socket's included: receive,
// sequence, decode, apply (the publisher runs in the same process).
func BenchmarkFollow(b *testing.B) {
	p, err := kvpublish.Listen("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "kv", 0)
	if err != nil {
		b.Fatal(err)
	}
	defer p.Close()
	f := &Follower{Index: NewIndex(0), Topic: "kv", Log: logr.Discard()}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go f.Follow(ctx, Source{Engine: "e", Endpoint: "tcp://" + p.Addr(), Replay: "tcp://" + p.ReplayAddr()})
	hs := []uint64{1000, 1001, 1002, 1003}
	ids := make([]uint32, 64)
	for i := range ids {
		ids[i] = uint32(100 + i)
	}
	event := kvpublish.Stored(hs, nil, ids, 16)
	for f.Streams()["e"].Batches == 0 {
		_ = p.Publish(event)
		time.Sleep(10 * time.Millisecond)
	}
	start := f.Streams()["e"].Batches
	b.ResetTimer()
	for range b.N {
		_ = p.Publish(event)
	}
	for f.Streams()["e"].Batches < start+b.N {
		time.Sleep(time.Millisecond)
	}
}
