// The events read through msgpack's generic values: the array form older vLLM releases send,
// and the map form of every kind but BlockStored (decode.go reads that one from the bytes).

package kvevents

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Field order of the events in array form (older vLLM releases encoded events as arrays, the
// tag first; 0.30 and later as maps with a "type" key): the msgspec structs' declaration order.
var (
	storedFields  = []string{"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys", "group_idx"}
	removedFields = []string{"block_hashes", "medium", "group_idx"}
)

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

// eventOf is an event from msgpack's generic values (array form, and map form but BlockStored).
func eventOf(e any) (Event, error) {
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
		if err := checkBlocks(len(s.BlockHashes), len(s.TokenIDs), size); err != nil {
			return nil, err
		}
		s.BlockSize = int(size)
		s.Keyed = f["lora_id"] != nil || f["lora_name"] != nil
		// extra_keys and (0.32 on) lookahead_token_ids: one entry per block, nil when the
		// block's hash is its tokens' alone.
		for _, name := range []string{"extra_keys", "lookahead_token_ids"} {
			s.Keyed = s.Keyed || keyed(f[name])
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

// keyed is whether extra_keys or lookahead_token_ids (one entry per block, nil or empty when the
// block's hash is its tokens' alone) key any block by more than its tokens.
func keyed(v any) bool {
	keys, ok := v.([]any)
	if !ok {
		return false
	}
	for _, k := range keys {
		if l, isList := k.([]any); k != nil && (!isList || len(l) > 0) {
			return true
		}
	}
	return false
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
