package kvevents

import (
	"encoding/binary"
	"hash/maphash"
	"sync"
)

// DefaultBlocksPerEngine bounds each engine's entries: 262144 blocks of 16 tokens is 4M
// tokens, more than one GPU's KV cache holds for the models served on one; a flood of events
// past it evicts entries at random instead of growing.
const DefaultBlocksPerEngine = 262144

// seed is one per process: requests and events hash alike, random so that no client can aim
// collisions at the router.
var seed = maphash.MakeSeed()

// root stands for "no block before": the chain of a prompt's first block starts from it.
const root = 0

// chain is the router's hash of a block: its tokens after the hash of the block before.
func chain(parent uint64, tokens []uint32) uint64 {
	var h maphash.Hash
	h.SetSeed(seed)
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], parent)
	_, _ = h.Write(b[:])
	for _, t := range tokens {
		binary.LittleEndian.PutUint32(b[:4], t)
		_, _ = h.Write(b[:4])
	}
	return h.Sum64()
}

// Hashes are the router's hashes of the full blocks of blockSize in tokens: what an engine
// that cached the prompt holds, block by block.
func Hashes(tokens []uint32, blockSize int) []uint64 {
	if blockSize <= 0 {
		return nil
	}
	out := make([]uint64, len(tokens)/blockSize)
	parent := uint64(root)
	for i := range out {
		parent = chain(parent, tokens[i*blockSize:(i+1)*blockSize])
		out[i] = parent
	}
	return out
}

// Index is what the engines of one pool hold, by engine URL, as their events said. It is safe
// for concurrent use.
type Index struct {
	capacity int
	mu       sync.Mutex
	engines  map[string]*engine
}

// engine is one engine's cache: its block hashes mapped to the router's (a block of each KV
// cache group is one entry; held counts them per router hash).
type engine struct {
	blockSize int
	blocks    map[blockKey]uint64
	held      map[uint64]int
}

type blockKey struct {
	hash  uint64
	group int
}

// NewIndex returns an empty Index of at most blocksPerEngine entries per engine (0: the
// default).
func NewIndex(blocksPerEngine int) *Index {
	if blocksPerEngine <= 0 {
		blocksPerEngine = DefaultBlocksPerEngine
	}
	return &Index{capacity: blocksPerEngine, engines: map[string]*engine{}}
}

// Apply records an engine's events, in order. Blocks whose parent the index does not know
// (stored before the router listened, and not replayed) are skipped: their tokens' place in a
// prompt is unknown. It reports how many stored blocks it skipped that way.
func (ix *Index) Apply(url string, events []Event) (orphans int) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	e := ix.engines[url]
	if e == nil {
		e = &engine{blocks: map[blockKey]uint64{}, held: map[uint64]int{}}
		ix.engines[url] = e
	}
	for _, ev := range events {
		switch ev := ev.(type) {
		case Stored:
			if ev.Keyed || (ev.Medium != "" && ev.Medium != "GPU") {
				continue
			}
			if checkBlocks(len(ev.BlockHashes), len(ev.TokenIDs), int64(ev.BlockSize)) != nil {
				continue // Decode refuses it; slicing it here would panic
			}
			parent := uint64(root)
			if ev.HasParent {
				p, ok := e.blocks[blockKey{ev.Parent, ev.Group}]
				if !ok {
					orphans += len(ev.BlockHashes)
					continue
				}
				parent = p
			}
			e.blockSize = ev.BlockSize
			for i, h := range ev.BlockHashes {
				parent = chain(parent, ev.TokenIDs[i*ev.BlockSize:(i+1)*ev.BlockSize])
				e.add(blockKey{h, ev.Group}, parent, ix.capacity)
			}
		case Removed:
			for _, h := range ev.BlockHashes {
				e.remove(blockKey{h, ev.Group})
			}
		case Cleared:
			*e = engine{blockSize: e.blockSize, blocks: map[blockKey]uint64{}, held: map[uint64]int{}}
		}
	}
	return orphans
}

func (e *engine) add(k blockKey, own uint64, capacity int) {
	if old, ok := e.blocks[k]; ok {
		if old == own {
			return
		}
		e.remove(k)
	}
	for len(e.blocks) >= capacity {
		for victim := range e.blocks {
			e.remove(victim)
			break
		}
	}
	e.blocks[k] = own
	e.held[own]++
}

func (e *engine) remove(k blockKey) {
	own, ok := e.blocks[k]
	if !ok {
		return
	}
	delete(e.blocks, k)
	if e.held[own]--; e.held[own] <= 0 {
		delete(e.held, own)
	}
}

// Drop forgets url's cache: its engine restarted, or its events can no longer be trusted.
func (ix *Index) Drop(url string) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	delete(ix.engines, url)
}

// CommonBlockSize is the block size the events of urls stated (those that stated none aside),
// 0 when none did, and whether they agree.
func (ix *Index) CommonBlockSize(urls [][]string) (size int, agree bool) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	for _, us := range urls {
		for _, u := range us {
			e := ix.engines[u]
			if e == nil || e.blockSize == 0 {
				continue
			}
			if size != 0 && e.blockSize != size {
				return 0, false
			}
			size = e.blockSize
		}
	}
	return size, true
}

// MatchBest sets matched[i] to the most leading blocks of hashes any of urls[i] holds (one
// pod's data-parallel ranks, of which the router does not pick one).
func (ix *Index) MatchBest(hashes []uint64, urls [][]string, matched []int) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	for i, us := range urls {
		matched[i] = 0
		for _, u := range us {
			matched[i] = max(matched[i], ix.engines[u].leading(hashes))
		}
	}
}

// leading is how many of hashes' first blocks e holds (none for no engine).
func (e *engine) leading(hashes []uint64) int {
	if e == nil {
		return 0
	}
	n := 0
	for _, h := range hashes {
		if e.held[h] == 0 {
			break
		}
		n++
	}
	return n
}

// Blocks is the entries the index holds for url.
func (ix *Index) Blocks(url string) int {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if e := ix.engines[url]; e != nil {
		return len(e.blocks)
	}
	return 0
}

// Size is the entries the index holds in all.
func (ix *Index) Size() int {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	n := 0
	for _, e := range ix.engines {
		n += len(e.blocks)
	}
	return n
}

// Retain forgets the engines keep does not name.
func (ix *Index) Retain(keep func(url string) bool) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	for url := range ix.engines {
		if !keep(url) {
			delete(ix.engines, url)
		}
	}
}
