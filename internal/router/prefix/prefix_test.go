package prefix

import (
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func prompt(words ...string) []byte { return []byte(strings.Join(words, "")) }

// 8-byte chunks make the prompts below easy to count.
var small = Config{ChunkBytes: 8, MaxChunks: 4, Capacity: 100}

func TestHashesStandForWholePrefixes(t *testing.T) {
	ix := New(small)
	a := ix.Hashes([]byte("m"), prompt("system: ", "be brief", "question", "one....."))
	b := ix.Hashes([]byte("m"), prompt("system: ", "be brief", "question", "two....."))
	other := ix.Hashes([]byte("n"), prompt("system: ", "be brief", "question", "one....."))
	if len(a) != 4 || !slices.Equal(a[:3], b[:3]) || a[3] == b[3] {
		t.Errorf("hashes %x and %x: want the first 3 equal (a shared 24-byte prefix), the 4th not", a, b)
	}
	// The same bytes later in a prompt are another prefix.
	shifted := ix.Hashes([]byte("m"), prompt("be brief", "system: ", "question", "one....."))
	if a[1] == shifted[1] || a[3] == shifted[3] {
		t.Errorf("a chunk's hash does not cover what came before it: %x, %x", a, shifted)
	}
	if other[0] == a[0] {
		t.Errorf("the model is not in the hash: another model's prompt matches")
	}
	for _, tc := range []struct {
		name   string
		prompt []byte
		want   int
	}{
		{"shorter than a chunk", []byte("1234567"), 0},
		{"a partial last chunk is not hashed", []byte("12345678abc"), 1},
		{"past MaxChunks, the rest does not count", []byte(strings.Repeat("x", 8*10)), 4},
	} {
		if got := len(ix.Hashes([]byte("m"), tc.prompt)); got != tc.want {
			t.Errorf("%s: %d hashes, want %d", tc.name, got, tc.want)
		}
	}
}

// An engine matches a prompt by the leading chunks it was sent; a chunk it holds past a
// missing one does not count (vLLM's prefix cache is a chain too).
func TestMatchCountsLeadingChunks(t *testing.T) {
	ix := New(small)
	m := []byte("m")
	sent := ix.Hashes(m, prompt("system: ", "be brief", "question", "one....."))
	ix.Record("a", sent)
	ix.Record("b", sent[:1])
	urls := []string{"a", "b", "c"}
	for _, tc := range []struct {
		name   string
		prompt []byte
		want   []int
	}{
		{"the same prompt", prompt("system: ", "be brief", "question", "one....."), []int{4, 1, 0}},
		{"a shared start", prompt("system: ", "be brief", "question", "two....."), []int{3, 1, 0}},
		{"nothing shared", prompt("hello   ", "be brief"), []int{0, 0, 0}},
	} {
		got := make([]int, len(urls))
		ix.Match(ix.Hashes(m, tc.prompt), func(i int) string { return urls[i] }, got)
		if d := cmp.Diff(tc.want, got); d != "" {
			t.Errorf("%s: matched (-want +got):\n%s", tc.name, d)
		}
	}
	ix.Retain(func(u string) bool { return u != "a" })
	got := make([]int, 1)
	ix.Match(sent, func(int) string { return "a" }, got)
	if got[0] != 0 || ix.Size() != 1 {
		t.Errorf("after a's pod went: a matches %d, the index holds %d, want 0 and b's 1", got[0], ix.Size())
	}
}

// The ring evicts exactly as a plain least-recently-used list would, over a long random run
// with repeats, at a capacity far below the hashes sent.
func TestEvictsTheLeastRecentlySent(t *testing.T) {
	const capacity = 7
	l := newLRU()
	var model []uint64 // most recent first
	rng := rand.New(rand.NewPCG(1, 2))
	size := 0
	for range 5000 {
		hashes := make([]uint64, rng.IntN(5))
		for i := range hashes {
			hashes[i] = uint64(rng.IntN(20))
		}
		size += l.add(hashes, capacity)
		for i := len(hashes) - 1; i >= 0; i-- {
			model = slices.DeleteFunc(model, func(h uint64) bool { return h == hashes[i] })
			model = append([]uint64{hashes[i]}, model...)
			if len(model) > capacity {
				model = model[:capacity]
			}
		}
		var got []uint64
		if l.head >= 0 {
			for s, n := l.head, 0; n < l.len(); s, n = l.slots[s].next, n+1 {
				got = append(got, l.slots[s].h)
			}
		}
		if d := cmp.Diff(model, got); d != "" {
			t.Fatalf("after adding %v (-want +got):\n%s", hashes, d)
		}
		if size != len(model) || len(l.at) != len(model) {
			t.Fatalf("size %d, map %d, want %d", size, len(l.at), len(model))
		}
	}
}

// The router hashes a request once and matches those hashes in each pool's Index: every Index
// of one process must hash alike.
func TestIndexesHashAlike(t *testing.T) {
	p := prompt("system: ", "be brief", "question", "one.....")
	a, b := New(small).Hashes([]byte("m"), p), New(small).Hashes([]byte("m"), p)
	if diff := cmp.Diff(a, b); diff != "" {
		t.Errorf("two indexes hash one prompt differently (-first +second):\n%s", diff)
	}
}
