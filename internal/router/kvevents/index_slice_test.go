package kvevents

import (
	"runtime"
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"

	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// A huge batch is applied in slices with the lock free between them, so that every request's
// match waits for one slice, not for the batch (issue 56: a hostile engine's 2,000,000 blocks
// held the pool's index for 1.8 s); the batch's result is the same as in one piece.
func TestApplyLetsReadersInBetweenSlices(t *testing.T) {
	const blocks, size = 10*applySlice + 7, 2
	ids := tokens(0, blocks*size)
	hs := make([]uint64, blocks)
	for i := range hs {
		hs[i] = uint64(i + 1)
	}
	events := []Event{
		Stored{BlockHashes: hs, TokenIDs: ids, BlockSize: size},
		Removed{BlockHashes: hs[blocks-applySlice:]},
	}
	ix := NewIndex(0, 0)
	pauses, matched := 0, make([]int, 1)
	ix.betweenSlices = func() {
		pauses++
		if !ix.mu.TryLock() {
			t.Fatal("the index is locked between two slices of a batch")
		}
		ix.mu.Unlock()
		ix.MatchLeading(ids, size, [][]string{{"e"}}, matched) // a request meanwhile
	}
	if orphans := ix.Apply("e", events); orphans != 0 {
		t.Fatalf("%d orphans", orphans)
	}
	// blocks stored and applySlice removed, one slice at a time; the two events count too.
	if want := (blocks + applySlice + 2) / applySlice; pauses != want {
		t.Errorf("%d pauses for %d blocks, want %d", pauses, blocks+applySlice, want)
	}
	if matched[0] == 0 {
		t.Error("a request between two slices matched none of the blocks already applied")
	}
	whole := NewIndex(0, 0)
	whole.Apply("e", events)
	got, want := make([]int, 1), make([]int, 1)
	ix.MatchLeading(ids, size, [][]string{{"e"}}, got)
	whole.MatchLeading(ids, size, [][]string{{"e"}}, want)
	if d := cmp.Diff([]int{want[0], whole.Blocks("e")}, []int{got[0], ix.Blocks("e")}); d != "" {
		t.Errorf("sliced apply differs from whole (-want +got):\n%s", d)
	}
	if got[0] != blocks-applySlice {
		t.Errorf("matched %d leading blocks, want %d", got[0], blocks-applySlice)
	}
}

// An engine dropped between two slices (restarted, or no longer trusted) takes no more of its
// batch: the rest was for the cache the router forgot.
func TestApplyStopsForADroppedEngine(t *testing.T) {
	const blocks, size = 3 * applySlice, 2
	hs := make([]uint64, blocks)
	for i := range hs {
		hs[i] = uint64(i + 1)
	}
	ix := NewIndex(0, 0)
	ix.betweenSlices = func() { ix.Drop("e") }
	ix.Apply("e", []Event{Stored{BlockHashes: hs, TokenIDs: tokens(0, blocks*size), BlockSize: size}})
	if n := ix.Blocks("e"); n != 0 {
		t.Errorf("%d blocks of a dropped engine", n)
	}
}

// storedBlocks is one BlockStored event of n blocks of size 2, its hashes from first on.
func storedBlocks(first uint64, n int) Stored {
	hs := make([]uint64, n)
	for i := range hs {
		hs[i] = first + uint64(i)
	}
	return Stored{BlockHashes: hs, TokenIDs: tokens(int(first)*2, n*2), BlockSize: 2}
}

// The index holds at most its total, however many engines fill it: the router's memory bounds
// it, not blocksPerEngine times the engines (issue 56: 16777216 blocks per engine by the CRD,
// against a 1 GiB router). Past it the engine holding the most gives up a block, so a newcomer
// still gets its share; Size counts what the engines hold.
func TestIndexTotalBound(t *testing.T) {
	ix := NewIndex(1000, 1500)
	ix.Apply("a", []Event{storedBlocks(1, 1000)})
	ix.Apply("b", []Event{storedBlocks(5000, 1000)})
	got := []int{ix.Blocks("a"), ix.Blocks("b"), ix.Size(), int(ix.Evicted())}
	if d := cmp.Diff([]int{750, 750, 1500, 500}, got); d != "" {
		t.Errorf("blocks of a, b, in all, evicted (-want +got):\n%s", d)
	}
	ix.Apply("a", []Event{Removed{BlockHashes: storedBlocks(1, 1000).BlockHashes}})
	ix.Apply("c", []Event{storedBlocks(9000, 100), Cleared{}, storedBlocks(9000, 10)})
	ix.Drop("b")
	got = []int{ix.Blocks("a"), ix.Blocks("b"), ix.Blocks("c"), ix.Size()}
	if d := cmp.Diff([]int{0, 0, 10, 10}, got); d != "" {
		t.Errorf("after removing a's, clearing c and dropping b: a, b, c, in all (-want +got):\n%s", d)
	}
	ix.Retain(func(string) bool { return false })
	if n := ix.Size(); n != 0 {
		t.Errorf("Size = %d after forgetting every engine", n)
	}
}

// TestBlockBytes holds routerconfig.KVIndexBlockBytes, what the router's memory sizing charges
// one entry, over the live heap an entry takes at sizes around the maps' growth steps.
func TestBlockBytes(t *testing.T) {
	for _, n := range []int{50_000, 131_072, 262_144, 300_000} {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		ix := NewIndex(n, 0)
		ix.Apply("e", []Event{storedBlocks(1, n)})
		runtime.GC()
		runtime.ReadMemStats(&after)
		per := float64(int64(after.HeapAlloc)-int64(before.HeapAlloc)) / float64(n)
		if per > routerconfig.KVIndexBlockBytes {
			t.Errorf("%d blocks: %.0f bytes each, more than routerconfig.KVIndexBlockBytes (%d)", n, per, routerconfig.KVIndexBlockBytes)
		}
		runtime.KeepAlive(ix)
	}
}

// MatchLeading hashes only while a rank still matches, and agrees with matching every block's
// hash: per pod, its best rank's leading run, ranks holding different runs and gaps included.
func TestMatchLeadingAgreesWithEveryHash(t *testing.T) {
	const size = 2
	prompt := tokens(0, 40) // 20 blocks
	hs := Hashes(prompt, size)
	ix := NewIndex(0, 0)
	// Engines' hashes are their own; the index maps them to the router's chain of the tokens.
	store := func(url string, from, to int) {
		ids := make([]uint64, to-from)
		for i := range ids {
			ids[i] = uint64(1000*len(url) + from + i)
		}
		ev := Stored{BlockHashes: ids, TokenIDs: prompt[from*size : to*size], BlockSize: size}
		if from > 0 {
			ix.Apply(url, []Event{Stored{BlockHashes: []uint64{uint64(7000 + len(url))}, TokenIDs: prompt[:from*size], BlockSize: from * size}})
			ev.HasParent, ev.Parent = true, uint64(7000+len(url))
		}
		ix.Apply(url, []Event{ev})
	}
	store("a", 0, 6)    // pod 0, rank 0: blocks 0-5
	store("a#1", 0, 10) // pod 0, rank 1: blocks 0-9
	store("bb", 0, 3)   // pod 1: 0-2, then a gap, then 4-19 (unreachable)
	store("bb", 4, 20)  //
	store("ccc", 0, 20) // pod 2: every block
	urls := [][]string{{"a", "a#1"}, {"bb"}, {"ccc"}, {"none"}}
	want := make([]int, len(urls))
	for i, us := range urls {
		for _, u := range us {
			n := 0
			for _, h := range hs {
				ix.mu.RLock()
				held := ix.engines[u] != nil && ix.engines[u].held[h] > 0
				ix.mu.RUnlock()
				if !held {
					break
				}
				n++
			}
			want[i] = max(want[i], n)
		}
	}
	got := make([]int, len(urls))
	if blocks := ix.MatchLeading(prompt, size, urls, got); blocks != len(hs) {
		t.Errorf("%d blocks, want %d", blocks, len(hs))
	}
	if d := cmp.Diff([]int{10, 3, 20, 0}, want); d != "" {
		t.Fatalf("the test's own index is not what it says (-want +got):\n%s", d)
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("MatchLeading (-every hash +got):\n%s", d)
	}
	if ix.MatchLeading(prompt[:1], size, urls, got); !slices.Equal(got, []int{0, 0, 0, 0}) {
		t.Errorf("a prompt shorter than a block matched %v", got)
	}
}
