package kvevents

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
)

// bufferedScheme is zmq4's tcp transport with the subscriber's reads buffered and checked:
// zmq4 reads each frame's flags, size and body with reads of their own, a system call or more
// each (several per batch), which was most of what following an engine cost the router
// (BenchmarkFollow); and it trusts what the peer writes (issue 56): a frame's size goes to
// make([]byte, size) as claimed (2^62 panicked in zmq4's reader goroutine, 200 MiB was
// allocated), a READY whose property runs past its end panicked in the dial, and a peer that
// never greets blocked the dial for ever. guardedConn bounds all three before zmq4 reads a byte.
const bufferedScheme = "pdcluster-tcp"

func init() {
	if err := zmq4.RegisterTransport(bufferedScheme, bufferedTCP{transport.New("tcp")}); err != nil {
		panic(err)
	}
}

type bufferedTCP struct{ transport.Transport }

func (t bufferedTCP) Dial(ctx context.Context, d transport.Dialer, addr string) (net.Conn, error) {
	c, err := t.Transport.Dial(ctx, d, addr)
	if err != nil {
		return nil, err
	}
	deadline := time.Now().Add(handshakeTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d // a replay's timeout: zmq4's handshake does not watch ctx
	}
	return guard(c, defaultWire, deadline)
}

// buffered is a tcp:// endpoint on the buffered transport; other endpoints as they are.
func buffered(endpoint string) string {
	if rest, ok := strings.CutPrefix(endpoint, "tcp://"); ok {
		return bufferedScheme + "://" + rest
	}
	return endpoint
}

const (
	// maxMessage bounds a message's frames together. vLLM publishes one batch per engine step:
	// the blocks the step filled (at most --max-num-batched-tokens' tokens, 2048 to 16384 by
	// default) and, per request admitted, the prefix it found cached, token ids included (up
	// to 5 bytes each in msgpack). 16 MiB is 3.3 million token ids at 5 bytes: twice the
	// largest prompt the router itself takes (8 MiB bodies of JSON token ids, no shorter in
	// msgpack), or some 20 requests of a 128k-token cached prefix admitted in one step. zmq4
	// queues up to 12 messages a connection: one hostile engine can hold about 200 MiB of the
	// router, not all of it.
	maxMessage = 16 << 20
	// maxFrames bounds a message's frames: the publisher's are 3, the replay's 4.
	maxFrames = 16
	// maxCommand bounds a ZMTP command: a READY names the socket type and identity (at most
	// 255 bytes), a PING at most 16 bytes of context. It must fit the read buffer: a command is
	// checked whole before zmq4 reads it.
	maxCommand = 16 << 10
	readBuffer = 64 << 10
)

// handshakeTimeout bounds the greeting and READY: a peer that accepts and never greets held
// the follower for ever, its engine's index frozen while its pool stayed trusted (issue 56).
// stallTimeout bounds a message that started and stopped coming, likewise.
var handshakeTimeout, stallTimeout = 10 * time.Second, 10 * time.Second

// wireLimits are the bounds a connection holds its peer to; tests and the fuzz target shrink
// them.
type wireLimits struct{ message, frames, command int }

var defaultWire = wireLimits{message: maxMessage, frames: maxFrames, command: maxCommand}

// RefusedError is why a KV-events connection was refused: its peer wrote what no ZeroMQ
// publisher does, past a bound zmq4 does not keep.
type RefusedError struct{ Reason string }

func (e *RefusedError) Error() string { return "KV events peer refused: " + e.Reason }

func refuse(format string, args ...any) error {
	return &RefusedError{Reason: fmt.Sprintf(format, args...)}
}

// guard wraps c, which has just connected, the handshake to end by deadline. A connection zmq4
// has not taken up by then (read or written past the handshake) is closed: zmq4 drops the
// connection of a handshake it failed (a command it did not expect, say) without closing it,
// which left a descriptor open each time the follower dialled again (FuzzFollow).
func guard(c net.Conn, limits wireLimits, deadline time.Time) (net.Conn, error) {
	if err := c.SetDeadline(deadline); err != nil {
		c.Close()
		return nil, fmt.Errorf("set the ZMTP handshake's deadline: %w", err)
	}
	g := newWireConn(c, limits)
	time.AfterFunc(time.Until(deadline)+min(time.Second, handshakeTimeout), func() {
		if !g.adopted.Load() {
			c.Close()
		}
	})
	return g, nil
}

func newWireConn(c net.Conn, limits wireLimits) *guardedConn {
	return &guardedConn{Conn: c, r: bufio.NewReaderSize(c, readBuffer), limits: limits}
}

// guardedConn reads ZMTP 3.x (RFC 23) through a buffer and passes zmq4 only what it checked:
// the greeting; commands whole, with READY's properties inside it; message frames' headers,
// then their bodies as they come. The first thing past a bound is refused: the connection is
// closed and every later read returns the RefusedError, which zmq4 hands to the dial or to
// Recv. Writes, deadlines and closing are the connection's.
type guardedConn struct {
	net.Conn
	r      *bufio.Reader
	limits wireLimits

	// left is what zmq4 may still read of the unit checked last; body, a message frame's body
	// to pass once its header is read.
	left, body int
	greeted    bool
	// ready is set once the peer's READY was checked: the handshake is over.
	ready bool
	// frames and size count the message under way; inMessage is set between its frames.
	frames, size int
	inMessage    bool
	err          error
	// adopted is set once zmq4 reads or writes past the handshake: it runs the connection.
	adopted atomic.Bool
}

func (c *guardedConn) Read(p []byte) (int, error) {
	if c.ready && !c.adopted.Load() {
		c.adopted.Store(true)
	}
	if c.err != nil {
		return 0, c.err
	}
	if c.left == 0 {
		if err := c.next(); err != nil {
			return 0, c.fail(err)
		}
	}
	if len(p) > c.left {
		p = p[:c.left]
	}
	// Units but a message frame's body were peeked whole: a read that waits is mid-message.
	n, err := c.read(c.r.Buffered() == 0, false, func() (int, error) { return c.r.Read(p) })
	c.left -= n
	if err != nil {
		return n, c.fail(err)
	}
	return n, nil
}

// fail closes the connection if err refuses the peer or ends the handshake, and keeps err for
// every later read. zmq4 closes a connection whose messages fail, but not one whose handshake
// did (its dial returns the error and drops the connection): one left open each time the
// follower dialled again, a descriptor a second for as long as a peer hung up mid-handshake.
func (c *guardedConn) fail(err error) error {
	var refused *RefusedError
	if errors.As(err, &refused) || !c.ready {
		c.err = err
		c.Close()
	}
	return err
}

// Write is the connection's, but a write that fails in the handshake closes it (fail).
func (c *guardedConn) Write(p []byte) (int, error) {
	if c.ready && !c.adopted.Load() {
		c.adopted.Store(true)
	}
	n, err := c.Conn.Write(p)
	if err != nil && !c.ready {
		return n, c.fail(err)
	}
	return n, err
}

// read runs a read that waits for the peer if wait: past the handshake, what is not idle (a
// message's first header: the engine may have nothing to say) must keep coming. A timeout of
// the handshake's deadline or this one refuses the peer.
func (c *guardedConn) read(wait, idle bool, do func() (int, error)) (int, error) {
	stall := wait && c.ready && !idle
	if stall {
		if err := c.SetReadDeadline(time.Now().Add(stallTimeout)); err != nil {
			return 0, fmt.Errorf("set a message's deadline: %w", err)
		}
	}
	n, err := do()
	if stall && err == nil {
		if err := c.SetReadDeadline(time.Time{}); err != nil {
			return n, fmt.Errorf("clear a message's deadline: %w", err)
		}
	}
	var ne net.Error
	if err != nil && errors.As(err, &ne) && ne.Timeout() {
		if !c.ready {
			return n, refuse("no ZMTP handshake in time (%s at most)", handshakeTimeout)
		}
		return n, refuse("a message stalled for %s", stallTimeout)
	}
	return n, err
}

// peek is the next n bytes, waiting for them.
func (c *guardedConn) peek(n int, idle bool) ([]byte, error) {
	var b []byte
	_, err := c.read(c.r.Buffered() < n, idle, func() (int, error) {
		var err error
		b, err = c.r.Peek(n)
		return 0, err
	})
	return b, err
}

// ZMTP frame flags.
const (
	flagMore    = 1
	flagLong    = 2
	flagCommand = 4
)

// next checks the next unit of the stream and lets zmq4 read it.
func (c *guardedConn) next() error {
	if c.body > 0 {
		c.left, c.body = c.body, 0
		return nil
	}
	if !c.greeted {
		g, err := c.peek(64, false)
		if err != nil {
			return err
		}
		if err := checkGreeting(g); err != nil {
			return err
		}
		c.left, c.greeted = 64, true
		return nil
	}
	h, err := c.peek(2, !c.inMessage)
	if err != nil {
		return err
	}
	flags, size, n := h[0], uint64(h[1]), 2
	if flags&^(flagMore|flagLong|flagCommand) != 0 {
		return refuse("frame flags %#x: reserved bits set", flags)
	}
	if flags&flagLong != 0 {
		if h, err = c.peek(9, false); err != nil {
			return err
		}
		size, n = binary.BigEndian.Uint64(h[1:9]), 9
	}
	if flags&flagCommand != 0 {
		switch {
		case c.inMessage:
			return refuse("a command inside a message")
		case flags&flagMore != 0:
			return refuse("a command flagged more")
		case size > uint64(c.limits.command):
			return refuse("a command of %d bytes, past the cap of %d", size, c.limits.command)
		}
		f, err := c.peek(n+int(size), false)
		if err != nil {
			return err
		}
		ready, err := checkCommand(f[n:])
		if err != nil {
			return err
		}
		if ready && !c.ready {
			// The handshake is over: an engine may now be idle for as long as it likes.
			if err := c.SetDeadline(time.Time{}); err != nil {
				return fmt.Errorf("clear the ZMTP handshake's deadline: %w", err)
			}
			c.ready = true
		}
		c.left = n + int(size)
		return nil
	}
	if !c.ready {
		return refuse("a message before the peer's READY")
	}
	if c.frames++; c.frames > c.limits.frames {
		return refuse("a message of more than %d frames", c.limits.frames)
	}
	if size > uint64(c.limits.message-c.size) {
		return refuse("a frame of %d bytes after %d of its message, past the cap of %d", size, c.size, c.limits.message)
	}
	c.size += int(size)
	c.inMessage = flags&flagMore != 0
	if !c.inMessage {
		c.frames, c.size = 0, 0
	}
	c.left, c.body = n, int(size)
	return nil
}

// checkGreeting holds a greeting to ZMTP 3.x and the NULL mechanism, the framing next reads.
func checkGreeting(g []byte) error {
	switch {
	case g[0] != 0xff || g[9] != 0x7f:
		return refuse("not a ZMTP greeting")
	case g[10] != 3:
		return refuse("ZMTP version %d.%d, want 3.x", g[10], g[11])
	case strings.TrimRight(string(g[12:32]), "\x00") != "NULL":
		return refuse("security mechanism %q, want NULL", strings.TrimRight(string(g[12:32]), "\x00"))
	}
	return nil
}

// checkCommand checks a command's name and, for a READY, that its properties (name, 4-byte
// value length, value) end exactly at its end, which zmq4 assumes, and that it names a socket
// type zmq4 knows (it panicked on any other, FuzzWire found); it says whether it is a READY.
func checkCommand(b []byte) (ready bool, err error) {
	if len(b) == 0 || b[0] == 0 || int(b[0]) > len(b)-1 {
		return false, refuse("a command whose name is empty or runs past its end")
	}
	name, props := string(b[1:1+b[0]]), b[1+b[0]:]
	if name != "READY" {
		return false, nil
	}
	typed := false
	for len(props) > 0 {
		k := int(props[0])
		if k == 0 || 1+k+4 > len(props) {
			return false, refuse("a READY property whose name runs past the command's end")
		}
		v := binary.BigEndian.Uint32(props[1+k:])
		if uint64(v) > uint64(len(props)-(1+k+4)) {
			return false, refuse("a READY property whose value runs past the command's end")
		}
		key, value := string(props[1:1+k]), string(props[1+k+4:1+k+4+int(v)])
		// zmq4 title-cases names: any name that folds to Socket-Type (ſocket-type too) must be
		// it exactly, so the type zmq4 reads is one checked here.
		if strings.EqualFold(key, "Socket-Type") {
			if key != "Socket-Type" || !socketTypes[value] {
				return false, refuse("a READY of socket type %q (property %q)", value, key)
			}
			typed = true
		}
		props = props[1+k+4+int(v):]
	}
	if !typed {
		return false, refuse("a READY without a socket type")
	}
	return true, nil
}

// socketTypes are those zmq4.SocketType.IsCompatible knows.
var socketTypes = map[string]bool{"PAIR": true, "PUB": true, "SUB": true, "REQ": true, "REP": true, "DEALER": true,
	"ROUTER": true, "PULL": true, "PUSH": true, "XPUB": true, "XSUB": true}
