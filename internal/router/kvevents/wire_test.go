package kvevents

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"
)

// zmtpGreeting is a ZMTP 3.0 greeting with the NULL mechanism, as a publisher (or any peer)
// sends it.
func zmtpGreeting() []byte {
	g := make([]byte, 64)
	g[0], g[8], g[9], g[10], g[11] = 0xff, 1, 0x7f, 3, 0
	copy(g[12:], "NULL")
	return g
}

// zmtpFrame is one frame: flags (more, command; long added as the size needs) and body.
func zmtpFrame(flags byte, body []byte) []byte {
	if len(body) > 255 {
		h := make([]byte, 9, 9+len(body))
		h[0] = flags | 2
		binary.BigEndian.PutUint64(h[1:], uint64(len(body)))
		return append(h, body...)
	}
	return append([]byte{flags, byte(len(body))}, body...)
}

// zmtpHeader is a frame's header alone, claiming size bytes.
func zmtpHeader(flags byte, size uint64) []byte {
	h := make([]byte, 9)
	h[0] = flags | 2
	binary.BigEndian.PutUint64(h[1:], size)
	return h
}

// zmtpReady is a READY command naming socket type typ.
func zmtpReady(typ string) []byte {
	body := append([]byte{5}, "READY"...)
	body = append(body, 11)
	body = append(body, "Socket-Type"...)
	body = binary.BigEndian.AppendUint32(body, uint32(len(typ)))
	return zmtpFrame(4, append(body, typ...))
}

// A publisher's greeting and READY, as a PUB socket sends them.
func zmtpHello() []byte { return append(zmtpGreeting(), zmtpReady("PUB")...) }

func concat(bs ...[]byte) []byte { return bytes.Join(bs, nil) }

// hostileWire is what issue 56's hostile KV-events publisher writes once a follower connects:
// each case must end with the follower refusing the connection, not with the router dead (a
// panic in zmq4's goroutines or the dial, where no recover reaches), its memory taken, or the
// follower blocked for ever.
var hostileWire = []struct {
	name string
	// greet is false for a peer that accepts and never greets; then is written after the
	// greeting, body zero bytes after it, and after last.
	greet bool
	then  []byte
	body  int
	after []byte
}{
	{name: "frame-claims-2^62", greet: true, then: concat(zmtpReady("PUB"), zmtpHeader(0, 1<<62))},
	{name: "frame-claims-1GiB", greet: true, then: concat(zmtpReady("PUB"), zmtpHeader(0, 1<<30))},
	{name: "frame-one-past-the-cap", greet: true, then: concat(zmtpReady("PUB"), zmtpHeader(0, maxMessage+1)), body: 1 << 20},
	{name: "frames-sum-past-the-cap", greet: true, then: concat(zmtpReady("PUB"), zmtpFrame(1, []byte("kv")),
		zmtpHeader(1, maxMessage-2)), body: maxMessage - 2, after: zmtpFrame(0, []byte{1})},
	{name: "too-many-frames", greet: true, then: concat(zmtpReady("PUB"), bytes.Repeat(zmtpFrame(1, nil), maxFrames+1))},
	{name: "ready-property-name-past-its-end", greet: true, then: zmtpFrame(4, []byte("\x05READY\x04abc"))},
	{name: "ready-property-without-value-length", greet: true, then: zmtpFrame(4, []byte("\x05READY\x01a"))},
	{name: "ready-property-value-past-its-end", greet: true, then: zmtpFrame(4, []byte("\x05READY\x01a\x00\x00\x00\x09x"))},
	{name: "ready-without-socket-type", greet: true, then: zmtpFrame(4, []byte("\x05READY"))},
	{name: "ready-unknown-socket-type", greet: true, then: zmtpReady("FOO")},
	{name: "ready-socket-type-not-title-case", greet: true, then: concat(zmtpFrame(4, []byte("\x05READY\x0bSOCKET-TYPE\x00\x00\x00\x03PUB")))},
	{name: "never-greets"},
}

// hostileEnv names the case a child test binary runs.
const hostileEnv = "PDCLUSTER_KV_HOSTILE_WIRE"

// Each of issue 56's hostile wires, against the real Follower, in a child test binary of its
// own: on the old code some killed the process (zmq4's makeslice of 2^62 bytes in its reader
// goroutine, Property.Write's slice past a READY's end in the dial), which would take every
// other test with it, and the rest were accepted (the claimed size allocated and waited for,
// the frames passed on) or blocked the dial for ever. Each must be refused: the follower closes
// the connection and counts it.
func TestFollowRefusesHostileWire(t *testing.T) {
	if name := os.Getenv(hostileEnv); name != "" {
		for _, tc := range hostileWire {
			if tc.name == name {
				followHostile(t, tc.greet, tc.then, tc.body, tc.after)
				return
			}
		}
		t.Fatalf("no case %q", name)
	}
	for _, tc := range hostileWire {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestFollowRefusesHostileWire$", "-test.v")
			cmd.Env = append(os.Environ(), hostileEnv+"="+tc.name)
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Errorf("the follower did not survive and refuse it (%v):\n%s", err, tail(out, 40))
			}
		})
	}
}

func tail(out []byte, lines int) string {
	ls := strings.Split(strings.TrimSpace(string(out)), "\n")
	return strings.Join(ls[max(0, len(ls)-lines):], "\n")
}

// followHostile follows a publisher on loopback that writes a greeting (if greet), then then,
// body zero bytes and after, and waits for the follower to refuse it: the peer sees its connection
// closed and the follower counts a refusal.
func followHostile(t *testing.T, greet bool, then []byte, body int, after []byte) {
	old := handshakeTimeout
	handshakeTimeout = 500 * time.Millisecond
	t.Cleanup(func() { handshakeTimeout = old })
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	var closed atomic.Int32
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				if greet {
					_, _ = c.Write(zmtpGreeting())
					_, _ = c.Write(then)
					_, _ = c.Write(make([]byte, body))
					_, _ = c.Write(after)
				}
				// The follower closing the connection ends this.
				_, _ = io.Copy(io.Discard, c)
				closed.Add(1)
			}()
		}
	}()
	f := &Follower{Index: NewIndex(0, 0), Topic: "kv", Log: testr.New(t)}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); f.Follow(ctx, Source{Engine: "e", Endpoint: "tcp://" + l.Addr().String()}) }()
	t.Cleanup(func() { cancel(); <-done })
	waitFor(t, f, "the connection refused and counted", func() bool {
		s := f.Streams()["e"]
		return closed.Load() > 0 && s.Refused > 0 && !s.Connected && !f.Trusted([][]string{{"e"}}, time.Now(), time.Minute)
	})
}

// A replay socket that accepts and never greets: the follower asks it at every (re)connection,
// and on the old code its dial waited for the greeting for ever, ReplayTimeout or not, so the
// follower applied nothing more. Now the handshake ends with the replay's timeout and live
// batches are applied.
func TestFollowSurvivesAReplayThatNeverGreets(t *testing.T) {
	p, pubAt, _ := startStandIn(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() { defer c.Close(); _, _ = io.Copy(io.Discard, c) }()
		}
	}()
	f := &Follower{Index: NewIndex(0, 0), Topic: "kv", Log: testr.New(t), ReplayTimeout: 300 * time.Millisecond}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		f.Follow(ctx, Source{Engine: "e", Endpoint: pubAt, Replay: "tcp://" + l.Addr().String()})
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Error("Follow did not return: blocked in a dial")
		}
	})
	waitFor(t, f, "a live batch past the silent replay", func() bool {
		store(t, p, 1, tokens(0, 4))
		return holds(f, tokens(0, 4))
	})
}
