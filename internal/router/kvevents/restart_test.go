package kvevents

import (
	"context"
	"encoding/binary"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"
	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"
)

// standIn publishes as vLLM's ZmqEventPublisher does, sequence and replay buffer included, for
// what vLLM's own cannot be made to do: restart in place without the connection dropping.
type standIn struct {
	pub, replay zmq4.Socket
	mu          sync.Mutex
	seq         uint64
	buffer      [][2][]byte // sequence, payload
}

func startStandIn(t *testing.T) (*standIn, string, string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	p := &standIn{pub: zmq4.NewPub(ctx), replay: zmq4.NewRouter(ctx)}
	addr := func() string {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		return "tcp://127.0.0.1:" + strconv.Itoa(l.Addr().(*net.TCPAddr).Port)
	}
	pubAt, replayAt := addr(), addr()
	if err := p.pub.Listen(pubAt); err != nil {
		t.Fatal(err)
	}
	if err := p.replay.Listen(replayAt); err != nil {
		t.Fatal(err)
	}
	go func() {
		for {
			msg, err := p.replay.Recv()
			if err != nil || len(msg.Frames) != 3 {
				return
			}
			from := binary.BigEndian.Uint64(msg.Frames[2])
			p.mu.Lock()
			for _, b := range p.buffer {
				if binary.BigEndian.Uint64(b[0]) >= from {
					_ = p.replay.SendMulti(zmq4.NewMsgFrom(msg.Frames[0], []byte{}, []byte("kv"), b[0], b[1]))
				}
			}
			p.mu.Unlock()
			end := make([]byte, 8)
			binary.BigEndian.PutUint64(end, endSeq)
			_ = p.replay.SendMulti(zmq4.NewMsgFrom(msg.Frames[0], []byte{}, []byte{}, end, []byte{}))
		}
	}()
	return p, pubAt, replayAt
}

// store publishes one block of tokens, as the first block of a prompt.
func (p *standIn) store(t *testing.T, hash uint64, tokens []uint32) {
	t.Helper()
	ids := make([]any, len(tokens))
	for i, tok := range tokens {
		ids[i] = tok
	}
	event := map[string]any{"type": "BlockStored", "block_hashes": []any{hash}, "parent_block_hash": nil, "token_ids": ids, "block_size": len(tokens), "medium": "GPU"}
	payload, err := msgpack.Marshal([]any{1.0, []any{event}})
	if err != nil {
		t.Fatal(err)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	seq := make([]byte, 8)
	binary.BigEndian.PutUint64(seq, p.seq)
	p.seq++
	p.buffer = append(p.buffer, [2][]byte{seq, payload})
	if err := p.pub.SendMulti(zmq4.NewMsgFrom([]byte("kv"), seq, payload)); err != nil {
		t.Fatal(err)
	}
}

// restart is a new engine process on the same sockets: its sequence from 0, its buffer empty.
func (p *standIn) restart() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.seq, p.buffer = 0, nil
}

// An engine restarted while the subscriber stayed connected, whose first batch is numbered
// inside what the subscriber's replay applied: past the moment duplicates of the replay can
// arrive, that is a new process, and what the old one held is dropped.
func TestARestartInsideTheReplayedSpanIsARestart(t *testing.T) {
	old := dupWindow
	dupWindow = 200 * time.Millisecond
	t.Cleanup(func() { dupWindow = old })
	p, pubAt, replayAt := startStandIn(t)
	p.store(t, 1, tokens(0, 4))
	p.store(t, 2, tokens(10, 4))
	f := &Follower{Index: NewIndex(0), Topic: "kv", Log: testr.New(t)}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); f.Follow(ctx, Source{Engine: "e", Endpoint: pubAt, Replay: replayAt}) }()
	t.Cleanup(func() { cancel(); <-done })
	holds := func(ts []uint32) bool {
		m := make([]int, 1)
		f.Index.Match(Hashes(ts, 4), func(int) string { return "e" }, m)
		return m[0] == 1
	}
	wait := func(what string, ok func() bool) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); !ok(); time.Sleep(20 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: streams %+v", what, f.Streams())
			}
		}
	}
	wait("the replayed history", func() bool { return holds(tokens(0, 4)) && holds(tokens(10, 4)) })
	time.Sleep(2 * dupWindow)
	p.restart()
	// The subscriber is connected: it gets the new process's first batch, sequence 0.
	p.store(t, 3, tokens(20, 4))
	wait("the new process's block, the old ones dropped", func() bool {
		return holds(tokens(20, 4)) && !holds(tokens(0, 4)) && !holds(tokens(10, 4))
	})
	if s := f.Streams()["e"]; s.Restarts != 1 {
		t.Errorf("stream %+v: want 1 restart", s)
	}
}
