package kvtransfer_test

import (
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	clocktesting "k8s.io/utils/clock/testing"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer"
	"pdcluster.dev/pdcluster-operator/test/sim/vllmsched"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

type recorder struct{ got []kvtransfer.Completion }

func (r *recorder) FinishedReceiving(c kvtransfer.Completion) { r.got = append(r.got, c) }

func newPuller(t *testing.T) (*kvtransfer.Puller, *recorder, *clocktesting.FakeClock) {
	t.Helper()
	rec := &recorder{}
	clk := clocktesting.NewFakeClock(time.Unix(0, 0))
	p, err := kvtransfer.NewPuller(kvtransfer.PullerConfig{Sink: rec, Clock: clk, Timeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	return p, rec, clk
}

var errBoom = errors.New("boom")

type taskResult struct {
	rank kvtransfer.ProducerRank
	err  error
}

func TestPullerReportsOnlyDrainedPullsWithLocalBlocks(t *testing.T) {
	ranks := []kvtransfer.ProducerRank{0, 1}
	cases := []struct {
		name    string
		meta    kvtransfer.PullMeta
		results []taskResult
		want    []kvtransfer.Completion
	}{
		{name: "empty pull nil", meta: wrappers.MakePull("a").Waiting().Obj(), results: []taskResult{{0, nil}, {1, nil}}},
		{name: "empty pull [[]]", meta: wrappers.MakePull("a").Waiting().Blocks([]kvtransfer.BlockID{}).Obj(), results: []taskResult{{0, nil}, {1, nil}}},
		{name: "empty pull [[],[]]", meta: wrappers.MakePull("a").Waiting().Blocks([]kvtransfer.BlockID{}, []kvtransfer.BlockID{}).Obj(), results: []taskResult{{0, nil}, {1, nil}}},
		{name: "empty pull that fails", meta: wrappers.MakePull("a").Waiting().Blocks([]kvtransfer.BlockID{}).Obj(), results: []taskResult{{0, errBoom}, {1, nil}}},
		{name: "cleanup pull of a request not waiting", meta: wrappers.MakePull("a").Blocks([]kvtransfer.BlockID{4}).Obj(), results: []taskResult{{0, nil}, {1, nil}}},
		{
			name: "pull with blocks, all ok", meta: wrappers.MakePull("a").Waiting().Blocks([]kvtransfer.BlockID{4, 5}).Obj(),
			results: []taskResult{{1, nil}, {0, nil}},
			want:    []kvtransfer.Completion{{Request: "a"}},
		},
		{
			name: "blocks in the second group only", meta: wrappers.MakePull("a").Waiting().Blocks([]kvtransfer.BlockID{}, []kvtransfer.BlockID{9}).Obj(),
			results: []taskResult{{0, nil}, {1, nil}},
			want:    []kvtransfer.Completion{{Request: "a"}},
		},
		{
			name: "one group failing reports invalid blocks", meta: wrappers.MakePull("a").Waiting().Blocks([]kvtransfer.BlockID{4, 5}).Obj(),
			results: []taskResult{{0, errBoom}, {1, nil}},
			want:    []kvtransfer.Completion{{Request: "a", Err: errBoom, InvalidBlocks: []kvtransfer.BlockID{4, 5}}},
		},
		{
			name: "several groups failing report the request", meta: wrappers.MakePull("a").Waiting().Blocks([]kvtransfer.BlockID{4}, []kvtransfer.BlockID{4}).Obj(),
			results: []taskResult{{0, nil}, {1, errBoom}},
			want:    []kvtransfer.Completion{{Request: "a", Err: errBoom, FailedRequest: true}},
		},
		{
			name: "duplicate and foreign results change nothing", meta: wrappers.MakePull("a").Waiting().Blocks([]kvtransfer.BlockID{1}).Obj(),
			results: []taskResult{{0, nil}, {0, errBoom}, {7, errBoom}, {1, nil}},
			want:    []kvtransfer.Completion{{Request: "a"}},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p, rec, _ := newPuller(t)
			if err := p.Begin(tc.meta, ranks); err != nil {
				t.Fatal(err)
			}
			for i, r := range tc.results {
				if i == len(tc.results)-1 && len(rec.got) != 0 {
					t.Fatalf("reported %v before the last task ended", rec.got)
				}
				p.TaskDone(tc.meta.Request, tc.meta.Transfer, r.rank, r.err)
			}
			if diff := cmp.Diff(tc.want, rec.got, cmpopts.EquateErrors()); diff != "" {
				t.Errorf("completions (-want +got):\n%s", diff)
			}
			if st := p.Stats(); st.InFlight != 0 {
				t.Errorf("pull still in flight: %+v", st)
			}
		})
	}
}

// Invariant 3: a failing task does not release the blocks while another producer may write.
func TestPullerFailureWaitsForOtherWriters(t *testing.T) {
	p, rec, _ := newPuller(t)
	meta := wrappers.MakePull("a").Waiting().Blocks([]kvtransfer.BlockID{1, 2}).Obj()
	if err := p.Begin(meta, []kvtransfer.ProducerRank{0, 1, 2}); err != nil {
		t.Fatal(err)
	}
	p.TaskDone("a", meta.Transfer, 0, errBoom)
	if len(rec.got) != 0 {
		t.Fatalf("reported after the first failure: %v", rec.got)
	}
	if p.AcceptWrite("a", meta.Transfer, 0) {
		t.Error("failed task still accepts writes")
	}
	if !p.AcceptWrite("a", meta.Transfer, 1) || !p.AcceptWrite("a", meta.Transfer, 2) {
		t.Error("pending tasks refuse writes")
	}
	p.TaskDone("a", meta.Transfer, 1, nil)
	p.TaskDone("a", meta.Transfer, 2, nil)
	if len(rec.got) != 1 || !errors.Is(rec.got[0].Err, errBoom) {
		t.Fatalf("completions = %v, want one failure", rec.got)
	}
	var te *kvtransfer.TaskError
	if !errors.As(rec.got[0].Err, &te) || te.Producer != 0 {
		t.Errorf("error %v does not name producer rank 0", rec.got[0].Err)
	}
	if p.AcceptWrite("a", meta.Transfer, 1) {
		t.Error("writes accepted after the report")
	}
}

// Invariant 4: a pull whose producer never answers ends at its deadline.
func TestPullerTimeoutReportsFailure(t *testing.T) {
	p, rec, clk := newPuller(t)
	meta := wrappers.MakePull("a").Waiting().Blocks([]kvtransfer.BlockID{3}).Obj()
	if err := p.Begin(meta, []kvtransfer.ProducerRank{0, 1}); err != nil {
		t.Fatal(err)
	}
	p.TaskDone("a", meta.Transfer, 0, nil)
	clk.Step(59 * time.Second)
	if n := p.Expire(); n != 0 {
		t.Fatalf("expired %d tasks before the deadline", n)
	}
	clk.Step(time.Second)
	if n := p.Expire(); n != 1 {
		t.Fatalf("expired %d tasks, want 1", n)
	}
	want := []kvtransfer.Completion{{Request: "a", Err: kvtransfer.ErrTimeout, InvalidBlocks: []kvtransfer.BlockID{3}}}
	if diff := cmp.Diff(want, rec.got, cmpopts.EquateErrors()); diff != "" {
		t.Errorf("completions (-want +got):\n%s", diff)
	}
	if p.TaskDone("a", meta.Transfer, 1, nil) {
		t.Error("a late answer after the timeout was accepted")
	}
	if st := p.Stats(); st.TimedOutTasks != 1 || st.IgnoredTaskDones != 1 {
		t.Errorf("stats = %+v", st)
	}
}

func TestPullerWithoutProducersFailsAtOnce(t *testing.T) {
	p, rec, _ := newPuller(t)
	if err := p.Begin(wrappers.MakePull("a").Waiting().Blocks([]kvtransfer.BlockID{3}).Obj(), nil); err != nil {
		t.Fatal(err)
	}
	if err := p.Begin(wrappers.MakePull("b").Blocks().Obj(), nil); err != nil {
		t.Fatal(err)
	}
	if len(rec.got) != 1 || !errors.Is(rec.got[0].Err, kvtransfer.ErrNoProducers) {
		t.Fatalf("completions = %v, want one ErrNoProducers for a", rec.got)
	}
}

func TestPullerRefusesSecondPullOfARequest(t *testing.T) {
	p, _, _ := newPuller(t)
	meta := wrappers.MakePull("a").Waiting().Blocks([]kvtransfer.BlockID{3}).Obj()
	if err := p.Begin(meta, []kvtransfer.ProducerRank{0}); err != nil {
		t.Fatal(err)
	}
	if err := p.Begin(meta, []kvtransfer.ProducerRank{0}); !errors.Is(err, kvtransfer.ErrDuplicateRequest) {
		t.Errorf("err = %v, want ErrDuplicateRequest", err)
	}
}

func TestPullerFailTasksOfALostProducer(t *testing.T) {
	p, rec, _ := newPuller(t)
	for _, id := range []string{"a", "b"} {
		if err := p.Begin(wrappers.MakePull(id).Waiting().Blocks([]kvtransfer.BlockID{1}).Obj(), []kvtransfer.ProducerRank{0, 1}); err != nil {
			t.Fatal(err)
		}
	}
	p.TaskDone("a", "x-a", 0, nil)
	p.TaskDone("b", "x-b", 1, nil)
	n := p.FailTasks(func(_ kvtransfer.PullMeta, r kvtransfer.ProducerRank) bool { return r == 1 }, kvtransfer.ErrPeerGone)
	if n != 1 {
		t.Fatalf("failed %d tasks, want 1 (a's rank 1)", n)
	}
	if len(rec.got) != 1 || rec.got[0].Request != "a" || !errors.Is(rec.got[0].Err, kvtransfer.ErrPeerGone) {
		t.Errorf("completions = %v, want a failed with ErrPeerGone", rec.got)
	}
}

// The empty pull, end to end through the vLLM model: a decode leg the API server refused is
// submitted pre-aborted, and the next step sends its cleanup pull with no local block, which
// only notifies the producer. Reporting it kills the engine (the request is gone); the Puller
// does not report it, and the engine serves the next request. Real vLLM:
// test/realengine testRejectedDecodeLeg (stock 0.30.0 dies, gated survives).
func TestRefusedDecodeLegPullNeverCompletes(t *testing.T) {
	var pulls []kvtransfer.PullMeta
	newDecode := func() *vllmsched.Scheduler {
		s, err := vllmsched.New(vllmsched.Config{Role: vllm.KVConsumer, BlockSize: 64, Capacity: 16,
			OnPull: func(m kvtransfer.PullMeta) { pulls = append(pulls, m) }})
		if err != nil {
			t.Fatal(err)
		}
		if err := s.AddAborted("refused", "xfer-refused"); err != nil {
			t.Fatal(err)
		}
		if running := s.Schedule(); len(running) != 0 {
			t.Fatalf("running = %v, want nothing: the refused request never runs", running)
		}
		return s
	}

	naive := newDecode()
	if len(pulls) != 1 || pulls[0].LocalBlock.HasLocal() || pulls[0].WaitingForRemote {
		t.Fatalf("pulls = %+v, want one empty notify-only pull", pulls)
	}
	naive.FinishedReceiving(kvtransfer.Completion{Request: "refused"}) // what an ungated connector does
	if err := naive.Dead(); !errors.Is(err, vllmsched.ErrEngineDead) {
		t.Fatalf("ungated completion: engine error = %v, want it dead", err)
	}

	pulls = nil
	gated := newDecode()
	p, err := kvtransfer.NewPuller(kvtransfer.PullerConfig{Sink: gated, Timeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Begin(pulls[0], []kvtransfer.ProducerRank{0}); err != nil {
		t.Fatal(err)
	}
	p.TaskDone("refused", "xfer-refused", 0, nil)
	if err := gated.Dead(); err != nil {
		t.Fatalf("gated connector killed the engine: %v", err)
	}
	if st := p.Stats(); st.NotifiedOnly != 1 || st.Completed != 0 {
		t.Errorf("stats = %+v, want one notify-only pull", st)
	}
	if err := gated.Add("next", "", 100, 0); err != nil {
		t.Fatal(err)
	}
	if running := gated.Schedule(); len(running) != 1 {
		t.Errorf("the next request: running = %v, want it", running)
	}
}

// Invariant 3, for the data plane: a write runs only while its task is pending, and no report
// can slip in between the check and the write.
func TestPullerWriteIfAccepted(t *testing.T) {
	p, rec, clk := newPuller(t)
	meta := wrappers.MakePull("a").Waiting().Blocks([]kvtransfer.BlockID{1}).Obj()
	if err := p.Begin(meta, []kvtransfer.ProducerRank{0}); err != nil {
		t.Fatal(err)
	}
	wrote := 0
	ok, err := p.WriteIfAccepted("a", meta.Transfer, 0, func() error {
		wrote++
		if len(rec.got) != 0 {
			t.Error("a completion was reported during the write")
		}
		return nil
	})
	if !ok || err != nil || wrote != 1 {
		t.Fatalf("pending task: ran %v (%d writes), err %v", ok, wrote, err)
	}
	if _, err := p.WriteIfAccepted("a", meta.Transfer, 0, func() error { return errBoom }); !errors.Is(err, errBoom) {
		t.Errorf("write error not returned: %v", err)
	}
	clk.Step(time.Hour)
	p.Expire()
	ok, _ = p.WriteIfAccepted("a", meta.Transfer, 0, func() error { wrote++; return nil })
	if ok || wrote != 1 {
		t.Errorf("write after the timeout ran (%v, %d writes)", ok, wrote)
	}
	if ok, _ := p.WriteIfAccepted("b", meta.Transfer, 0, func() error { return nil }); ok {
		t.Error("write for an unknown request ran")
	}
}

// Invariant 3 across goroutines: a task failed from outside (expiry) while one of its blocks
// is being written reports the pull only after that write ends, and no write starts after.
func TestFailedTaskWaitsForTheWriteInProgress(t *testing.T) {
	var mu sync.Mutex
	var got []kvtransfer.Completion
	p, err := kvtransfer.NewPuller(kvtransfer.PullerConfig{Timeout: time.Minute, Sink: kvtransfer.CompletionFunc(func(c kvtransfer.Completion) {
		mu.Lock()
		got = append(got, c)
		mu.Unlock()
	})})
	if err != nil {
		t.Fatal(err)
	}
	meta := kvtransfer.PullMeta{Request: "r", Transfer: "x", LocalBlock: kvtransfer.BlockIDs{{1}}, WaitingForRemote: true}
	if err := p.Begin(meta, []kvtransfer.ProducerRank{0}); err != nil {
		t.Fatal(err)
	}
	writing, release := make(chan struct{}), make(chan struct{})
	wrote := make(chan bool, 1)
	go func() {
		ran, _ := p.WriteIfAccepted("r", "x", 0, func() error {
			close(writing)
			<-release
			return nil
		})
		wrote <- ran
	}()
	<-writing
	failed := make(chan int, 1)
	go func() {
		failed <- p.FailTasks(func(kvtransfer.PullMeta, kvtransfer.ProducerRank) bool { return true }, kvtransfer.ErrPeerGone)
	}()
	time.Sleep(50 * time.Millisecond) // FailTasks is now waiting for the write
	mu.Lock()
	early := len(got)
	mu.Unlock()
	if early != 0 {
		t.Fatalf("the pull was reported while its block was being written: %+v", got)
	}
	close(release)
	if n := <-failed; n != 1 || !<-wrote {
		t.Fatalf("FailTasks ended %d tasks, write ran: want 1 and true", n)
	}
	if ran, _ := p.WriteIfAccepted("r", "x", 0, func() error { return nil }); ran {
		t.Error("a write ran after the pull was reported")
	}
	mu.Lock()
	defer mu.Unlock()
	if len(got) != 1 || got[0].Err == nil {
		t.Fatalf("completions = %+v, want one failure", got)
	}
}
