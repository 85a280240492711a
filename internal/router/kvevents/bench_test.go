package kvevents

import (
	"context"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/vmihailenco/msgpack/v5"

	"pdcluster.dev/pdcluster-operator/test/sim/kvpublish"
)

// benchBatch is what a vLLM engine publishes for a request of a 512-token prompt in blocks of
// 64 that it held already: one BlockStored of the 8 blocks, token ids of a 32000-token
// vocabulary.
func benchBatch(b *testing.B) []byte {
	hs, ids := make([]any, 8), make([]any, 512)
	for i := range hs {
		hs[i] = uint64(1<<62 + i)
	}
	for i := range ids {
		ids[i] = uint32(1000 + 61*i%31000)
	}
	payload, err := msgpack.Marshal([]any{1.0, []any{map[string]any{"type": "BlockStored", "block_hashes": hs, "parent_block_hash": nil,
		"token_ids": ids, "block_size": 64, "lora_id": nil, "medium": "GPU", "lora_name": nil}}, 0})
	if err != nil {
		b.Fatal(err)
	}
	return payload
}

// The router's work per batch an engine publishes: decode it and apply it to the index.
func BenchmarkIngest(b *testing.B) {
	payload := benchBatch(b)
	ix := NewIndex(0, 0)
	b.ReportAllocs()
	for b.Loop() {
		batch, err := Decode(payload)
		if err != nil {
			b.Fatal(err)
		}
		ix.Apply("e", batch.Events)
	}
}

// The router's work per request and pool: hash the 512-token prompt's blocks and match them on
// two engines.
func BenchmarkMatch(b *testing.B) {
	batch, err := Decode(benchBatch(b))
	if err != nil {
		b.Fatal(err)
	}
	ix := NewIndex(0, 0)
	ix.Apply("e0", batch.Events)
	ix.Apply("e1", batch.Events)
	tokens := make([]uint32, 512)
	for i := range tokens {
		tokens[i] = uint32(1000 + 61*i%31000)
	}
	urls := [][]string{{"e0"}, {"e1"}}
	matched := make([]int, 2)
	b.ReportAllocs()
	for b.Loop() {
		ix.MatchLeading(tokens, 64, urls, matched)
	}
	if matched[0] != 8 {
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
	f := &Follower{Index: NewIndex(0, 0), Topic: "kv", Log: logr.Discard()}
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

// Decoding alone, Decode (with its BlockStored fast path) and msgpack's generic values
// (decodeGeneric, the reference), on the same vLLM-shaped batch.
func BenchmarkDecode(b *testing.B) {
	payload := benchBatch(b)
	for _, tc := range []struct {
		name   string
		decode func([]byte) (Batch, error)
	}{{"project", Decode}, {"reference", decodeGeneric}} {
		b.Run(tc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := tc.decode(payload); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
