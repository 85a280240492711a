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

// Decode reads one KVEventBatch payload. Malformed input is an error, never a panic: an event
// of a kind it does not know is skipped (a newer vLLM may add kinds), a known event with fields
// of the wrong type fails the batch. BlockStored in map form, every batch of 0.30 and later and
// most of the bytes, is read straight from the bytes (cursor.stored); the rest through msgpack's
// generic values.
func Decode(payload []byte) (Batch, error) {
	if err := wellFormed(payload); err != nil {
		return Batch{}, fmt.Errorf("kv event batch: %w", err)
	}
	c := &cursor{p: payload}
	// [ts, events, data_parallel_rank?]
	n, err := c.container(isArray)
	if err != nil {
		return Batch{}, fmt.Errorf("kv event batch: %w", err)
	}
	if n < 2 {
		return Batch{}, fmt.Errorf("kv event batch: %d fields, want ts and events", n)
	}
	b := Batch{DataParallelRank: -1}
	ts, err := c.value()
	if err != nil {
		return Batch{}, fmt.Errorf("kv event batch: ts: %w", err)
	}
	switch ts := ts.(type) {
	case float64:
		b.TS = ts
	case float32:
		b.TS = float64(ts)
	}
	events, err := c.container(isArray)
	if err != nil {
		return Batch{}, fmt.Errorf("kv event batch: events: %w", err)
	}
	for i := range events {
		ev, err := c.event()
		if err != nil {
			return Batch{}, fmt.Errorf("kv event batch: event %d: %w", i, err)
		}
		if ev != nil {
			b.Events = append(b.Events, ev)
		}
	}
	for f := 2; f < n; f++ {
		v, err := c.value()
		if err != nil {
			return Batch{}, fmt.Errorf("kv event batch: field %d: %w", f, err)
		}
		if f == 2 && v != nil {
			rank, err := integer(v)
			if err != nil {
				return Batch{}, fmt.Errorf("kv event batch: data_parallel_rank: %w", err)
			}
			b.DataParallelRank = int(rank)
		}
	}
	return b, nil
}

// cursor reads msgpack values from p, one after the other, p being wellFormed.
type cursor struct {
	p []byte
	i int
}

func (c *cursor) code() byte { return c.p[c.i] } // wellFormed: a value is there

// skip passes one value, containers with what they contain.
func (c *cursor) skip() error {
	for pending := uint64(1); pending > 0; pending-- {
		next, items, err := head(c.p, c.i)
		if err != nil {
			return err
		}
		c.i, pending = next, pending+items
	}
	return nil
}

// value is the next value as msgpack's generic values (which refuse what they cannot read,
// an unknown extension).
func (c *cursor) value() (any, error) {
	start := c.i
	if err := c.skip(); err != nil {
		return nil, err
	}
	var v any
	err := msgpack.Unmarshal(c.p[start:c.i], &v)
	return v, err
}

func isArray(b byte) bool { return b >= 0x90 && b <= 0x9f || b == 0xdc || b == 0xdd }
func isMap(b byte) bool   { return b >= 0x80 && b <= 0x8f || b == 0xde || b == 0xdf }
func isInt(b byte) bool   { return b <= 0x7f || b >= 0xe0 || b >= 0xcc && b <= 0xd3 }
func isStr(b byte) bool   { return b >= 0xa0 && b <= 0xbf || b >= 0xd9 && b <= 0xdb }
func isBin(b byte) bool   { return b >= 0xc4 && b <= 0xc6 }

// container reads an array's or map's header (is tells which kind is wanted): its values, a
// map's pairs.
func (c *cursor) container(is func(byte) bool) (int, error) {
	b := c.code()
	if !is(b) {
		return 0, fmt.Errorf("byte 0x%02x is not the container wanted", b)
	}
	next, items, err := head(c.p, c.i)
	if err != nil {
		return 0, err
	}
	c.i = next
	if isMap(b) {
		items /= 2
	}
	return int(items), nil
}

// bytes is the next string's or binary's bytes (the caller checked isStr or isBin).
func (c *cursor) bytes() ([]byte, error) {
	start := c.i
	next, _, err := head(c.p, c.i)
	if err != nil {
		return nil, err
	}
	hdr := 1 // a fixstr's
	switch c.p[start] {
	case 0xc4, 0xd9:
		hdr = 2
	case 0xc5, 0xda:
		hdr = 3
	case 0xc6, 0xdb:
		hdr = 5
	}
	c.i = next
	return c.p[start+hdr : next], nil
}

// integer is the next value, an integer of any width that fits an int64 (the caller checked
// isInt; wellFormed, that its bytes are there).
func (c *cursor) integer() (int64, error) {
	b := c.code()
	v := c.p[c.i+1:]
	var n int64
	size := 1
	switch {
	case b <= 0x7f || b >= 0xe0:
		n = int64(int8(b))
	case b == 0xcc:
		n, size = int64(v[0]), 2
	case b == 0xcd:
		n, size = int64(binary.BigEndian.Uint16(v)), 3
	case b == 0xce:
		n, size = int64(binary.BigEndian.Uint32(v)), 5
	case b == 0xcf:
		u := binary.BigEndian.Uint64(v)
		if u > 1<<63-1 {
			return 0, fmt.Errorf("%d is out of range", u)
		}
		n, size = int64(u), 9
	case b == 0xd0:
		n, size = int64(int8(v[0])), 2
	case b == 0xd1:
		n, size = int64(int16(binary.BigEndian.Uint16(v))), 3
	case b == 0xd2:
		n, size = int64(int32(binary.BigEndian.Uint32(v))), 5
	case b == 0xd3:
		n, size = int64(binary.BigEndian.Uint64(v)), 9
	}
	c.i += size
	return n, nil
}

// hash is the next value, one ExternalBlockHash, as hash reads it.
func (c *cursor) hash() (uint64, error) {
	switch b := c.code(); {
	case isBin(b):
		raw, err := c.bytes()
		if err != nil {
			return 0, err
		}
		return hash(raw)
	case b == 0xcf:
		u := binary.BigEndian.Uint64(c.p[c.i+1:])
		c.i += 9
		return u, nil
	case isInt(b):
		n, err := c.integer()
		return uint64(n), err
	default:
		return 0, fmt.Errorf("block hash of byte 0x%02x", b)
	}
}

// event reads the next event: a BlockStored map by stored, anything else by eventOf.
func (c *cursor) event() (Event, error) {
	start := c.i
	if isMap(c.code()) {
		// Read as a BlockStored (its "type" may come last): kept if it is one.
		ev, kind, err := c.stored()
		if err == nil && kind == "BlockStored" {
			return ev, nil
		}
		if err != nil { // the map's last "type" says whether the error is this event's
			c.i = start
			final, kerr := c.kind()
			if kerr != nil {
				return nil, kerr
			}
			if final == "BlockStored" {
				return nil, err
			}
		}
		c.i = start
	}
	v, err := c.value()
	if err != nil {
		return nil, err
	}
	return eventOf(v)
}

// kind is an event map's "type" ("" when it has none or it is not a string); the map's other
// values are skipped.
func (c *cursor) kind() (string, error) {
	n, err := c.container(isMap)
	if err != nil {
		return "", err
	}
	kind := ""
	for range n {
		key, err := c.key()
		if err != nil {
			return "", err
		}
		if string(key) == "type" && isStr(c.code()) {
			v, err := c.bytes()
			if err != nil {
				return "", err
			}
			kind = string(v)
			continue
		}
		if err := c.skip(); err != nil {
			return "", err
		}
	}
	return kind, nil
}

// key is the next map key as msgpack reads one into a string: a string's or binary's bytes, or
// nil for nil (an empty key, as msgpack has it; the fuzz target found the fast path refusing it).
func (c *cursor) key() ([]byte, error) {
	switch b := c.code(); {
	case b == 0xc0:
		c.i++
		return nil, nil
	case isStr(b) || isBin(b):
		return c.bytes()
	default:
		return nil, fmt.Errorf("a map key of byte 0x%02x", b)
	}
}

// stored reads an event map as a BlockStored without msgpack's generic values (its token ids
// are most of a batch, and boxing each one was most of what following an engine cost the
// router), and the map's "type" as far as it read.
func (c *cursor) stored() (_ Event, kind string, err error) {
	n, err := c.container(isMap)
	if err != nil {
		return nil, "", err
	}
	var s Stored
	var haveHashes, haveTokens bool
	size := int64(-1)
	for range n {
		key, err := c.key()
		if err != nil {
			return nil, kind, err
		}
		b := c.code()
		switch string(key) {
		case "type":
			kind = ""
			if isStr(b) {
				var k []byte
				k, err = c.bytes()
				kind = string(k)
			} else {
				_, err = c.value()
			}
		case "block_hashes":
			if s.BlockHashes, err = c.hashes(); err != nil {
				return nil, kind, fmt.Errorf("BlockStored block_hashes: %w", err)
			}
			haveHashes = true
		case "parent_block_hash":
			if s.HasParent = b != 0xc0; s.HasParent {
				s.Parent, err = c.hash()
			} else {
				c.i++
			}
		case "token_ids":
			if s.TokenIDs, err = c.tokens(); err != nil {
				return nil, kind, fmt.Errorf("BlockStored token_ids: %w", err)
			}
			haveTokens = true
		case "block_size":
			if !isInt(b) {
				return nil, kind, fmt.Errorf("BlockStored block_size of byte 0x%02x is not an integer", b)
			}
			size, err = c.integer()
		case "group_idx":
			switch {
			case b == 0xc0:
				s.Group = 0
				c.i++
			case isInt(b):
				var g int64
				g, err = c.integer()
				s.Group = int(g)
			default:
				return nil, kind, fmt.Errorf("BlockStored group_idx of byte 0x%02x is not an integer", b)
			}
		case "medium":
			s.Medium = ""
			if isStr(b) {
				var m []byte
				m, err = c.bytes()
				s.Medium = string(m)
			} else {
				_, err = c.value()
			}
		default:
			// lora_id, lora_name, extra_keys, lookahead_token_ids and fields this release
			// does not know; decoded, not skipped: a value msgpack cannot read (an unknown
			// extension) fails the event, as everywhere else.
			var v any
			v, err = c.value()
			switch string(key) {
			case "lora_id", "lora_name":
				s.Keyed = s.Keyed || v != nil
			case "extra_keys", "lookahead_token_ids":
				s.Keyed = s.Keyed || keyed(v)
			}
		}
		if err != nil {
			return nil, kind, err
		}
	}
	switch {
	case !haveHashes:
		return nil, kind, errors.New("BlockStored without block_hashes")
	case !haveTokens:
		return nil, kind, errors.New("BlockStored without token_ids")
	case size <= 0:
		return nil, kind, fmt.Errorf("BlockStored block_size %d is not a positive integer", size)
	}
	if err := checkBlocks(len(s.BlockHashes), len(s.TokenIDs), size); err != nil {
		return nil, kind, err
	}
	s.BlockSize = int(size)
	return s, kind, nil
}

// maxBlockSize bounds the block size an event may state: past any model's context, such a block
// would never fill. vLLM's are 1 to 256 tokens, hybrid models' a few thousand.
const maxBlockSize = 1 << 24

// checkBlocks is an error unless tokens token ids make blocks blocks of size each, size in
// 1..maxBlockSize. It divides rather than multiplies: blocks*size wraps in int (issue 56: 4
// hashes of 2^62 took no token ids, and the index sliced 2^62 of them).
func checkBlocks(blocks, tokens int, size int64) error {
	switch {
	case size <= 0 || size > maxBlockSize:
		return fmt.Errorf("BlockStored block_size %d is not in 1..%d", size, maxBlockSize)
	case tokens%int(size) != 0 || tokens/int(size) != blocks:
		return fmt.Errorf("BlockStored: %d token ids for %d blocks of %d", tokens, blocks, size)
	}
	return nil
}

func (c *cursor) tokens() ([]uint32, error) {
	n, err := c.container(isArray)
	if err != nil {
		return nil, err
	}
	out := make([]uint32, n)
	for i := range out {
		if b := c.code(); !isInt(b) {
			return nil, fmt.Errorf("[%d] of byte 0x%02x is not a token id", i, b)
		}
		t, err := c.integer()
		if err != nil || t < 0 || t > 1<<32-1 {
			return nil, fmt.Errorf("[%d]: %d is not a token id (%v)", i, t, err)
		}
		out[i] = uint32(t)
	}
	return out, nil
}

func (c *cursor) hashes() ([]uint64, error) {
	n, err := c.container(isArray)
	if err != nil {
		return nil, err
	}
	out := make([]uint64, n)
	for i := range out {
		if out[i], err = c.hash(); err != nil {
			return nil, err
		}
	}
	return out, nil
}
