// Package kvpublish stands in for vLLM's KV cache events publisher (ZmqEventPublisher in
// vllm/distributed/kv_events.py, 0.30 to 0.33) where vLLM's own cannot run: in the simulated
// engines, and in tests that restart an engine in place. It publishes as vLLM does: each batch
// [ts, events, data_parallel_rank] as msgpack, events as maps tagged by "type", on a PUB socket
// as [topic, 8-byte big-endian sequence, payload]; a ROUTER socket replays the buffered batches
// from a sequence on, then an end marker (sequence -1).
package kvpublish

import (
	"context"
	"encoding/binary"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
)

// BufferSteps is vLLM's default replay buffer: the last 10000 batches.
const BufferSteps = 10_000

// endSeq ends a replay: -1 as vLLM's signed 8 bytes.
var endSeq = []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// Publisher is one engine's (one data-parallel rank's) publisher.
type Publisher struct {
	topic       []byte
	rank        int
	pub, replay zmq4.Socket
	cancel      context.CancelFunc
	done        chan struct{}

	mu     sync.Mutex
	seq    uint64
	buffer []batch
}

type batch struct {
	seq     uint64
	payload []byte
}

// Listen binds the publisher's endpoint and, if not empty, its replay endpoint (vLLM's
// "tcp://*:5557" forms), for the data-parallel rank given.
func Listen(endpoint, replayEndpoint, topic string, rank int) (*Publisher, error) {
	ctx, cancel := context.WithCancel(context.Background())
	p := &Publisher{topic: []byte(topic), rank: rank, pub: zmq4.NewPub(ctx), cancel: cancel, done: make(chan struct{})}
	if err := p.pub.Listen(endpoint); err != nil {
		cancel()
		return nil, fmt.Errorf("kv events publisher: listen on %s: %w", endpoint, err)
	}
	if replayEndpoint == "" {
		close(p.done)
		return p, nil
	}
	p.replay = zmq4.NewRouter(ctx)
	if err := p.replay.Listen(replayEndpoint); err != nil {
		cancel()
		_ = p.pub.Close()
		return nil, fmt.Errorf("kv events publisher: listen on %s: %w", replayEndpoint, err)
	}
	go p.serveReplay()
	return p, nil
}

// Addr is the bound publisher address (host:port), for endpoints bound on port 0.
func (p *Publisher) Addr() string { return p.pub.Addr().String() }

// ReplayAddr is the bound replay address, "" without replay.
func (p *Publisher) ReplayAddr() string {
	if p.replay == nil {
		return ""
	}
	return p.replay.Addr().String()
}

func (p *Publisher) serveReplay() {
	defer close(p.done)
	for {
		msg, err := p.replay.Recv()
		if err != nil {
			return
		}
		// [client id, empty, start sequence]
		if len(msg.Frames) != 3 || len(msg.Frames[2]) != 8 {
			continue
		}
		id, from := msg.Frames[0], binary.BigEndian.Uint64(msg.Frames[2])
		p.mu.Lock()
		var send []batch
		for _, b := range p.buffer {
			if b.seq >= from {
				send = append(send, b)
			}
		}
		p.mu.Unlock()
		for _, b := range send {
			if p.replay.SendMulti(zmq4.NewMsgFrom(id, []byte{}, p.topic, seqBytes(b.seq), b.payload)) != nil {
				break
			}
		}
		_ = p.replay.SendMulti(zmq4.NewMsgFrom(id, []byte{}, []byte{}, endSeq, []byte{}))
	}
}

func seqBytes(seq uint64) []byte {
	b := make([]byte, 8)
	binary.BigEndian.PutUint64(b, seq)
	return b
}

// Publish sends events as one batch, the next in sequence, and keeps it for replay.
func (p *Publisher) Publish(events ...map[string]any) error {
	list := make([]any, len(events))
	for i, e := range events {
		list[i] = e
	}
	payload, err := msgpack.Marshal([]any{float64(time.Now().UnixNano()) / 1e9, list, p.rank})
	if err != nil {
		return fmt.Errorf("kv events publisher: encode: %w", err)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	seq := p.seq
	p.seq++
	p.buffer = append(p.buffer, batch{seq, payload})
	if len(p.buffer) > BufferSteps {
		p.buffer = p.buffer[1:]
	}
	if err := p.pub.SendMulti(zmq4.NewMsgFrom(p.topic, seqBytes(seq), payload)); err != nil {
		return fmt.Errorf("kv events publisher: send: %w", err)
	}
	return nil
}

// Restart is a new engine process on the same sockets: its sequence from 0, its buffer empty
// (what vLLM's own publisher cannot be made to do without the subscriber's connection dropping).
func (p *Publisher) Restart() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.seq, p.buffer = 0, nil
}

// Lose skips n sequence numbers as if their batches were sent and had left the replay buffer:
// a subscriber sees a gap that replay cannot fill.
func (p *Publisher) Lose(n int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.seq += uint64(n)
}

// Close stops publishing and closes both sockets.
func (p *Publisher) Close() {
	p.cancel()
	_ = p.pub.Close()
	if p.replay != nil {
		_ = p.replay.Close()
	}
	<-p.done
}

// Stored is vLLM's BlockStored event: blocks of blockSize tokens each (tokens holds them
// all, in order) cached on the GPU after parent (nil: the prompt's first block).
func Stored(hashes []uint64, parent *uint64, tokens []uint32, blockSize int) map[string]any {
	hs := make([]any, len(hashes))
	for i, h := range hashes {
		hs[i] = h
	}
	ids := make([]any, len(tokens))
	for i, t := range tokens {
		ids[i] = t
	}
	var par any
	if parent != nil {
		par = *parent
	}
	return map[string]any{"type": "BlockStored", "block_hashes": hs, "parent_block_hash": par, "token_ids": ids,
		"block_size": blockSize, "lora_id": nil, "medium": "GPU", "lora_name": nil}
}

// Removed is vLLM's BlockRemoved event: blocks evicted from the GPU.
func Removed(hashes []uint64) map[string]any {
	hs := make([]any, len(hashes))
	for i, h := range hashes {
		hs[i] = h
	}
	return map[string]any{"type": "BlockRemoved", "block_hashes": hs, "medium": "GPU"}
}

// Cleared is vLLM's AllBlocksCleared event: the prefix cache was reset.
func Cleared() map[string]any { return map[string]any{"type": "AllBlocksCleared"} }

// ForRank listens where --kv-events-config has data-parallel rank rank publish, as vLLM's
// EventPublisherFactory does: the endpoints' tcp ports offset by the rank (port 0 left to the
// system), vLLM's default endpoint when none is given. Without enable_kv_cache_events it
// returns nil.
func ForRank(cfg vllm.KVEventsConfig, rank int) (*Publisher, error) {
	if !cfg.EnableKVCacheEvents {
		return nil, nil
	}
	endpoint := cfg.Endpoint
	if endpoint == "" {
		endpoint = "tcp://*:5557"
	}
	return Listen(OffsetEndpoint(endpoint, rank), OffsetEndpoint(cfg.ReplayEndpoint, rank), cfg.Topic, rank)
}

// OffsetEndpoint is vLLM's offset_endpoint_port for tcp endpoints: rank added to the port.
func OffsetEndpoint(endpoint string, rank int) string {
	i := strings.LastIndex(endpoint, ":")
	if endpoint == "" || rank == 0 || i < 0 {
		return endpoint
	}
	port, err := strconv.Atoi(endpoint[i+1:])
	if err != nil || port == 0 {
		return endpoint
	}
	return endpoint[:i+1] + strconv.Itoa(port+rank)
}
