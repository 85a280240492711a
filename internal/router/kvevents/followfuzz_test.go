package kvevents

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"net"
	"testing"
	"time"

	"github.com/go-logr/logr"
)

// followFuzzBlocks bounds the fuzzed follower's index (per engine and rank, and in all).
const followFuzzBlocks = 64

// FuzzFollow is issue 56's fuzz of the KV-event wire from the socket up: each input is what a
// hostile publisher on loopback writes to a real Follower, the ZMTP handshake made for it (the
// first byte even) or written by the input itself (odd), then the connection half-closed.
// Whatever it writes, the follower must neither die (a panic in zmq4's goroutines or in ours
// ends the fuzz process) nor recover a panic (each is a bug: a check none foresaw), must close
// the connection (it never waits for ever: the handshake and a stalled message are bounded),
// and its index stays within its bounds. `make fuzz` runs it in CI's fuzz budget.
func FuzzFollow(f *testing.F) {
	msg := func(seq uint64, payload []byte) []byte {
		return concat(zmtpFrame(1, []byte("kv")), zmtpFrame(1, binary.BigEndian.AppendUint64(nil, seq)), zmtpFrame(0, payload))
	}
	s := batch(f, 0, stored([]any{1, 2}, nil, tokens(0, 8), 4))
	s2 := batch(f, 0, stored([]any{3}, 2, tokens(8, 4), 4), map[string]any{"type": "BlockRemoved", "block_hashes": []any{1}, "medium": "GPU"})
	wrap := batch(f, 0, stored([]any{1, 2, 3, 4}, nil, nil, 1<<62))
	cleared := batch(f, 0, map[string]any{"type": "AllBlocksCleared"})
	for _, seed := range [][]byte{
		concat([]byte{0}, msg(0, s), msg(1, s2)),
		concat([]byte{0}, msg(0, s), msg(5, s2), msg(2, cleared)),
		concat([]byte{0}, msg(0, wrap)),
		concat([]byte{0}, msg(0, bytes.Repeat([]byte{0x91}, 4096))),
		concat([]byte{0}, zmtpHeader(0, 1<<62)),
		concat([]byte{1}, zmtpHello(), msg(0, s)),
		concat([]byte{1}, zmtpGreeting(), zmtpFrame(4, []byte("\x05READY\x04abc"))),
		{1},
	} {
		f.Add(seed)
	}
	oldHandshake, oldStall := handshakeTimeout, stallTimeout
	handshakeTimeout, stallTimeout = 200*time.Millisecond, 200*time.Millisecond
	defer func() { handshakeTimeout, stallTimeout = oldHandshake, oldStall }()
	// One listener for every input (a fuzz worker runs them one at a time), and connections
	// reset rather than closed: thousands of inputs a second would otherwise leave as many
	// sockets in TIME_WAIT and run out of loopback ports.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		f.Fatal(err)
	}
	defer l.Close()
	f.Fuzz(func(t *testing.T, in []byte) {
		if len(in) == 0 {
			return
		}
		// served says how the connection ended: nil when the follower closed it.
		served := make(chan error, 1)
		go func() {
			c, err := l.Accept()
			if err != nil {
				served <- err
				return
			}
			defer c.Close()
			_ = c.(*net.TCPConn).SetLinger(0)
			if in[0]%2 == 0 {
				_, _ = c.Write(zmtpHello())
			}
			_, _ = c.Write(in[1:])
			_ = c.(*net.TCPConn).CloseWrite()
			// Until the follower closes its side (within the fuzz engine's 10 s an input).
			_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
			_, err = io.Copy(io.Discard, c)
			served <- err
		}()
		fl := &Follower{Index: NewIndex(followFuzzBlocks, followFuzzBlocks), Topic: "kv", Log: logr.Discard()}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); fl.Follow(ctx, Source{Engine: "e", Endpoint: "tcp://" + l.Addr().String()}) }()
		if err := <-served; err != nil {
			t.Errorf("the follower did not close the connection: %v", err)
		}
		st := fl.Streams()["e"]
		size := fl.Index.Size()
		cancel()
		<-done
		if st.Panics > 0 {
			t.Errorf("%d batches panicked (recovered): a check none foresaw", st.Panics)
		}
		if size > followFuzzBlocks {
			t.Errorf("the index holds %d blocks, bound %d", size, followFuzzBlocks)
		}
	})
}
