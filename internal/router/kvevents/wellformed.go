// The check every payload passes before anything decodes it.

package kvevents

import (
	"errors"
	"fmt"
)

// maxDepth bounds nesting: a batch is at most 5 deep (batch, events, event, extra_keys, a key).
// It is all that bounds the msgpack library's recursion: without it a complete batch nested 3
// million deep overflows the router's stack, which no recover survives.
const maxDepth = 8

// wellFormed checks payload is one msgpack value whose every length fits in the bytes that
// follow it, nested at most maxDepth deep, before the msgpack library allocates for it: the
// library sizes a map by its header (a 5-byte header claiming 2^32 entries), and recurses as
// deep as the input nests.
func wellFormed(p []byte) error {
	// pending counts the values still to read at each open level.
	pending := []uint64{1}
	i := 0
	for len(pending) > 0 {
		if pending[len(pending)-1] == 0 {
			pending = pending[:len(pending)-1]
			continue
		}
		pending[len(pending)-1]--
		next, items, err := head(p, i)
		if err != nil {
			return err
		}
		i = next
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

// head reads the header of the msgpack value at p[i]: where the value's own bytes end (a
// container's values follow them) and how many values it contains (a map's keys and values).
func head(p []byte, i int) (end int, items uint64, err error) {
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
	if i >= len(p) {
		return 0, 0, errors.New("truncated msgpack")
	}
	b := p[i]
	i++
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
		return 0, 0, fmt.Errorf("byte 0x%02x at %d is not msgpack", b, i-1)
	}
	return i, items, err
}
