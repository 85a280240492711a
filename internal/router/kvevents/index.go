package kvevents

import (
	"encoding/binary"
	"hash/maphash"
	"slices"
	"sync"

	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

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

// applySlice bounds the work (blocks and events) Apply does under one hold of the lock: every
// request's match waits for one slice, not for a whole batch (issue 56: a hostile engine's batch
// of 2,000,000 blocks held the pool's index for 1.8 s).
const applySlice = 1024

// Index is what the engines of one pool hold, by engine URL, as their events said. It is safe
// for concurrent use.
type Index struct {
	// capacity bounds each engine's entries; total bounds all of them (0: no bound), from the
	// router's memory (routerconfig.KVIndexBlocks).
	capacity, total int
	// mu guards engines and the counts: requests read under a read lock, each engine's
	// follower writes.
	mu      sync.RWMutex
	engines map[string]*engine
	// size is the entries of all engines; evicted counts those given up for total.
	size    int
	evicted int64
	// betweenSlices runs while Apply has let go of the lock between two slices (tests).
	betweenSlices func()
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

// NewIndex returns an empty Index of at most blocksPerEngine entries per engine (0:
// routerconfig.DefaultBlocksPerEngine; a flood of events past it evicts entries at random
// instead of growing) and total in all (0: no bound but the engines'). Past total the engine
// holding the most gives up an entry at random, so that an engine that joins gets its share.
func NewIndex(blocksPerEngine, total int) *Index {
	if blocksPerEngine <= 0 {
		blocksPerEngine = routerconfig.DefaultBlocksPerEngine
	}
	return &Index{capacity: blocksPerEngine, total: max(total, 0), engines: map[string]*engine{}}
}

// add records an entry of e, within both bounds.
func (ix *Index) add(e *engine, k blockKey, own uint64) {
	before := len(e.blocks)
	e.add(k, own, ix.capacity)
	ix.size += len(e.blocks) - before
	for ix.total > 0 && ix.size > ix.total {
		var most *engine
		for _, o := range ix.engines {
			if most == nil || len(o.blocks) > len(most.blocks) {
				most = o
			}
		}
		most.evictOne()
		ix.size--
		ix.evicted++
	}
}

// forget takes e's entries out of the count: e is cleared or dropped.
func (ix *Index) forget(e *engine) {
	if e != nil {
		ix.size -= len(e.blocks)
	}
}

// Apply records an engine's events, in order, in slices of applySlice blocks or events with the
// lock let go between them; one follower applies each engine's batches, so their order holds,
// and a request meanwhile sees the batch in part, as it would one event sooner. An engine
// dropped meanwhile takes no more of the batch. Blocks whose parent the index does not know
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
	work := 0
	// more counts one unit of work and lets readers in after a slice; false once e is dropped.
	more := func() bool {
		if work++; work < applySlice {
			return true
		}
		work = 0
		ix.mu.Unlock()
		if ix.betweenSlices != nil {
			ix.betweenSlices()
		}
		ix.mu.Lock()
		return ix.engines[url] == e
	}
	for _, ev := range events {
		if !more() {
			return orphans
		}
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
				ix.add(e, blockKey{h, ev.Group}, parent)
				if !more() {
					return orphans
				}
			}
		case Removed:
			for _, h := range ev.BlockHashes {
				if e.remove(blockKey{h, ev.Group}) {
					ix.size--
				}
				if !more() {
					return orphans
				}
			}
		case Cleared:
			ix.forget(e)
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
		e.evictOne()
	}
	e.blocks[k] = own
	e.held[own]++
}

func (e *engine) remove(k blockKey) (removed bool) {
	own, ok := e.blocks[k]
	if !ok {
		return false
	}
	delete(e.blocks, k)
	if e.held[own]--; e.held[own] <= 0 {
		delete(e.held, own)
	}
	return true
}

// evictOne removes an entry of e at random (map order); e holds at least one.
func (e *engine) evictOne() {
	for victim := range e.blocks {
		e.remove(victim)
		return
	}
}

// Drop forgets url's cache: its engine restarted, or its events can no longer be trusted.
func (ix *Index) Drop(url string) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.forget(ix.engines[url])
	delete(ix.engines, url)
}

// CommonBlockSize is the block size the events of urls stated (those that stated none aside),
// 0 when none did, and whether they agree.
func (ix *Index) CommonBlockSize(urls [][]string) (size int, agree bool) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
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

// MatchLeading sets matched[i] to the most leading full blocks of tokens (blockSize each) any
// of urls[i] holds (one pod's data-parallel ranks, of which the router does not pick one) and
// returns how many full blocks tokens has. A block is hashed only while some rank holds every
// block before it: a long prompt costs what matches, not 8 bytes of hashes a block (issue 56:
// 8 MiB of token ids in blocks of one took a router 80 MiB a request).
func (ix *Index) MatchLeading(tokens []uint32, blockSize int, urls [][]string, matched []int) (blocks int) {
	if blockSize <= 0 {
		clear(matched)
		return 0
	}
	blocks = len(tokens) / blockSize
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	// The ranks still matching: each holds every block so far.
	type rank struct {
		pod int
		e   *engine
	}
	var alive []rank
	for i, us := range urls {
		matched[i] = 0
		for _, u := range us {
			if e := ix.engines[u]; e != nil {
				alive = append(alive, rank{i, e})
			}
		}
	}
	parent := uint64(root)
	for b := 0; b < blocks && len(alive) > 0; b++ {
		parent = chain(parent, tokens[b*blockSize:(b+1)*blockSize])
		alive = slices.DeleteFunc(alive, func(r rank) bool { return r.e.held[parent] == 0 })
		for _, r := range alive {
			matched[r.pod] = b + 1
		}
	}
	return blocks
}

// Blocks is the entries the index holds for url.
func (ix *Index) Blocks(url string) int {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	if e := ix.engines[url]; e != nil {
		return len(e.blocks)
	}
	return 0
}

// Size is the entries the index holds in all.
func (ix *Index) Size() int {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return ix.size
}

// Evicted is how many entries the index gave up to stay within its total.
func (ix *Index) Evicted() int64 {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return ix.evicted
}

// Retain forgets the engines keep does not name.
func (ix *Index) Retain(keep func(url string) bool) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	for url, e := range ix.engines {
		if !keep(url) {
			ix.forget(e)
			delete(ix.engines, url)
		}
	}
}
