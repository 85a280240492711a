package kvevents

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"
)

// The wire reader passes exactly what it checked and refuses, with the reason, the first frame
// or handshake that breaks a bound: what reaches zmq4 is a greeting, READY commands whose
// properties fit, and messages within maxMessage bytes and maxFrames frames.
func TestWireRefuses(t *testing.T) {
	ready := zmtpReady("PUB")
	msg := concat(zmtpFrame(1, []byte("kv")), zmtpFrame(1, make([]byte, 8)), zmtpFrame(0, []byte{0x93}))
	for _, tc := range []struct {
		name string
		in   []byte
		// passed is how much of in reaches zmq4; err a part of the refusal, "" for none.
		passed int
		err    string
	}{
		{name: "a publisher's messages", in: concat(zmtpHello(), msg, msg), passed: -1},
		{name: "a message exactly the cap", in: concat(zmtpHello(), zmtpHeader(0, maxMessage)), passed: -1},
		{name: "a frame claiming 2^62", in: concat(zmtpHello(), zmtpHeader(0, 1<<62)), passed: len(zmtpHello()), err: "past the cap"},
		{name: "a frame claiming 2^64-1", in: concat(zmtpHello(), zmtpHeader(0, 1<<64-1)), passed: len(zmtpHello()), err: "past the cap"},
		{name: "frames summing past the cap", in: concat(zmtpHello(), zmtpFrame(1, make([]byte, 300)), zmtpHeader(0, maxMessage-299)),
			passed: len(zmtpHello()) + 9 + 300, err: "past the cap"},
		{name: "too many frames", in: concat(zmtpHello(), bytes.Repeat(zmtpFrame(1, nil), maxFrames+1)),
			passed: len(zmtpHello()) + 2*maxFrames, err: "frames"},
		{name: "not a ZMTP greeting", in: concat([]byte("GET / HTTP/1.1\r\n"), make([]byte, 64)), err: "greeting"},
		{name: "ZMTP 2", in: concat(zmtpGreeting()[:10], []byte{1}, make([]byte, 53)), err: "version"},
		{name: "a mechanism not NULL", in: concat(zmtpGreeting()[:12], []byte("CURVE"), make([]byte, 47)), err: "mechanism"},
		{name: "READY property name past its end", in: concat(zmtpGreeting(), zmtpFrame(4, []byte("\x05READY\x04abc"))), passed: 64, err: "property"},
		{name: "READY property without its value length", in: concat(zmtpGreeting(), zmtpFrame(4, []byte("\x05READY\x01a"))), passed: 64, err: "property"},
		{name: "READY property value past its end", in: concat(zmtpGreeting(), zmtpFrame(4, []byte("\x05READY\x01a\x00\x00\x00\x09x"))), passed: 64, err: "property"},
		{name: "READY without a socket type", in: concat(zmtpGreeting(), zmtpFrame(4, []byte("\x05READY"))), passed: 64, err: "socket type"},
		{name: "READY of an unknown socket type", in: concat(zmtpGreeting(), zmtpReady("FOO")), passed: 64, err: "socket type"},
		{name: "READY of a socket type zmq4 reads under another name", in: concat(zmtpGreeting(), zmtpFrame(4, []byte("\x05READY\x0bSOCKET-TYPE\x00\x00\x00\x03PUB"))), passed: 64, err: "socket type"},
		{name: "a replay's ROUTER and other commands", in: concat(zmtpGreeting(), zmtpReady("ROUTER"), zmtpFrame(4, []byte("\x04PING\x00\x01")), msg), passed: -1},
		{name: "a command name past its end", in: concat(zmtpGreeting(), zmtpFrame(4, []byte("\x09READY"))), passed: 64, err: "name"},
		{name: "an empty command", in: concat(zmtpGreeting(), zmtpFrame(4, nil)), passed: 64, err: "name"},
		{name: "a command with more", in: concat(zmtpGreeting(), zmtpFrame(5, []byte("\x05READY"))), passed: 64, err: "more"},
		{name: "a command past its cap", in: concat(zmtpGreeting(), zmtpHeader(4, maxCommand+1)), passed: 64, err: "command"},
		{name: "a message before READY", in: concat(zmtpGreeting(), msg), passed: 64, err: "before"},
		{name: "reserved flags", in: concat(zmtpHello(), zmtpFrame(8, nil)), passed: len(zmtpHello()), err: "flags"},
		{name: "a command inside a message", in: concat(zmtpHello(), zmtpFrame(1, nil), ready), passed: len(zmtpHello()) + 2, err: "inside a message"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.passed < 0 {
				tc.passed = len(tc.in)
			}
			c := newWireConn(&pipeConn{r: bytes.NewReader(tc.in)}, defaultWire)
			got, err := io.ReadAll(c)
			var refused *RefusedError
			switch {
			case tc.err == "" && err != nil:
				t.Errorf("refused: %v", err)
			case tc.err != "" && (!errors.As(err, &refused) || !strings.Contains(err.Error(), tc.err)):
				t.Errorf("error %v, want a refusal saying %q", err, tc.err)
			}
			if len(got) != tc.passed || !bytes.Equal(got, tc.in[:tc.passed]) {
				t.Errorf("passed %d bytes, want the first %d of %d", len(got), tc.passed, len(tc.in))
			}
		})
	}
}

// A peer that greets and then goes quiet mid-handshake, or mid-message, is refused after the
// timeout; one that goes quiet between messages (an idle engine) is not.
func TestWireTimesOut(t *testing.T) {
	old, oldStall := handshakeTimeout, stallTimeout
	handshakeTimeout, stallTimeout = 200*time.Millisecond, 200*time.Millisecond
	t.Cleanup(func() { handshakeTimeout, stallTimeout = old, oldStall })
	msg := concat(zmtpFrame(1, []byte("kv")), zmtpFrame(1, make([]byte, 8)), zmtpFrame(0, []byte{0x93}))
	for _, tc := range []struct {
		name string
		sent []byte
		err  string
	}{
		{name: "never greets", err: "handshake"},
		{name: "greets, no READY", sent: zmtpGreeting(), err: "handshake"},
		{name: "half a READY", sent: concat(zmtpGreeting(), zmtpReady("PUB")[:5]), err: "handshake"},
		{name: "mid-message", sent: concat(zmtpHello(), msg[:10]), err: "stalled"},
		{name: "between messages", sent: concat(zmtpHello(), msg)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			near, far := net.Pipe()
			t.Cleanup(func() { near.Close(); far.Close() })
			go func() { _, _ = far.Write(tc.sent) }()
			c, err := guard(near, defaultWire, time.Now().Add(handshakeTimeout))
			if err != nil {
				t.Fatal(err)
			}
			got := make(chan error, 1)
			go func() { _, err := io.Copy(io.Discard, c); got <- err }()
			select {
			case err := <-got:
				var refused *RefusedError
				if tc.err == "" || !errors.As(err, &refused) || !strings.Contains(err.Error(), tc.err) {
					t.Errorf("error %v, want a refusal saying %q", err, tc.err)
				}
			case <-time.After(2 * time.Second):
				if tc.err != "" {
					t.Errorf("not refused in 2s")
				}
			}
		})
	}
}

// pipeConn is a net.Conn that reads r and discards what is written.
type pipeConn struct {
	r io.Reader
	net.Conn
}

func (c *pipeConn) Read(p []byte) (int, error)       { return c.r.Read(p) }
func (c *pipeConn) Write(p []byte) (int, error)      { return len(p), nil }
func (c *pipeConn) Close() error                     { return nil }
func (c *pipeConn) SetDeadline(time.Time) error      { return nil }
func (c *pipeConn) SetReadDeadline(time.Time) error  { return nil }
func (c *pipeConn) SetWriteDeadline(time.Time) error { return nil }
func (c *pipeConn) LocalAddr() net.Addr              { return &net.TCPAddr{} }
func (c *pipeConn) RemoteAddr() net.Addr             { return &net.TCPAddr{} }
func (c *pipeConn) String() string                   { return fmt.Sprintf("pipe %p", c) }

var _ net.Conn = (*pipeConn)(nil)

// FuzzWire feeds a peer's bytes through the wire reader to zmq4's own handshake and message
// reading, as a subscriber's connection does: whatever the reader passes must not panic zmq4
// (issue 56: a frame's claimed size went to make, a READY's property past its end to a slice),
// and every message zmq4 returns is within the bounds. The limits are shrunk so that a claimed
// size zmq4 allocates stays cheap.
func FuzzWire(f *testing.F) {
	msg := concat(zmtpFrame(1, []byte("kv")), zmtpFrame(1, make([]byte, 8)), zmtpFrame(0, []byte{0x93, 1, 0x90, 0}))
	for _, seed := range [][]byte{
		concat(zmtpHello(), msg, msg),
		concat(zmtpHello(), zmtpHeader(0, 1<<62)),
		concat(zmtpHello(), zmtpHeader(0, 1<<30)),
		concat(zmtpHello(), zmtpHeader(0, maxMessage+1)),
		concat(zmtpHello(), bytes.Repeat(zmtpFrame(1, nil), maxFrames+1)),
		concat(zmtpGreeting(), zmtpFrame(4, []byte("\x05READY\x04abc"))),
		concat(zmtpGreeting(), zmtpFrame(4, []byte("\x05READY\x01a"))),
		concat(zmtpGreeting(), zmtpFrame(4, []byte("\x05READY\x01a\x00\x00\x00\x09x"))),
		concat(zmtpHello(), zmtpFrame(4, []byte("\x04PING\x00\x01ctx")), msg),
		concat(zmtpGreeting(), zmtpReady("XPUB"), msg),
	} {
		f.Add(seed)
	}
	limits := wireLimits{message: 4 << 10, frames: maxFrames, command: 1 << 10}
	f.Fuzz(func(t *testing.T, in []byte) {
		passed, err := io.ReadAll(newWireConn(&pipeConn{r: bytes.NewReader(in)}, limits))
		var refused *RefusedError
		if err != nil && !errors.As(err, &refused) {
			t.Fatalf("read error %v, want a refusal or none", err)
		}
		if !bytes.HasPrefix(in, passed) {
			t.Fatalf("passed %d bytes that are not the input's first", len(passed))
		}
		c, err := zmq4.Open(newWireConn(&pipeConn{r: bytes.NewReader(in)}, limits), null.Security(), zmq4.Sub, nil, false, nil)
		if err != nil {
			return
		}
		for {
			m, err := c.RecvMsg()
			if err != nil {
				return
			}
			size := 0
			for _, fr := range m.Frames {
				size += len(fr)
			}
			if size > limits.message || len(m.Frames) > limits.frames {
				t.Fatalf("a message of %d bytes in %d frames passed", size, len(m.Frames))
			}
		}
	})
}
