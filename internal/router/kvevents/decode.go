// Package kvevents follows vLLM's KV cache events (--kv-events-config, a ZMQ publisher per
// engine): which blocks each engine holds, by the token ids they hold, so the router can match
// a request's token ids against every engine's cache exactly.
//
// The index keys each block by the router's own hash of the block's tokens chained from the
// prompt's start, learned from the events' token ids and parent links, not by vLLM's block hash:
// vLLM's hash depends on its release, its --prefix-caching-hash-algo and, for some algorithms,
// PYTHONHASHSEED, none of which the router then needs to know. What the router must share
// with vLLM is where blocks start and end (the block size each event states) and that a block
// carrying extra keys (a LoRA adapter, multimodal inputs, a cache salt) is another block: such
// blocks are not indexed, and requests that would make them are not matched.
package kvevents

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/vmihailenco/msgpack/v5"
)

// Batch is one message of an engine's publisher: vLLM's KVEventBatch.
type Batch struct {
	// TS is when the engine made the batch, seconds since the epoch.
	TS float64
	// Events in the order the engine made them.
	Events []Event
	// DataParallelRank is the publishing engine's rank, -1 when the batch does not say.
	DataParallelRank int
}

// Event is one of Stored, Removed and Cleared.
type Event interface{ kind() string }

// Stored is vLLM's BlockStored: blocks the engine cached, each chained to the one before it
// (Parent for the first).
type Stored struct {
	BlockHashes []uint64
	// Parent is the block before the first, when HasParent.
	Parent    uint64
	HasParent bool
	// TokenIDs are the tokens of all the blocks, BlockSize each.
	TokenIDs  []uint32
	BlockSize int
	// Keyed is set when the blocks' hashes cover more than their tokens (a LoRA adapter,
	// extra keys, tokens after the block): a request's tokens alone cannot match them.
	Keyed bool
	// Group is the KV cache group (hybrid models have several), 0 when not stated.
	Group int
	// Medium is where the blocks are ("GPU", or an offloading tier's "CPU"), "" when unstated.
	Medium string
}

// Removed is vLLM's BlockRemoved: blocks the engine evicted.
type Removed struct {
	BlockHashes []uint64
	Group       int
	Medium      string
}

// Cleared is vLLM's AllBlocksCleared: the engine dropped its whole cache.
type Cleared struct{}

func (Stored) kind() string  { return "BlockStored" }
func (Removed) kind() string { return "BlockRemoved" }
func (Cleared) kind() string { return "AllBlocksCleared" }

// Field order of the events in array form (older vLLM releases encoded events as arrays, the
// tag first; 0.30 and later as maps with a "type" key): the msgspec structs' declaration order.
var (
	storedFields  = []string{"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys", "group_idx"}
	removedFields = []string{"block_hashes", "medium", "group_idx"}
)

// Decode reads one KVEventBatch payload. Malformed input is an error, never a panic: an event
// of a kind it does not know is skipped (a newer vLLM may add kinds), a known event with fields
// of the wrong type fails the batch.
func Decode(payload []byte) (Batch, error) {
	if err := wellFormed(payload); err != nil {
		return Batch{}, fmt.Errorf("kv event batch: %w", err)
	}
	var raw []any
	if err := msgpack.Unmarshal(payload, &raw); err != nil {
		return Batch{}, fmt.Errorf("kv event batch: %w", err)
	}
	// [ts, events, data_parallel_rank?]
	if len(raw) < 2 {
		return Batch{}, fmt.Errorf("kv event batch: %d fields, want ts and events", len(raw))
	}
	events, ok := raw[1].([]any)
	if !ok {
		return Batch{}, fmt.Errorf("kv event batch: events is %T, want an array", raw[1])
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
			return Batch{}, fmt.Errorf("kv event batch: data_parallel_rank: %w", err)
		}
		b.DataParallelRank = int(rank)
	}
	for i, e := range events {
		ev, err := decodeEvent(e)
		if err != nil {
			return Batch{}, fmt.Errorf("kv event batch: event %d: %w", i, err)
		}
		if ev != nil {
			b.Events = append(b.Events, ev)
		}
	}
	return b, nil
}

// maxDepth bounds nesting: a batch is at most 5 deep (batch, events, event, extra_keys, a key).
const maxDepth = 8

// wellFormed checks payload is one msgpack value whose every length fits in the bytes that
// follow it, nested at most maxDepth deep, before the msgpack library allocates for it: the
// library sizes a map by its header (a 5-byte header claiming 2^32 entries), and recurses as
// deep as the input nests.
func wellFormed(p []byte) error {
	// pending counts the values still to read at each open level.
	pending := []uint64{1}
	i := 0
	take := func(n uint64) error {
		if uint64(len(p)-i) < n {
			return errors.New("truncated msgpack")
		}
		i += int(n)
		return nil
	}
	length := func(size int) (uint64, error) {
		if len(p)-i < size {
			return 0, errors.New("truncated msgpack")
		}
		var n uint64
		for _, b := range p[i : i+size] {
			n = n<<8 | uint64(b)
		}
		i += size
		return n, nil
	}
	for len(pending) > 0 {
		if pending[len(pending)-1] == 0 {
			pending = pending[:len(pending)-1]
			continue
		}
		pending[len(pending)-1]--
		if i >= len(p) {
			return errors.New("truncated msgpack")
		}
		b := p[i]
		i++
		var items uint64 // a container's values
		var err error
		switch {
		case b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3:
		case b >= 0x80 && b <= 0x8f:
			items = 2 * uint64(b&0x0f)
		case b >= 0x90 && b <= 0x9f:
			items = uint64(b & 0x0f)
		case b >= 0xa0 && b <= 0xbf:
			err = take(uint64(b & 0x1f))
		case b == 0xc4 || b == 0xd9:
			var n uint64
			if n, err = length(1); err == nil {
				err = take(n)
			}
		case b == 0xc5 || b == 0xda:
			var n uint64
			if n, err = length(2); err == nil {
				err = take(n)
			}
		case b == 0xc6 || b == 0xdb:
			var n uint64
			if n, err = length(4); err == nil {
				err = take(n)
			}
		case b >= 0xc7 && b <= 0xc9: // ext 8/16/32: length, type, data
			var n uint64
			if n, err = length(1 << (b - 0xc7)); err == nil {
				err = take(n + 1)
			}
		case b == 0xca || b == 0xce || b == 0xd2:
			err = take(4)
		case b == 0xcb || b == 0xcf || b == 0xd3:
			err = take(8)
		case b == 0xcc || b == 0xd0:
			err = take(1)
		case b == 0xcd || b == 0xd1:
			err = take(2)
		case b >= 0xd4 && b <= 0xd8: // fixext 1..16 and its type
			err = take(1<<(b-0xd4) + 1)
		case b == 0xdc:
			items, err = length(2)
		case b == 0xdd:
			items, err = length(4)
		case b == 0xde:
			items, err = length(2)
			items *= 2
		case b == 0xdf:
			items, err = length(4)
			items *= 2
		default:
			return fmt.Errorf("byte 0x%02x at %d is not msgpack", b, i-1)
		}
		if err != nil {
			return err
		}
		if items > 0 {
			// Every value takes a byte at least.
			if items > uint64(len(p)-i) {
				return fmt.Errorf("a container of %d values in %d bytes", items, len(p)-i)
			}
			if len(pending) == maxDepth {
				return fmt.Errorf("nested deeper than %d", maxDepth)
			}
			pending = append(pending, items)
		}
	}
	if i != len(p) {
		return fmt.Errorf("%d bytes after the batch", len(p)-i)
	}
	return nil
}

// fields are an event's fields by name, from either encoding.
func fields(e any) (string, map[string]any, error) {
	switch v := e.(type) {
	case map[string]any:
		tag, _ := v["type"].(string)
		return tag, v, nil
	case []any:
		if len(v) == 0 {
			return "", nil, errors.New("empty event")
		}
		tag, _ := v[0].(string)
		var names []string
		switch tag {
		case "BlockStored":
			names = storedFields
		case "BlockRemoved":
			names = removedFields
		}
		out := map[string]any{}
		for i, x := range v[1:] {
			if i < len(names) {
				out[names[i]] = x
			}
		}
		return tag, out, nil
	default:
		return "", nil, fmt.Errorf("event is %T", e)
	}
}

func decodeEvent(e any) (Event, error) {
	tag, f, err := fields(e)
	if err != nil {
		return nil, err
	}
	switch tag {
	case "BlockStored":
		var s Stored
		if s.BlockHashes, err = hashes(f["block_hashes"]); err != nil {
			return nil, fmt.Errorf("BlockStored block_hashes: %w", err)
		}
		if p := f["parent_block_hash"]; p != nil {
			if s.Parent, err = hash(p); err != nil {
				return nil, fmt.Errorf("BlockStored parent_block_hash: %w", err)
			}
			s.HasParent = true
		}
		tokens, ok := f["token_ids"].([]any)
		if !ok {
			return nil, fmt.Errorf("BlockStored token_ids is %T, want an array", f["token_ids"])
		}
		s.TokenIDs = make([]uint32, len(tokens))
		for i, t := range tokens {
			n, err := integer(t)
			if err != nil || n < 0 || n > 1<<32-1 {
				return nil, fmt.Errorf("BlockStored token_ids[%d]: %v is not a token id", i, t)
			}
			s.TokenIDs[i] = uint32(n)
		}
		size, err := integer(f["block_size"])
		if err != nil || size <= 0 {
			return nil, fmt.Errorf("BlockStored block_size %v is not a positive integer", f["block_size"])
		}
		s.BlockSize = int(size)
		if len(s.TokenIDs) != len(s.BlockHashes)*s.BlockSize {
			return nil, fmt.Errorf("BlockStored: %d token ids for %d blocks of %d", len(s.TokenIDs), len(s.BlockHashes), s.BlockSize)
		}
		s.Keyed = f["lora_id"] != nil || f["lora_name"] != nil
		// extra_keys and (0.32 on) lookahead_token_ids: one entry per block, nil when the
		// block's hash is its tokens' alone.
		for _, name := range []string{"extra_keys", "lookahead_token_ids"} {
			if keys, ok := f[name].([]any); ok {
				for _, k := range keys {
					if l, isList := k.([]any); k != nil && (!isList || len(l) > 0) {
						s.Keyed = true
					}
				}
			}
		}
		if s.Group, err = optionalInt(f["group_idx"]); err != nil {
			return nil, fmt.Errorf("BlockStored group_idx: %w", err)
		}
		s.Medium, _ = f["medium"].(string)
		return s, nil
	case "BlockRemoved":
		var r Removed
		if r.BlockHashes, err = hashes(f["block_hashes"]); err != nil {
			return nil, fmt.Errorf("BlockRemoved block_hashes: %w", err)
		}
		if r.Group, err = optionalInt(f["group_idx"]); err != nil {
			return nil, fmt.Errorf("BlockRemoved group_idx: %w", err)
		}
		r.Medium, _ = f["medium"].(string)
		return r, nil
	case "AllBlocksCleared":
		return Cleared{}, nil
	default:
		return nil, nil
	}
}

func hashes(v any) ([]uint64, error) {
	list, ok := v.([]any)
	if !ok {
		return nil, fmt.Errorf("%T, want an array", v)
	}
	out := make([]uint64, len(list))
	for i, h := range list {
		var err error
		if out[i], err = hash(h); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// hash is one ExternalBlockHash: an integer (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, the default),
// or the hash's bytes, of which vLLM's integer form is the last 8.
func hash(v any) (uint64, error) {
	if b, ok := v.([]byte); ok {
		if len(b) == 0 {
			return 0, errors.New("empty block hash")
		}
		var last [8]byte
		copy(last[8-min(8, len(b)):], b[max(0, len(b)-8):])
		return binary.BigEndian.Uint64(last[:]), nil
	}
	switch n := v.(type) {
	case uint64:
		return n, nil
	case uint8, uint16, uint32, int8, int16, int32, int64:
		i, _ := integer(n)
		return uint64(i), nil
	}
	return 0, fmt.Errorf("block hash is %T", v)
}

// integer reads any msgpack integer that fits an int64.
func integer(v any) (int64, error) {
	switch n := v.(type) {
	case int8:
		return int64(n), nil
	case int16:
		return int64(n), nil
	case int32:
		return int64(n), nil
	case int64:
		return n, nil
	case uint8:
		return int64(n), nil
	case uint16:
		return int64(n), nil
	case uint32:
		return int64(n), nil
	case uint64:
		if n > 1<<63-1 {
			return 0, fmt.Errorf("%d is out of range", n)
		}
		return int64(n), nil
	}
	return 0, fmt.Errorf("%v (%T) is not an integer", v, v)
}

func optionalInt(v any) (int, error) {
	if v == nil {
		return 0, nil
	}
	n, err := integer(v)
	return int(n), err
}
