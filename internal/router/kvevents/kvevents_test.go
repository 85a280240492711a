package kvevents

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"github.com/vmihailenco/msgpack/v5"
)

// tokens are n token ids from start.
func tokens(start, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(start + i)
	}
	return out
}

func anyTokens(ts []uint32) []any {
	out := make([]any, len(ts))
	for i, t := range ts {
		out[i] = t
	}
	return out
}

// batch encodes events as vLLM 0.30 and later do: [ts, [events as maps], rank].
func batch(t testing.TB, rank any, events ...map[string]any) []byte {
	t.Helper()
	list := make([]any, len(events))
	for i, e := range events {
		list[i] = e
	}
	b, err := msgpack.Marshal([]any{1.5, list, rank})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func stored(hashes []any, parent any, ts []uint32, size int) map[string]any {
	return map[string]any{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": anyTokens(ts), "block_size": size, "lora_id": nil, "medium": "GPU", "lora_name": nil, "group_idx": 0}
}

func TestDecode(t *testing.T) {
	big := uint64(1<<64 - 5) // vLLM's int hashes use all 64 bits
	for _, tc := range []struct {
		name    string
		payload []byte
		want    Batch
	}{{
		name: "stored, removed and cleared as maps, with a rank",
		payload: batch(t, 1,
			stored([]any{uint64(11), big}, nil, tokens(0, 8), 4),
			map[string]any{"type": "BlockRemoved", "block_hashes": []any{int64(7)}, "medium": "GPU", "group_idx": 1},
			map[string]any{"type": "AllBlocksCleared"}),
		want: Batch{TS: 1.5, DataParallelRank: 1, Events: []Event{
			Stored{BlockHashes: []uint64{11, big}, TokenIDs: tokens(0, 8), BlockSize: 4, Medium: "GPU"},
			Removed{BlockHashes: []uint64{7}, Group: 1, Medium: "GPU"},
			Cleared{},
		}},
	}, {
		name: "array events (older releases), bytes hashes, a parent, no rank",
		payload: func() []byte {
			b, _ := msgpack.Marshal([]any{1.0, []any{
				[]any{"BlockStored", []any{[]byte{0xff, 0, 0, 0, 0, 0, 0, 0, 0, 9}}, []byte{1, 2}, anyTokens(tokens(5, 2)), 2, nil, "GPU"},
				[]any{"BlockRemoved", []any{uint8(3)}, nil},
				[]any{"AllBlocksCleared"},
			}})
			return b
		}(),
		want: Batch{TS: 1, DataParallelRank: -1, Events: []Event{
			Stored{BlockHashes: []uint64{9}, Parent: 0x0102, HasParent: true, TokenIDs: tokens(5, 2), BlockSize: 2, Medium: "GPU"},
			Removed{BlockHashes: []uint64{3}},
			Cleared{},
		}},
	}, {
		name: "a LoRA adapter's blocks, blocks with extra keys or lookahead tokens are keyed; an unknown kind is skipped",
		payload: batch(t, nil,
			func() map[string]any { s := stored([]any{1}, nil, tokens(0, 2), 2); s["lora_name"] = "a"; return s }(),
			func() map[string]any {
				s := stored([]any{2}, nil, tokens(0, 2), 2)
				s["extra_keys"] = []any{[]any{"salt"}}
				return s
			}(),
			func() map[string]any {
				s := stored([]any{3}, nil, tokens(0, 2), 2)
				s["extra_keys"] = []any{nil}
				return s
			}(),
			func() map[string]any {
				s := stored([]any{4}, nil, tokens(0, 2), 2)
				s["lookahead_token_ids"] = []any{[]any{7}}
				return s
			}(),
			func() map[string]any {
				s := stored([]any{5}, nil, tokens(0, 2), 2)
				s["lookahead_token_ids"] = []any{[]any{}}
				return s
			}(),
			map[string]any{"type": "BlockMoved"}),
		want: Batch{TS: 1.5, DataParallelRank: -1, Events: []Event{
			Stored{BlockHashes: []uint64{1}, TokenIDs: tokens(0, 2), BlockSize: 2, Keyed: true, Medium: "GPU"},
			Stored{BlockHashes: []uint64{2}, TokenIDs: tokens(0, 2), BlockSize: 2, Keyed: true, Medium: "GPU"},
			Stored{BlockHashes: []uint64{3}, TokenIDs: tokens(0, 2), BlockSize: 2, Medium: "GPU"},
			Stored{BlockHashes: []uint64{4}, TokenIDs: tokens(0, 2), BlockSize: 2, Keyed: true, Medium: "GPU"},
			Stored{BlockHashes: []uint64{5}, TokenIDs: tokens(0, 2), BlockSize: 2, Medium: "GPU"},
		}},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Decode(tc.payload)
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("(-want +got):\n%s", diff)
			}
		})
	}
}

func TestDecodeRefusesMalformed(t *testing.T) {
	for name, payload := range map[string][]byte{
		"not msgpack":                {0xc1},
		"not an array":               func() []byte { b, _ := msgpack.Marshal("x"); return b }(),
		"no events":                  func() []byte { b, _ := msgpack.Marshal([]any{1.0}); return b }(),
		"events not an array":        func() []byte { b, _ := msgpack.Marshal([]any{1.0, 3}); return b }(),
		"tokens short of the blocks": batch(t, nil, stored([]any{1, 2}, nil, tokens(0, 3), 2)),
		"a negative token":           batch(t, nil, stored([]any{1}, nil, []uint32{}, 1), map[string]any{"type": "BlockStored", "block_hashes": []any{1}, "token_ids": []any{-1}, "block_size": 1}),
		"a zero block size":          batch(t, nil, stored([]any{}, nil, nil, 0)),
		"a hash of the wrong type":   batch(t, nil, stored([]any{"h"}, nil, tokens(0, 2), 2)),
	} {
		if b, err := Decode(payload); err == nil {
			t.Errorf("%s: decoded %+v, want an error", name, b)
		}
	}
}

// Whatever an engine's publisher sends, Decode returns: the router reads these from pods.
func TestDecodeNeverPanics(t *testing.T) {
	valid := batch(t, 0, stored([]any{1, 2}, 9, tokens(0, 4), 2), map[string]any{"type": "BlockRemoved", "block_hashes": []any{1}})
	rng := rand.New(rand.NewPCG(1, 2))
	for range 20000 {
		p := append([]byte(nil), valid[:rng.IntN(len(valid)+1)]...)
		for range rng.IntN(4) + 1 {
			if len(p) > 0 {
				p[rng.IntN(len(p))] = byte(rng.Uint32())
			}
		}
		agree(t, p)
	}
}

// FuzzDecode holds Decode to the generic decoding's answers, and what it decodes to an index
// that takes it: the router applies whatever an engine's publisher sends.
func FuzzDecode(f *testing.F) {
	f.Add(batch(f, 0, stored([]any{1, 2}, 9, tokens(0, 4), 2)))
	for _, p := range wrappingBlockSizes(f) {
		f.Add(p)
	}
	f.Fuzz(func(t *testing.T, p []byte) {
		agree(t, p)
		if b, err := Decode(p); err == nil {
			ix := NewIndex(64, 0)
			ix.Apply("e", b.Events)
			ix.MatchLeading(tokens(0, 64), 2, [][]string{{"e"}}, make([]int, 1))
		}
	})
}

// wrappingBlockSizes are BlockStored events whose hashes times block size wrap in 64 bits to
// the token ids they carry (issue 56): 4 hashes of 2^62 to none, 3 of (2^64+2)/3 to 2; in map
// form, as vLLM 0.30 and later send them, and in array form.
func wrappingBlockSizes(t testing.TB) map[string][]byte {
	forged := func(hashes []any, ts []uint32, size int64) map[string]any {
		return map[string]any{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": nil, "token_ids": anyTokens(ts), "block_size": size}
	}
	array, err := msgpack.Marshal([]any{1.5, []any{[]any{"BlockStored", []any{1, 2, 3, 4}, nil, []any{}, int64(1 << 62), nil, "GPU"}}, 0})
	if err != nil {
		t.Fatal(err)
	}
	return map[string][]byte{
		"4 hashes of 2^62, no token ids":           batch(t, 0, forged([]any{1, 2, 3, 4}, nil, 1<<62)),
		"3 hashes of (2^64+2)/3, 2 token ids":      batch(t, 0, forged([]any{1, 2, 3}, tokens(0, 2), 6148914691236517206)),
		"after a valid event":                      batch(t, 0, stored([]any{1}, nil, tokens(0, 2), 2), forged([]any{5, 6, 7, 8}, nil, 1<<62)),
		"array form, 4 hashes of 2^62, no ids":     array,
		"a block size past any context, no blocks": batch(t, 0, forged([]any{}, nil, 1<<40)),
	}
}

// A block size that makes the event's hashes times it wrap to its token ids' count is refused by
// both decoders, not read as consistent (issue 56: the index then sliced 2^62 token ids).
func TestDecodeRefusesBlockSizesThatWrap(t *testing.T) {
	for name, payload := range wrappingBlockSizes(t) {
		for dname, decode := range map[string]func([]byte) (Batch, error){"Decode": Decode, "generic": decodeGeneric} {
			if b, err := decode(payload); err == nil {
				t.Errorf("%s: %s decoded %+v, want an error", name, dname, b)
			}
		}
	}
}

func TestIndex(t *testing.T) {
	prompt := tokens(100, 12) // three blocks of 4
	for _, tc := range []struct {
		name   string
		events []Event
		// matched is the leading blocks of prompt the engine holds after events; orphans the
		// blocks Apply skipped for an unknown parent.
		matched, orphans int
	}{{
		name:    "the blocks of one event",
		events:  []Event{Stored{BlockHashes: []uint64{1, 2, 3}, TokenIDs: prompt, BlockSize: 4}},
		matched: 3,
	}, {
		name: "blocks chained over events by their parents",
		events: []Event{
			Stored{BlockHashes: []uint64{1}, TokenIDs: prompt[:4], BlockSize: 4},
			Stored{BlockHashes: []uint64{2, 3}, Parent: 1, HasParent: true, TokenIDs: prompt[4:], BlockSize: 4},
		},
		matched: 3,
	}, {
		name:    "a block whose parent is unknown is skipped",
		events:  []Event{Stored{BlockHashes: []uint64{2, 3}, Parent: 1, HasParent: true, TokenIDs: prompt[4:], BlockSize: 4}},
		orphans: 2,
	}, {
		name: "the same tokens after other tokens are another block",
		events: []Event{
			Stored{BlockHashes: []uint64{9}, TokenIDs: tokens(0, 4), BlockSize: 4},
			Stored{BlockHashes: []uint64{1, 2, 3}, Parent: 9, HasParent: true, TokenIDs: prompt, BlockSize: 4},
		},
	}, {
		name: "a removed block ends the match there",
		events: []Event{
			Stored{BlockHashes: []uint64{1, 2, 3}, TokenIDs: prompt, BlockSize: 4},
			Removed{BlockHashes: []uint64{2}},
		},
		matched: 1,
	}, {
		name: "a block held by two KV cache groups is held until both removed it",
		events: []Event{
			Stored{BlockHashes: []uint64{1}, TokenIDs: prompt[:4], BlockSize: 4},
			Stored{BlockHashes: []uint64{1}, TokenIDs: prompt[:4], BlockSize: 4, Group: 1},
			Removed{BlockHashes: []uint64{1}},
		},
		matched: 1,
	}, {
		name: "cleared",
		events: []Event{
			Stored{BlockHashes: []uint64{1, 2, 3}, TokenIDs: prompt, BlockSize: 4},
			Cleared{},
		},
	}, {
		name: "keyed blocks and an offloading tier's are not the engine's to match",
		events: []Event{
			Stored{BlockHashes: []uint64{1, 2, 3}, TokenIDs: prompt, BlockSize: 4, Keyed: true},
			Stored{BlockHashes: []uint64{4, 5, 6}, TokenIDs: prompt, BlockSize: 4, Medium: "CPU"},
		},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			ix := NewIndex(0, 0)
			orphans := ix.Apply("e", tc.events)
			matched := make([]int, 2)
			ix.MatchLeading(prompt, 4, [][]string{{"e"}, {"other"}}, matched)
			if diff := cmp.Diff([]int{tc.matched, 0}, matched); diff != "" || orphans != tc.orphans {
				t.Errorf("matched (-want +got):\n%s\norphans %d, want %d", diff, orphans, tc.orphans)
			}
		})
	}
}

// The index takes what Decode would refuse without panicking and without holding any of it:
// an event whose token ids do not make its blocks (issue 56) is skipped whole.
func TestIndexSkipsInconsistentStored(t *testing.T) {
	ix := NewIndex(0, 0)
	err := func() (err error) {
		defer func() {
			if p := recover(); p != nil {
				err = fmt.Errorf("Apply panicked: %v", p)
			}
		}()
		ix.Apply("e", []Event{
			Stored{BlockHashes: []uint64{1, 2, 3, 4}, BlockSize: 1 << 62},
			Stored{BlockHashes: []uint64{1, 2, 3}, TokenIDs: tokens(0, 2), BlockSize: 6148914691236517206},
			Stored{BlockHashes: []uint64{1}, TokenIDs: tokens(0, 3), BlockSize: 2},
			Stored{BlockHashes: []uint64{1}, BlockSize: 0},
			Stored{BlockHashes: []uint64{1}, TokenIDs: tokens(0, 1), BlockSize: -1},
			Stored{BlockHashes: []uint64{9}, TokenIDs: tokens(0, 2), BlockSize: 2},
		})
		return nil
	}()
	if err != nil {
		t.Fatal(err)
	}
	matched := make([]int, 1)
	ix.MatchLeading(tokens(0, 4), 2, [][]string{{"e"}}, matched)
	size, _ := ix.CommonBlockSize([][]string{{"e"}})
	if ix.Blocks("e") != 1 || matched[0] != 1 || size != 2 {
		t.Errorf("%d blocks held, %d matched, block size %d; want the one valid event's: 1, 1, 2", ix.Blocks("e"), matched[0], size)
	}
}

func TestIndexIsBounded(t *testing.T) {
	ix := NewIndex(100, 0)
	for i := range 1000 {
		ix.Apply("e", []Event{Stored{BlockHashes: []uint64{uint64(i)}, TokenIDs: tokens(i, 2), BlockSize: 2}})
	}
	if got := ix.Blocks("e"); got != 100 {
		t.Errorf("%d blocks after 1000 stored, want the bound, 100", got)
	}
	ix.Retain(func(string) bool { return false })
	if got := ix.Size(); got != 0 {
		t.Errorf("%d blocks after the engine left, want 0", got)
	}
}

// The msgpack library sizes a map by its header and recurses as deep as the input nests: a
// few hostile bytes would take the router's memory or stack. Each payload is refused by the
// bound meant for it (the error says which): a batch nested deep but cut short would be refused
// for its truncation alone, and without the depth bound a complete one nested 3 million deep
// overflows the stack, fatally (issue 56).
func TestDecodeRefusesHostileSizes(t *testing.T) {
	// nested is a complete batch [0, [event]] whose one event nests n containers deep, each
	// opened by open, the innermost an empty array.
	nested := func(n int, open ...byte) []byte {
		p := append([]byte{0x92, 0x00, 0x91}, bytes.Repeat(open, n)...)
		return append(p, 0x90)
	}
	// inExtraKeys is a BlockStored whose extra_keys, read as generic values, nest n deep.
	inExtraKeys := func(n int) []byte {
		var deep any = []any{}
		for range n {
			deep = []any{deep}
		}
		e := stored([]any{1}, nil, tokens(0, 2), 2)
		e["extra_keys"] = deep
		return batch(t, 0, e)
	}
	for _, tc := range []struct {
		name    string
		payload []byte
		want    string
	}{
		{"a map claiming 2^32 entries", []byte{0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0xdf, 0xff, 0xff, 0xff, 0xff}, "a container of"},
		{"an array claiming 2^32 items", []byte{0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff}, "a container of"},
		{"a string longer than the batch", []byte{0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdb, 0xff, 0xff, 0xff, 0xff}, "truncated"},
		{"arrays nested 10000 deep, complete", nested(10000, 0x91), "nested deeper than"},
		{"array16s nested 10000 deep, complete", nested(10000, 0xdc, 0, 1), "nested deeper than"},
		{"maps nested 10000 deep, complete", nested(10000, 0x81, 0xa1, 'k'), "nested deeper than"},
		{"a BlockStored's extra_keys nested 10000 deep", inExtraKeys(10000), "nested deeper than"},
	} {
		done := make(chan error, 1)
		go func() { _, err := Decode(tc.payload); done <- err }()
		select {
		case err := <-done:
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%s: error %v, want one saying %q", tc.name, err, tc.want)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("%s: Decode did not return in 10 s", tc.name)
		}
	}
}

// What the router asks of a pool, each in one locked call: the block size its engines' events
// agree on (engines that stored nothing aside), and each pod's best rank's match.
func TestPoolQueries(t *testing.T) {
	prompt := tokens(0, 12)
	ix := NewIndex(0, 0)
	ix.Apply("a", []Event{Stored{BlockHashes: []uint64{1, 2}, TokenIDs: prompt[:8], BlockSize: 4}})
	ix.Apply("a#1", []Event{Stored{BlockHashes: []uint64{1, 2, 3}, TokenIDs: prompt, BlockSize: 4}})
	ix.Apply("c", []Event{Stored{BlockHashes: []uint64{1}, TokenIDs: prompt[:8], BlockSize: 8}})
	for _, tc := range []struct {
		name  string
		pods  [][]string
		size  int
		agree bool
	}{
		{"ranks of one size, a pod that stored nothing", [][]string{{"a", "a#1"}, {"b"}}, 4, true},
		{"sizes that differ", [][]string{{"a"}, {"c"}}, 0, false},
		{"nothing stored anywhere", [][]string{{"b"}}, 0, true},
	} {
		if size, agree := ix.CommonBlockSize(tc.pods); size != tc.size || agree != tc.agree {
			t.Errorf("%s: CommonBlockSize = %d, %v; want %d, %v", tc.name, size, agree, tc.size, tc.agree)
		}
	}
	matched := make([]int, 2)
	ix.MatchLeading(prompt, 4, [][]string{{"a", "a#1"}, {"b"}}, matched)
	if diff := cmp.Diff([]int{3, 0}, matched); diff != "" {
		t.Errorf("MatchLeading (-want +got):\n%s", diff)
	}
}

// A pool's events are trusted when every engine's stream is connected and lost nothing within
// the window.
func TestTrusted(t *testing.T) {
	now := time.Now()
	f := &Follower{}
	f.update("up", func(s *Stream) { s.Connected = true })
	f.update("lost-lately", func(s *Stream) { s.Connected, s.LastLoss = true, now.Add(-30*time.Second) })
	f.update("lost-long-ago", func(s *Stream) { s.Connected, s.LastLoss = true, now.Add(-2*time.Minute) })
	f.update("down", func(s *Stream) {})
	for _, tc := range []struct {
		engines []string
		want    bool
	}{
		{[]string{"up", "lost-long-ago"}, true},
		{[]string{"up", "lost-lately"}, false},
		{[]string{"up", "down"}, false},
		{[]string{"up", "never-followed"}, false},
	} {
		if got := f.Trusted([][]string{tc.engines}, now, time.Minute); got != tc.want {
			t.Errorf("Trusted(%v) = %v, want %v", tc.engines, got, tc.want)
		}
	}
}

// decodeGeneric is Decode through msgpack's generic values alone (as Decode was before its
// BlockStored fast path): the reference the fast path must agree with.
func decodeGeneric(payload []byte) (Batch, error) {
	if err := wellFormed(payload); err != nil {
		return Batch{}, err
	}
	var raw []any
	if err := msgpack.Unmarshal(payload, &raw); err != nil {
		return Batch{}, err
	}
	if len(raw) < 2 {
		return Batch{}, errors.New("short")
	}
	events, ok := raw[1].([]any)
	if !ok {
		return Batch{}, errors.New("events")
	}
	b := Batch{DataParallelRank: -1}
	switch ts := raw[0].(type) {
	case float64:
		b.TS = ts
	case float32:
		b.TS = float64(ts)
	}
	if len(raw) > 2 && raw[2] != nil {
		rank, err := integer(raw[2])
		if err != nil {
			return Batch{}, err
		}
		b.DataParallelRank = int(rank)
	}
	for _, e := range events {
		ev, err := eventOf(e)
		if err != nil {
			return Batch{}, err
		}
		if ev != nil {
			b.Events = append(b.Events, ev)
		}
	}
	return b, nil
}

// agree fails t when Decode and decodeGeneric disagree on p: both fail, or both decode alike.
func agree(t testing.TB, p []byte) {
	t.Helper()
	got, err := Decode(p)
	want, wantErr := decodeGeneric(p)
	if (err == nil) != (wantErr == nil) {
		t.Fatalf("payload %x: Decode error %v, the generic decoding's %v", p, err, wantErr)
	}
	if err == nil {
		if diff := cmp.Diff(want, got, cmpopts.EquateEmpty(), cmpopts.EquateNaNs()); diff != "" {
			t.Fatalf("payload %x: Decode (-generic +fast):\n%s", p, diff)
		}
	}
}

// Decode's BlockStored fast path reads what msgpack's generic values read, and fails where they
// fail: on vLLM-shaped batches with every field varied, and on those batches mutated.
func TestDecodeFastPathAgrees(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	values := []any{nil, 0, 1, -1, 7, uint64(1 << 63), int64(-1 << 40), 2.5, "GPU", "CPU", []byte{1, 2, 3}, []any{}, []any{nil}, []any{[]any{"salt"}}, []any{1, 2}, map[string]any{"x": 1}, true}
	keys := []string{"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys", "lookahead_token_ids", "group_idx", "type", "other"}
	for range 20000 {
		var events []any
		for range 1 + rng.IntN(3) {
			n := 1 + rng.IntN(3)
			size := 1 + rng.IntN(3)
			hs := make([]any, n)
			for i := range hs {
				hs[i] = []any{uint64(rng.Uint64()), int64(rng.IntN(100)), []byte{byte(rng.IntN(256)), 9}}[rng.IntN(3)]
			}
			e := stored(hs, nil, tokens(rng.IntN(70000), n*size), size)
			if rng.IntN(2) == 0 {
				e["parent_block_hash"] = uint64(rng.Uint64())
			}
			for range rng.IntN(3) {
				k := keys[rng.IntN(len(keys))]
				if rng.IntN(5) == 0 {
					delete(e, k)
				} else {
					e[k] = values[rng.IntN(len(values))]
				}
			}
			events = append(events, e)
		}
		p, err := msgpack.Marshal([]any{1.5, events, rng.IntN(3)})
		if err != nil {
			t.Fatal(err)
		}
		agree(t, p)
		q := slices.Clone(p)
		q[rng.IntN(len(q))] = byte(rng.Uint32())
		agree(t, q)
	}
}
