// The bytes of request bodies the router holds at once, over all its requests.

package router

import (
	"errors"
	"io"
	"sync/atomic"
)

// bodyCopies is what a body costs while its request runs, in multiples of its size: the
// client's bytes, the parsed values, and each leg's encoded body.
const bodyCopies = 4

// MinBodyBytesInFlight is the smallest body budget that holds one body of maxBody bytes (0:
// DefaultMaxBodyBytes).
func MinBodyBytesInFlight(maxBody int64) int64 {
	if maxBody <= 0 {
		maxBody = DefaultMaxBodyBytes
	}
	return bodyCopies * maxBody
}

// bodyBudget bounds the bytes of request bodies in flight (times bodyCopies), so that a burst
// of large bodies is refused with 503 instead of growing the router past its memory: 8 bodies
// of 31 MiB took a router without it from 13 to 660 MiB.
type bodyBudget struct {
	limit int64
	used  atomic.Int64
}

// take reserves n bytes; false when they would pass the limit.
func (b *bodyBudget) take(n int64) bool {
	for {
		u := b.used.Load()
		if u+n > b.limit {
			return false
		}
		if b.used.CompareAndSwap(u, u+n) {
			return true
		}
	}
}

func (b *bodyBudget) give(n int64) { b.used.Add(-n) }

var errBodyBudget = errors.New("the router's budget of request bytes in flight is spent")

// chargedReader reserves bodyCopies times each byte it reads from the client, as it arrives,
// beyond what was taken up front (a body that said its length takes it all before the first
// read: readers that each took a part of the budget would otherwise starve each other, all
// refused). A body is refused as soon as the budget cannot hold it.
type chargedReader struct {
	r     io.Reader
	b     *bodyBudget
	read  int64 // bytes read
	taken int64 // bytes reserved: at least bodyCopies x read
}

// prepay reserves a body of n bytes before it is read; false when the budget cannot hold it.
func (c *chargedReader) prepay(n int64) bool {
	return n <= 0 || c.charge(n*bodyCopies)
}

// charge reserves n more bytes for the request (its body, or what it makes of it), given back
// when it ends; false when the budget cannot hold them.
func (c *chargedReader) charge(n int64) bool {
	if !c.b.take(n) {
		return false
	}
	c.taken += n
	return true
}

func (c *chargedReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	if n > 0 {
		c.read += int64(n)
		if need := c.read*bodyCopies - c.taken; need > 0 && !c.charge(need) {
			return 0, errBodyBudget
		}
	}
	return n, err
}
