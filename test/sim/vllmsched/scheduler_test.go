package vllmsched

import (
	"errors"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer"
)

// consumer is a decode scheduler with 64-token blocks and 16 blocks that records its pulls.
func consumer(t *testing.T, policy Policy) (*Scheduler, *[]kvtransfer.PullMeta) {
	t.Helper()
	var pulls []kvtransfer.PullMeta
	s, err := New(Config{Role: vllm.KVConsumer, BlockSize: 64, Capacity: 16, Policy: policy,
		OnPull: func(p kvtransfer.PullMeta) { pulls = append(pulls, p) }})
	if err != nil {
		t.Fatal(err)
	}
	return s, &pulls
}

func TestNewRejectsEmptyGeometry(t *testing.T) {
	for _, cfg := range []Config{{BlockSize: 0, Capacity: 4}, {BlockSize: 16, Capacity: 0}} {
		if _, err := New(cfg); err == nil {
			t.Errorf("New(%+v) succeeded, want an error", cfg)
		}
	}
}

// The pull a consumer request gets is every block past its local prefix hit, the partial last
// one included; the hit never covers the last prompt token, so there is always one to load and
// the request waits for it. Real vLLM: test/realengine testNormal (100 tokens, 64-token
// blocks: all 100 external) and testPrefixHit (192 tokens twice: 128 cached, 64 pulled).
func TestPullsLoadEveryBlockPastTheLocalHit(t *testing.T) {
	cases := []struct {
		name        string
		prompt, hit int
		wantBlocks  int // local destination blocks in the pull
		wantWaiting bool
		wantStatus  Status
	}{
		{"13 tokens with 64-token blocks: the partial block", 13, 0, 1, true, WaitingForRemoteKVs},
		{"200 tokens: three whole blocks and a partial one", 200, 0, 4, true, WaitingForRemoteKVs},
		{"the prompt all in the prefix cache: its last block still loads", 192, 192, 1, true, WaitingForRemoteKVs},
		{"partial hit loads the rest", 200, 64, 3, true, WaitingForRemoteKVs},
		{"a hit inside a block counts whole blocks only", 200, 100, 3, true, WaitingForRemoteKVs},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s, pulls := consumer(t, PolicyFail)
			if err := s.Add("r", "x", tc.prompt, tc.hit); err != nil {
				t.Fatal(err)
			}
			running := s.Schedule()
			if len(*pulls) != 1 {
				t.Fatalf("%d pulls, want 1", len(*pulls))
			}
			p := (*pulls)[0]
			if got := p.LocalBlock.Count(); got != tc.wantBlocks || p.WaitingForRemote != tc.wantWaiting {
				t.Errorf("pull has %d blocks, waiting %v; want %d, %v", got, p.WaitingForRemote, tc.wantBlocks, tc.wantWaiting)
			}
			r, _ := s.Lookup("r")
			if r.Status != tc.wantStatus {
				t.Errorf("status %s, want %s", r.Status, tc.wantStatus)
			}
			if len(running) != 0 {
				t.Errorf("running = %v, want none before the pull completes", running)
			}
		})
	}
}

// vLLM's two assertions in _update_from_kv_xfer_finished: the request must exist, and a
// completion for a request not waiting for remote KV must find it finished. Either kills the
// engine, and everything after fails with ErrEngineDead.
func TestCompletionAssertions(t *testing.T) {
	cases := []struct {
		name    string
		setup   func(s *Scheduler)
		wantErr string // "" when the completion is accepted
	}{
		{"completion for a waiting request", func(s *Scheduler) { _ = s.Add("r", "x", 200, 0); s.Schedule() }, ""},
		{"completion for an unknown request", func(*Scheduler) {}, "assert req_id in self.requests"},
		{"completion for a running request", func(s *Scheduler) {
			_ = s.Add("r", "x", 200, 0)
			s.Schedule()
			s.FinishedReceiving(kvtransfer.Completion{Request: "r"})
			s.Schedule()
		}, "assert request.is_finished()"},
		{"completion for a request that was never scheduled (a refused decode leg)", func(s *Scheduler) {
			_ = s.AddAborted("r", "x")
			s.Schedule()
		}, "assert req_id in self.requests"},
		{"completion for a request aborted while waiting frees it", func(s *Scheduler) {
			_ = s.Add("r", "x", 200, 0)
			s.Schedule()
			_ = s.Abort("r")
		}, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s, _ := consumer(t, PolicyFail)
			tc.setup(s)
			s.FinishedReceiving(kvtransfer.Completion{Request: "r"})
			err := s.Dead()
			if tc.wantErr == "" {
				if err != nil {
					t.Fatalf("engine died: %v", err)
				}
				if st := s.Stats(); st.Completions < 1 {
					t.Errorf("completions = %d, want 1", st.Completions)
				}
				return
			}
			if !errors.Is(err, ErrEngineDead) || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("Dead() = %v, want %q", err, tc.wantErr)
			}
			if err := s.Add("next", "y", 10, 0); !errors.Is(err, ErrEngineDead) {
				t.Errorf("Add after death = %v, want ErrEngineDead", err)
			}
		})
	}
}

// After a completion, the next step resumes the request (success or recompute) or ends it
// with an error (fail policy); all blocks come back once it finishes.
func TestWaitingRequestResumesByThePolicy(t *testing.T) {
	cases := []struct {
		name       string
		policy     Policy
		pullErr    error
		wantStatus Status
		wantGone   bool
	}{
		{"success", PolicyFail, nil, Running, false},
		{"failed pull, fail policy", PolicyFail, errors.New("boom"), FinishedError, true},
		{"failed pull, recompute policy", PolicyRecompute, errors.New("boom"), Running, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s, _ := consumer(t, tc.policy)
			_ = s.Add("r", "x", 200, 0)
			s.Schedule()
			s.FinishedReceiving(kvtransfer.Completion{Request: "r", Err: tc.pullErr})
			s.Schedule()
			r, ok := s.Lookup("r")
			if tc.wantGone {
				if ok {
					t.Fatalf("request still there as %s", r.Status)
				}
				if st := s.Stats(); st.Errored != 1 || st.FreeBlocks != 16 {
					t.Errorf("stats %+v, want one errored request and every block free", st)
				}
				return
			}
			if r.Status != tc.wantStatus {
				t.Fatalf("status %s, want %s", r.Status, tc.wantStatus)
			}
			if err := s.Finish("r", FinishedStopped); err != nil {
				t.Fatal(err)
			}
			if st := s.Stats(); st.FreeBlocks != 16 || st.Requests != 0 {
				t.Errorf("stats %+v, want every block free", st)
			}
		})
	}
}

// A consumer request that ends before its first schedule still tells the producer to release:
// a cleanup pull with no local block, which does not make an idle engine step (its report
// waits for the next request's step). Real vLLM: test/realengine testRejectedDecodeLeg and
// testAbortWhileWaiting (the stock 0.30 engine dies at the next request's step).
func TestRequestEndedBeforeScheduleSendsACleanupPull(t *testing.T) {
	for name, end := range map[string]func(*Scheduler) error{
		"client abort while waiting": func(s *Scheduler) error {
			if err := s.Add("r", "x", 200, 0); err != nil {
				return err
			}
			return s.Abort("r")
		},
		"refused by the API server (abort_immediately)": func(s *Scheduler) error { return s.AddAborted("r", "x") },
	} {
		t.Run(name, func(t *testing.T) {
			s, pulls := consumer(t, PolicyFail)
			if err := end(s); err != nil {
				t.Fatal(err)
			}
			want := []kvtransfer.PullMeta{{Request: "r", Transfer: "x"}}
			if d := cmp.Diff(want, *pulls); d != "" {
				t.Errorf("pulls (-want +got):\n%s", d)
			}
			if (*pulls)[0].NotifiesScheduler() {
				t.Error("a cleanup pull must not notify the scheduler")
			}
			if s.HasRequests() {
				t.Error("a cleanup pull made the engine step: an idle vLLM engine does not")
			}
			if st := s.Stats(); st.FreeBlocks != 16 || st.Requests != 0 {
				t.Errorf("stats %+v, want every block free and no request", st)
			}
		})
	}
}

// --max-num-seqs: a request past it waits in WAITING with no blocks, which is where a client
// abort makes a cleanup pull (test/realengine testAbortWhileWaiting fills decode's 4).
func TestMaxNumSeqsKeepsRequestsWaitingWithoutBlocks(t *testing.T) {
	var pulls []kvtransfer.PullMeta
	s, err := New(Config{Role: vllm.KVConsumer, BlockSize: 64, Capacity: 16, MaxNumSeqs: 1,
		OnPull: func(p kvtransfer.PullMeta) { pulls = append(pulls, p) }})
	if err != nil {
		t.Fatal(err)
	}
	_ = s.Add("long", "", 64, 0)
	if got := s.Schedule(); len(got) != 1 {
		t.Fatalf("running %v, want the long request", got)
	}
	_ = s.Add("pd", "x", 100, 0)
	if got := s.Schedule(); len(got) != 1 || got[0] != "long" {
		t.Fatalf("running %v, want only the long request", got)
	}
	r, _ := s.Lookup("pd")
	if r.Status != Waiting || len(r.Blocks) != 0 || len(pulls) != 0 {
		t.Fatalf("the second request is %s with %d blocks, %d pulls; want WAITING, none, none", r.Status, len(r.Blocks), len(pulls))
	}
	if err := s.Finish("long", FinishedStopped); err != nil {
		t.Fatal(err)
	}
	s.Schedule()
	if r, _ := s.Lookup("pd"); r.Status != WaitingForRemoteKVs || len(pulls) != 1 || pulls[0].LocalBlock.Count() != 2 {
		t.Errorf("once a slot is free: %s, pulls %v; want WAITING_FOR_REMOTE_KVS and one pull of 2 blocks", r.Status, pulls)
	}
}

// The producer holds every block of a length-capped prefill request (the partial last one
// included) for the consumer, and frees them on FinishedSending; a request that stopped
// before its cap holds nothing; a release of a request it does not hold kills it. Real vLLM:
// test/realengine testHeldSends.
func TestProducerHoldsAndReleases(t *testing.T) {
	type hold struct {
		transfer kvtransfer.TransferID
		blocks   int
	}
	var holds []hold
	var drops []kvtransfer.TransferID
	s, err := New(Config{Role: vllm.KVProducer, BlockSize: 64, Capacity: 16,
		OnHold: func(x kvtransfer.TransferID, _ kvtransfer.RequestID, b kvtransfer.BlockIDs) {
			holds = append(holds, hold{x, b.Count()})
		},
		OnDrop: func(x kvtransfer.TransferID, _ kvtransfer.RequestID, _ bool) { drops = append(drops, x) }})
	if err != nil {
		t.Fatal(err)
	}
	_ = s.Add("big", "x1", 200, 0)
	_ = s.Add("small", "x2", 13, 0)
	_ = s.Add("stopped", "x3", 100, 0)
	s.Schedule()
	for id, st := range map[kvtransfer.RequestID]Status{"big": FinishedLengthCapped, "small": FinishedLengthCapped, "stopped": FinishedStopped} {
		if err := s.Finish(id, st); err != nil {
			t.Fatal(err)
		}
	}
	if d := cmp.Diff([]hold{{"x1", 4}, {"x2", 1}}, holds, cmp.AllowUnexported(hold{}), cmpopts.SortSlices(func(a, b hold) bool { return a.transfer < b.transfer })); d != "" {
		t.Errorf("holds (-want +got):\n%s", d)
	}
	if d := cmp.Diff([]kvtransfer.TransferID{"x3"}, drops); d != "" {
		t.Errorf("drops (-want +got):\n%s", d)
	}
	s.FinishedSending(kvtransfer.Release{Request: "big"})
	s.FinishedSending(kvtransfer.Release{Request: "small"})
	if st := s.Stats(); st.FreeBlocks != 16 || s.Dead() != nil {
		t.Fatalf("stats %+v dead %v, want every block free", st, s.Dead())
	}
	s.FinishedSending(kvtransfer.Release{Request: "big"})
	if err := s.Dead(); err == nil || !strings.Contains(err.Error(), "holds no blocks") {
		t.Errorf("second release: Dead() = %v, want the assertion", err)
	}
}

// Prompt tokens are counted by source as vLLM's PromptTokenStats does when the prefill runs:
// a local prefix hit (whole blocks, never the last token) is a cache hit, every other token of
// a pull is external (the last one too, though vLLM computes it again), a prompt without P/D
// or whose pull failed and is recomputed is computed here. A request failed by the fail
// policy never prefills and counts nothing. Real vLLM: test/realengine testNormal (100 of 100
// external) and testPrefixHit (128 cached, 64 external, 0 computed).
func TestPromptTokensBySource(t *testing.T) {
	cases := []struct {
		name        string
		policy      Policy
		prompt, hit int
		transfer    kvtransfer.TransferID
		pullErr     error
		want        PromptTokens
	}{
		{"pulled: every token external, the partial block too", PolicyFail, 100, 0, "x", nil, PromptTokens{ExternalKV: 100}},
		{"partial local hit, the rest pulled", PolicyFail, 200, 64, "x", nil, PromptTokens{LocalCacheHit: 64, ExternalKV: 136}},
		{"whole blocks in the prefix cache: the last block still pulled", PolicyFail, 192, 192, "x", nil, PromptTokens{LocalCacheHit: 128, ExternalKV: 64}},
		{"no P/D: all computed", PolicyFail, 200, 0, "", nil, PromptTokens{LocalCompute: 200}},
		{"no P/D, a prefix hit: the rest computed", PolicyFail, 192, 192, "", nil, PromptTokens{LocalCacheHit: 128, LocalCompute: 64}},
		{"short prompt: its partial block pulled", PolicyFail, 13, 0, "x", nil, PromptTokens{ExternalKV: 13}},
		{"failed pull recomputed", PolicyRecompute, 200, 0, "x", errors.New("boom"), PromptTokens{LocalCompute: 200}},
		{"failed pull, fail policy: nothing prefilled", PolicyFail, 200, 0, "x", errors.New("boom"), PromptTokens{}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s, _ := consumer(t, tc.policy)
			if err := s.Add("r", tc.transfer, tc.prompt, tc.hit); err != nil {
				t.Fatal(err)
			}
			s.Schedule()
			if r, _ := s.Lookup("r"); r.Status == WaitingForRemoteKVs {
				s.FinishedReceiving(kvtransfer.Completion{Request: "r", Err: tc.pullErr})
				s.Schedule()
			}
			if d := cmp.Diff(tc.want, s.Stats().Tokens); d != "" {
				t.Errorf("prompt tokens (-want +got):\n%s", d)
			}
		})
	}
}
