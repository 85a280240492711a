package kvevents

import (
	"bufio"
	"context"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"

	"pdcluster.dev/pdcluster-operator/test/vllmenv"
)

// TestFollowsVLLMsPublisher runs vLLM's own ZmqEventPublisher (each tested release) and follows
// it: the batches it published before anyone listened come by replay (those its buffer still
// holds, when it published more), later ones live, an
// eviction and a clear reach the index, a batch lost in transit is replayed, a loss past the
// replay buffer drops the engine's index (it would keep what the engine evicted meanwhile),
// and a new publisher on the same ports (an engine restarted) drops what the old one held.
func TestFollowsVLLMsPublisher(t *testing.T) {
	for _, py := range vllmenv.Pythons(t) {
		t.Run("vLLM "+py.Version, func(t *testing.T) { followVLLM(t, py.Path) })
	}
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func followVLLM(t *testing.T, python string) {
	pub, rep := strconv.Itoa(freePort(t)), strconv.Itoa(freePort(t))
	cmd := exec.Command(python, "testdata/publisher.py", "tcp://*:"+pub, "tcp://*:"+rep)
	cmd.Env = append(os.Environ(), "HF_HUB_OFFLINE=1")
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = stdin.Close()
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		if t.Failed() {
			t.Logf("publisher's stderr:\n%s", stderr.String())
		}
	})
	lines := bufio.NewScanner(stdout)
	await := func(word string) {
		t.Helper()
		got := make(chan string, 1)
		go func() {
			for lines.Scan() {
				if w, ok := strings.CutPrefix(lines.Text(), "publisher: "); ok {
					got <- w
					break
				}
			}
			close(got)
		}()
		select {
		case w := <-got:
			if w != word {
				t.Fatalf("publisher said %q, want %q", w, word)
			}
		case <-time.After(3 * time.Minute): // importing vLLM takes tens of seconds
			t.Fatalf("publisher did not say %q", word)
		}
	}
	step := func(s string) {
		t.Helper()
		if _, err := stdin.Write([]byte(s + "\n")); err != nil {
			t.Fatal(err)
		}
		await(s)
	}
	await("history")

	const engine = "http://engine"
	f := &Follower{Index: NewIndex(0, 0), Topic: "kv", Log: testr.New(t)}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		f.Follow(ctx, Source{Engine: engine, Endpoint: "tcp://127.0.0.1:" + pub, Replay: "tcp://127.0.0.1:" + rep})
	}()
	t.Cleanup(func() { cancel(); wg.Wait() })

	// matches is how many leading blocks of tokens the engine holds, once it settles on want.
	matches := func(what string, tokens []uint32, want int) {
		t.Helper()
		got := make([]int, 1)
		for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			f.Index.MatchLeading(tokens, 4, [][]string{{engine}}, got)
			if got[0] == want {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: the engine holds %d leading blocks, want %d; streams %+v", what, got[0], want, f.Streams())
			}
		}
	}
	// The engine published one batch more than its replay buffer holds before the router
	// listened: the replay starts at the oldest it holds (issue 57: asked from 0, which it no
	// longer held, it replayed nothing).
	prompt := tokens(0, 12)
	matches("replayed history", prompt, 3)
	matches("a batch past the replay buffer", tokens(200, 4), 0)
	matches("the oldest batch the replay buffer held", tokens(204, 4), 1)
	step("store")
	matches("a live batch", tokens(50, 4), 1)
	step("evict")
	matches("an eviction", prompt, 1)
	step("gap")
	matches("a gap replayed", tokens(80, 8), 2)
	step("loss")
	matches("after a loss, the batch that arrived", tokens(90, 4), 1)
	matches("after a loss, what was known before it", tokens(80, 8), 0)
	if s := f.Streams()[engine]; s.Gaps != 2 || s.Lost != 1 {
		t.Errorf("stream %+v: want 2 gaps, 1 lost", s)
	}
	step("clear")
	matches("a clear", tokens(50, 4), 0)
	matches("a clear", prompt, 0)
	step("store")
	matches("stored after the clear", tokens(50, 4), 1)
	step("restart")
	matches("the restarted engine's first block", tokens(70, 4), 1)
	matches("the old engine's blocks", tokens(50, 4), 0)
	if s := f.Streams()[engine]; s.Restarts+s.Reconnects != 1 {
		t.Errorf("stream %+v: want the restart seen once, as a sequence gone back or a connection lost", s)
	}
	step("quit")
}
