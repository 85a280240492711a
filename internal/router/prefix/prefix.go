// Package prefix remembers which engine was sent which prompt prefixes, without a tokenizer:
// a prompt's bytes are cut into chunks, the hash of chunk i covers every byte up to its end
// (so one hash stands for a whole prefix), and each engine keeps the hashes of the prompts it
// was sent in a bounded LRU. An engine's match for a prompt is how many of the prompt's leading
// chunks it holds, an estimate of what its prefix cache holds, as llm-d's approximate prefix
// scorer and AIBrix's prefix-cache router estimate it.
package prefix

import (
	"hash/maphash"
	"sync"
)

// Config bounds the work per prompt and the memory per engine.
type Config struct {
	// ChunkBytes is the bytes of prompt per chunk; a last partial chunk is not hashed (vLLM
	// caches only full blocks).
	ChunkBytes int
	// MaxChunks is the chunks hashed per prompt: the first MaxChunks x ChunkBytes bytes
	// decide, which bounds a long prompt's cost.
	MaxChunks int
	// Capacity is the chunk hashes each engine keeps; the least recently sent go first.
	Capacity int
}

// Defaults, as llm-d's approximate prefix scorer's: 64 bytes (about 16 tokens, one vLLM
// block of English text), 256 chunks (16 KiB of prompt), 31250 hashes per engine.
const (
	DefaultChunkBytes = 64
	DefaultMaxChunks  = 256
	DefaultCapacity   = 31250
)

// seed is one per process: the router hashes a prompt once and matches the hashes in every
// pool's Index. Random per process, so a client cannot aim collisions at the router.
var seed = maphash.MakeSeed()

// Index is the prefixes of one pool's engines, by engine URL. It is safe for concurrent use.
type Index struct {
	cfg Config
	mu  sync.Mutex
	// engines holds each engine's hashes; size is their sum.
	engines map[string]*lru
	size    int
}

// New returns an empty Index; a zero field of cfg takes its default.
func New(cfg Config) *Index {
	if cfg.ChunkBytes <= 0 {
		cfg.ChunkBytes = DefaultChunkBytes
	}
	if cfg.MaxChunks <= 0 {
		cfg.MaxChunks = DefaultMaxChunks
	}
	if cfg.Capacity <= 0 {
		cfg.Capacity = DefaultCapacity
	}
	return &Index{cfg: cfg, engines: map[string]*lru{}}
}

// ChunkBytes is the bytes of prompt each hash covers.
func (ix *Index) ChunkBytes() int { return ix.cfg.ChunkBytes }

// Hashes are the chunk hashes of prompt for model: the model's name starts the chain, since
// one engine's cache holds one model's blocks.
func (ix *Index) Hashes(model, prompt []byte) []uint64 {
	n := min(len(prompt)/ix.cfg.ChunkBytes, ix.cfg.MaxChunks)
	if n == 0 {
		return nil
	}
	var h maphash.Hash
	h.SetSeed(seed)
	_, _ = h.Write(model)
	_ = h.WriteByte(0)
	out := make([]uint64, n)
	for i := range out {
		_, _ = h.Write(prompt[i*ix.cfg.ChunkBytes : (i+1)*ix.cfg.ChunkBytes])
		out[i] = h.Sum64()
	}
	return out
}

// Match sets matched[i] to the leading hashes urls[i] holds.
func (ix *Index) Match(hashes []uint64, urls func(i int) string, matched []int) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	for i := range matched {
		matched[i] = 0
		e := ix.engines[urls(i)]
		if e == nil {
			continue
		}
		for _, h := range hashes {
			if _, ok := e.at[h]; !ok {
				break
			}
			matched[i]++
		}
	}
}

// Record remembers hashes as sent to url, the most recent.
func (ix *Index) Record(url string, hashes []uint64) {
	if len(hashes) == 0 {
		return
	}
	ix.mu.Lock()
	defer ix.mu.Unlock()
	e := ix.engines[url]
	if e == nil {
		e = newLRU()
		ix.engines[url] = e
	}
	ix.size += e.add(hashes, ix.cfg.Capacity)
}

// Retain forgets the engines keep does not name: their pods are gone, and their caches with
// them.
func (ix *Index) Retain(keep func(url string) bool) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	for url, e := range ix.engines {
		if !keep(url) {
			ix.size -= e.len()
			delete(ix.engines, url)
		}
	}
}

// Size is the hashes held for all engines.
func (ix *Index) Size() int {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	return ix.size
}

// lru is one engine's hashes in a ring of slots, the most recently sent at head: a slice and
// a map, no allocation per hash once full.
type lru struct {
	slots []slot
	at    map[uint64]int32
	head  int32 // most recent; -1 when empty
}

type slot struct {
	h          uint64
	prev, next int32
}

func newLRU() *lru { return &lru{at: map[uint64]int32{}, head: -1} }

// len is the hashes held.
func (l *lru) len() int { return len(l.slots) }

// add puts hashes at the front, reusing the least recent slot past capacity, and returns how
// many more it holds.
func (l *lru) add(hashes []uint64, capacity int) (grown int) {
	// The last chunk goes in first, so the prompt's first chunks end most recent: a prefix's
	// start is what other prompts share, and a chain broken at its start matches nothing.
	for i := len(hashes) - 1; i >= 0; i-- {
		h := hashes[i]
		if s, ok := l.at[h]; ok {
			l.front(s)
			continue
		}
		if len(l.slots) < capacity {
			l.slots = append(l.slots, slot{h: h, prev: -1, next: -1})
			s := int32(len(l.slots) - 1)
			l.at[h] = s
			l.link(s)
			grown++
			continue
		}
		tail := l.slots[l.head].prev // the ring's least recent
		delete(l.at, l.slots[tail].h)
		l.slots[tail].h = h
		l.at[h] = tail
		l.front(tail)
	}
	return grown
}

// link puts the unlinked slot s at the head.
func (l *lru) link(s int32) {
	if l.head < 0 {
		l.slots[s].prev, l.slots[s].next = s, s
	} else {
		tail := l.slots[l.head].prev
		l.slots[s].prev, l.slots[s].next = tail, l.head
		l.slots[tail].next = s
		l.slots[l.head].prev = s
	}
	l.head = s
}

// front makes the linked slot s the head.
func (l *lru) front(s int32) {
	if s == l.head {
		return
	}
	if l.slots[s].next == l.head { // the tail: turning the ring moves it to the head
		l.head = s
		return
	}
	prev, next := l.slots[s].prev, l.slots[s].next
	l.slots[prev].next, l.slots[next].prev = next, prev
	l.link(s)
}
