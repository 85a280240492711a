package kvevents

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"runtime/debug"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-zeromq/zmq4"

	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// Source is one engine's publisher, as --kv-events-config binds it: the PUB endpoint and the
// ROUTER endpoint that replays its recent batches.
type Source struct {
	// Engine is the engine's URL: the index's key for what it holds.
	Engine string
	// Endpoint is the publisher, tcp://host:port.
	Endpoint string
	// Replay is the publisher's replay endpoint, tcp://host:port; "" when it has none.
	Replay string
}

// Stream is what a Follow call reports of its source, for metrics and for the router to know
// whether the engine's index can be trusted.
type Stream struct {
	// Batches and Events applied, and BlocksOrphaned: stored blocks skipped for a parent the
	// index never saw.
	Batches, Events, BlocksOrphaned int
	// Gaps are sequence gaps seen; Lost the gaps replay could not fill; Restarts the times the
	// publisher's sequence went back (a new engine process); Reconnects the connections lost;
	// Panics the batches whose decoding or applying panicked (each dropped the index, as a
	// loss does); Refused the connections refused for what the publisher wrote (a frame past
	// the cap, a malformed handshake, none in time: RefusedError), each a loss too.
	Gaps, Lost, Restarts, Reconnects, Panics, Refused int
	// LastEvent is when the last batch arrived; LastLoss when events were last lost.
	LastEvent, LastLoss time.Time
	// Lag is how long the last batch took from the engine to the index.
	Lag time.Duration
	// Connected is set while the subscriber is connected to the publisher.
	Connected bool
}

// Follower keeps an Index up to date from engines' publishers.
type Follower struct {
	Index *Index
	// Topic is the publishers' topic ("" for all).
	Topic string
	Log   logr.Logger
	// ReplayTimeout bounds one replay request.
	ReplayTimeout time.Duration

	mu      sync.Mutex
	streams map[string]*Stream
}

// Streams is a copy of what each followed engine's stream reported.
func (f *Follower) Streams() map[string]Stream {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make(map[string]Stream, len(f.streams))
	for k, v := range f.streams {
		out[k] = *v
	}
	return out
}

// Trusted is whether every one of engines is connected and lost no events in the last window
// before now: what its index says of it is then current.
func (f *Follower) Trusted(engines [][]string, now time.Time, window time.Duration) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, es := range engines {
		for _, e := range es {
			s := f.streams[e]
			if s == nil || !s.Connected || now.Sub(s.LastLoss) < window {
				return false
			}
		}
	}
	return true
}

func (f *Follower) update(engine string, do func(*Stream)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.streams == nil {
		f.streams = map[string]*Stream{}
	}
	s := f.streams[engine]
	if s == nil {
		s = &Stream{}
		f.streams[engine] = s
	}
	do(s)
}

// dupWindow is how long after a replay a live batch it applied may still arrive.
var dupWindow = 5 * time.Second

// endSeq is the sequence number that ends a replay (-1, two's complement).
const endSeq = 1<<64 - 1

// Follow subscribes to src until ctx ends, then forgets the engine. It first replays what the
// publisher still buffers (what the engine cached before the router listened), applies batches
// in sequence order, replays a gap, drops the engine's index when its sequence goes back (the
// engine restarted: its cache is new), and drops it when a gap cannot be replayed (the index
// would keep blocks the engine evicted). Malformed batches are logged and skipped.
func (f *Follower) Follow(ctx context.Context, src Source) {
	log := f.Log.WithValues("engine", src.Engine, "endpoint", src.Endpoint)
	defer func() {
		f.Index.Drop(src.Engine)
		f.mu.Lock()
		delete(f.streams, src.Engine)
		f.mu.Unlock()
	}()
	var sq sequence
	sq.reset()
	catchUp := func(from uint64) {
		// Fresh: whatever the buffer still holds (the engine may have run long before the
		// router listened); from a gap: that gap exactly.
		first, last, applied := f.replay(ctx, src, from, sq.fresh, log)
		if applied > 0 {
			sq.replayedSpan(first, last, time.Now())
		}
	}
	for connected := false; ctx.Err() == nil; connected = true {
		if connected {
			// The connection dropped: the engine likely restarted, and what was published
			// meanwhile is unknown. Start over from what its publisher buffers.
			log.Info("KV events connection lost: the engine's index is dropped and rebuilt from the publisher's replay")
			f.Index.Drop(src.Engine)
			f.update(src.Engine, func(s *Stream) { s.Reconnects++ })
			sq.reset()
			select {
			case <-ctx.Done():
				return
			case <-time.After(time.Second):
			}
		}
		f.receive(ctx, src, log, func(sub zmq4.Socket) {
			catchUp(0)
			for {
				msg, err := sub.Recv()
				if err != nil {
					if f.refused(src.Engine, err, log) {
						return
					}
					if ctx.Err() == nil {
						log.V(1).Info("KV events receive ended", "error", err.Error())
					}
					return
				}
				seq, payload, err := frames(msg, f.Topic)
				if err != nil {
					log.Error(err, "skip a malformed message")
					continue
				}
				switch sq.classify(seq, time.Now()) {
				case seqDuplicate:
					continue // applied by the replay
				case seqRestarted:
					log.Info("KV events sequence went back: the engine restarted, its index is dropped", "sequence", seq, "expected", sq.next)
					f.Index.Drop(src.Engine)
					f.update(src.Engine, func(s *Stream) { s.Restarts++ })
					sq.reset()
					if seq > 0 {
						catchUp(0) // what the new process published before this batch
					}
					if sq.classify(seq, time.Now()) != seqInOrder {
						continue // the replay applied it
					}
				case seqGap:
					f.update(src.Engine, func(s *Stream) { s.Gaps++ })
					catchUp(sq.next)
					switch sq.classify(seq, time.Now()) {
					case seqGap:
						log.Info("KV events lost past the publisher's replay buffer: the engine's index is dropped", "from", sq.next, "to", seq-1)
						f.Index.Drop(src.Engine)
						f.update(src.Engine, func(s *Stream) { s.Lost++; s.LastLoss = time.Now() })
					case seqInOrder:
					default:
						continue // the replay applied it
					}
				}
				f.apply(src.Engine, payload, log)
				sq.applied(seq)
			}
		})
	}
}

// sequence is what Follow knows of a publisher's batch numbers.
type sequence struct {
	// next is the number the next batch should have.
	next uint64
	// fresh is set until a batch was applied since the subscriber (re)connected: the first
	// batch then starts the sequence, whatever its number (the publisher may have sent many
	// before, and no longer buffer them).
	fresh bool
	// replayed is the span the last replay applied, until a live batch past it: live batches
	// in it are duplicates (the subscriber got them too while the replay ran) until dupWindow
	// passed; after that a batch numbered inside it is a new publisher's (an engine restarts
	// in tens of seconds at the least).
	replayed                 bool
	replayedFrom, replayedTo uint64
	replayedAt               time.Time
}

// seqVerdict is what a live batch's number says.
type seqVerdict int

const (
	seqInOrder   seqVerdict = iota // apply it
	seqDuplicate                   // a replay applied it
	seqRestarted                   // the number went back: a new engine process
	seqGap                         // batches before it are missing
)

func (s *sequence) reset() { *s = sequence{fresh: true} }

// classify is what batch seq means, now.
func (s *sequence) classify(seq uint64, now time.Time) seqVerdict {
	next := s.next
	if s.fresh {
		next = seq
	}
	switch {
	case seq < next && s.replayed && seq >= s.replayedFrom && seq <= s.replayedTo && now.Sub(s.replayedAt) < dupWindow:
		return seqDuplicate
	case seq < next:
		return seqRestarted
	case seq > next:
		return seqGap
	}
	return seqInOrder
}

// applied records that batch seq was applied (live, or past a gap the replay could not fill).
func (s *sequence) applied(seq uint64) {
	s.next, s.fresh, s.replayed = seq+1, false, false
}

// replayedSpan records that a replay applied batches first to last at now.
func (s *sequence) replayedSpan(first, last uint64, now time.Time) {
	s.next, s.fresh = last+1, false
	s.replayed, s.replayedFrom, s.replayedTo, s.replayedAt = true, first, last, now
}

// receive connects a subscriber to src's publisher (retrying until ctx ends) and runs loop on
// it until loop returns.
func (f *Follower) receive(ctx context.Context, src Source, log logr.Logger, loop func(zmq4.Socket)) {
	sub := zmq4.NewSub(ctx, zmq4.WithDialerMaxRetries(-1), zmq4.WithDialerRetry(time.Second))
	defer sub.Close()
	if err := sub.SetOption(zmq4.OptionSubscribe, f.Topic); err != nil {
		log.Error(err, "subscribe")
		return
	}
	if err := sub.Dial(buffered(src.Endpoint)); err != nil {
		if f.refused(src.Engine, err, log) {
			return
		}
		if ctx.Err() == nil {
			log.Error(err, "dial the KV events publisher")
		}
		return
	}
	f.update(src.Engine, func(s *Stream) { s.Connected = true })
	defer f.update(src.Engine, func(s *Stream) { s.Connected = false })
	loop(sub)
}

// replay asks src's replay endpoint for the batches from from on (or, orLater, from the oldest
// it still holds) and applies them in sequence, reporting the first and last sequence applied
// and how many.
func (f *Follower) replay(ctx context.Context, src Source, from uint64, orLater bool, log logr.Logger) (first, last uint64, applied int) {
	if src.Replay == "" {
		return 0, 0, 0
	}
	timeout := f.ReplayTimeout
	if timeout <= 0 {
		timeout = 5 * time.Second
	}
	rctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	dealer := zmq4.NewDealer(rctx, zmq4.WithDialerMaxRetries(0))
	defer dealer.Close()
	if err := dealer.Dial(buffered(src.Replay)); err != nil {
		if !f.refused(src.Engine, err, log) {
			log.V(1).Info("KV events replay unavailable", "error", err.Error())
		}
		return 0, 0, 0
	}
	var req [8]byte
	binary.BigEndian.PutUint64(req[:], from)
	if err := dealer.SendMulti(zmq4.NewMsgFrom([]byte{}, req[:])); err != nil {
		log.V(1).Info("KV events replay request failed", "error", err.Error())
		return 0, 0, 0
	}
	want := from
	for {
		msg, err := dealer.Recv()
		if err != nil {
			if !f.refused(src.Engine, err, log) {
				log.V(1).Info("KV events replay ended early", "error", err.Error())
			}
			return first, last, applied
		}
		// [empty, topic, seq, payload]
		if len(msg.Frames) != 4 || len(msg.Frames[0]) != 0 {
			log.Error(fmt.Errorf("%d frames", len(msg.Frames)), "skip a malformed replay message")
			continue
		}
		seq, payload, err := frames(zmq4.NewMsgFrom(msg.Frames[1:]...), f.Topic)
		if err == nil && seq == endSeq {
			return first, last, applied
		}
		if err != nil {
			log.Error(err, "skip a malformed replay message")
			continue
		}
		if applied == 0 && seq > want && orLater {
			want = seq // the oldest the buffer holds
		}
		if seq != want {
			// Before from, or past a batch the buffer no longer holds: applying it would
			// leave a hole, which the caller sees as the gap still open.
			continue
		}
		f.apply(src.Engine, payload, log)
		if applied == 0 {
			first = seq
		}
		last, want = seq, seq+1
		applied++
	}
}

// refused is whether err refuses engine's publisher (RefusedError: the connection was closed
// for what it wrote), which it then logs and counts as a loss: what the refused message held,
// and what the publisher sends until the follower reconnects, is missing from the index.
func (f *Follower) refused(engine string, err error, log logr.Logger) bool {
	var r *RefusedError
	if !errors.As(err, &r) {
		return false
	}
	log.Error(err, "KV events connection refused: the engine's index is dropped and its pool estimated for a while")
	f.Index.Drop(engine)
	f.update(engine, func(s *Stream) { s.Refused++; s.LastLoss = time.Now() })
	return true
}

// frames reads a publisher message: [topic, 8-byte big-endian sequence, payload].
func frames(msg zmq4.Msg, topic string) (seq uint64, payload []byte, err error) {
	if len(msg.Frames) != 3 {
		return 0, nil, fmt.Errorf("%d frames, want topic, sequence and payload", len(msg.Frames))
	}
	if len(msg.Frames[1]) != 8 {
		return 0, nil, errors.New("sequence is not 8 bytes")
	}
	seq = binary.BigEndian.Uint64(msg.Frames[1])
	if seq != endSeq && string(msg.Frames[0]) != topic {
		return 0, nil, fmt.Errorf("topic %q, want %q", msg.Frames[0], topic)
	}
	return seq, msg.Frames[2], nil
}

// decodeBatch is Decode; tests make it panic.
var decodeBatch = Decode

// apply decodes a batch and applies it to engine's index. A panic doing so, some input no check
// foresaw, is recovered: Follow runs in its own goroutine, where it would end the router, every
// replica alike for as long as the engine republishes (issue 56). What the batch half applied is
// unknown, so the engine's index is dropped and its pool estimated for a while, as after a loss.
func (f *Follower) apply(engine string, payload []byte, log logr.Logger) {
	defer func() {
		if p := recover(); p != nil {
			log.Error(fmt.Errorf("panic: %v", p), "KV event batch refused: decoding or applying it panicked; the engine's index is dropped", "stack", string(debug.Stack()))
			f.Index.Drop(engine)
			f.update(engine, func(s *Stream) { s.Panics++; s.LastLoss = time.Now() })
		}
	}()
	b, err := decodeBatch(payload)
	if err != nil {
		log.Error(err, "skip a malformed KV event batch")
		return
	}
	orphans := f.Index.Apply(engine, b.Events)
	f.update(engine, func(s *Stream) {
		s.Batches++
		s.Events += len(b.Events)
		s.BlocksOrphaned += orphans
		s.LastEvent = time.Now()
		if lag, ok := batchLag(s.LastEvent, b.TS); ok {
			s.Lag = lag
		}
	})
}

// clockSkew is how far in the future a batch's timestamp may be: the engine's clock, not the
// router's.
const clockSkew = time.Minute

// batchLag is how long a batch dated ts (seconds since the epoch, the engine's clock) took to
// arrive at now; ok is false for a date before now - routerconfig.MaxEventsLag or past now +
// clockSkew (the engine writes it: issue 56 saw a batch dated 1970 put 56 years in status).
func batchLag(now time.Time, ts float64) (lag time.Duration, ok bool) {
	d := float64(now.UnixNano())/1e9 - ts
	if !(d >= -clockSkew.Seconds() && d <= routerconfig.MaxEventsLag.Seconds()) { // NaN too
		return 0, false
	}
	return time.Duration(max(d, 0) * 1e9), true
}
