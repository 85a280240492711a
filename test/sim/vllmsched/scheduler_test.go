package vllmsched

import (
	"errors"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

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

// The pull a consumer request gets depends on what it must load: whole remote blocks beyond
// its local prefix hit. With none, the request runs at once and the pull is notify-only.
func TestPullsFollowTheWholeBlocksToLoad(t *testing.T) {
	cases := []struct {
		name        string
		prompt, hit int
		wantBlocks  int // local destination blocks in the pull
		wantWaiting bool
		wantStatus  Status
	}{
		{"13 tokens with 64-token blocks: nothing to load", 13, 0, 0, false, Running},
		{"200 tokens: three whole blocks", 200, 0, 3, true, WaitingForRemoteKVs},
		{"full local prefix hit: nothing to load", 200, 200, 0, false, Running},
		{"partial hit loads the rest", 200, 64, 2, true, WaitingForRemoteKVs},
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
			if (tc.wantStatus == Running) != (len(running) == 1) {
				t.Errorf("running = %v", running)
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
		{"completion for a running request (the seed bug)", func(s *Scheduler) { _ = s.Add("r", "x", 13, 0); s.Schedule() }, "assert request.is_finished()"},
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
				if st := s.Stats(); st.Completions != 1 {
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

// A consumer request aborted before its first schedule still tells the producer to release:
// a notify-only cleanup pull.
func TestAbortBeforeScheduleEmitsCleanupPull(t *testing.T) {
	s, pulls := consumer(t, PolicyFail)
	_ = s.Add("r", "x", 200, 0)
	if err := s.Abort("r"); err != nil {
		t.Fatal(err)
	}
	want := []kvtransfer.PullMeta{{Request: "r", Transfer: "x"}}
	if d := cmp.Diff(want, *pulls); d != "" {
		t.Errorf("pulls (-want +got):\n%s", d)
	}
	if (*pulls)[0].NotifiesScheduler() {
		t.Error("a cleanup pull must not notify the scheduler")
	}
}

// The producer holds whole blocks of a length-capped prefill request for the consumer, and
// frees them on FinishedSending; a release of a request it does not hold kills it.
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
	s.Schedule()
	if err := s.Finish("big", FinishedLengthCapped); err != nil {
		t.Fatal(err)
	}
	if err := s.Finish("small", FinishedLengthCapped); err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff([]hold{{"x1", 3}}, holds, cmp.AllowUnexported(hold{})); d != "" {
		t.Errorf("holds (-want +got):\n%s", d)
	}
	if d := cmp.Diff([]kvtransfer.TransferID{"x2"}, drops); d != "" {
		t.Errorf("drops (-want +got):\n%s", d)
	}
	s.FinishedSending(kvtransfer.Release{Request: "big"})
	if st := s.Stats(); st.FreeBlocks != 16 || s.Dead() != nil {
		t.Fatalf("stats %+v dead %v, want every block free", st, s.Dead())
	}
	s.FinishedSending(kvtransfer.Release{Request: "big"})
	if err := s.Dead(); err == nil || !strings.Contains(err.Error(), "holds no blocks") {
		t.Errorf("second release: Dead() = %v, want the assertion", err)
	}
}

// Prompt tokens are counted by source as vLLM's PromptTokenStats does when the prefill runs:
// pulled whole blocks are external, a local prefix hit is a cache hit, the rest (the partial
// last block; the whole prompt when the pull failed and is recomputed) is computed here. A
// request failed by the fail policy never prefills and counts nothing.
func TestPromptTokensBySource(t *testing.T) {
	cases := []struct {
		name        string
		policy      Policy
		prompt, hit int
		transfer    kvtransfer.TransferID
		pullErr     error
		want        PromptTokens
	}{
		{"pulled: three whole blocks external, the partial block computed", PolicyFail, 200, 0, "x", nil, PromptTokens{ExternalKV: 192, LocalCompute: 8}},
		{"partial local hit, the rest pulled", PolicyFail, 200, 64, "x", nil, PromptTokens{LocalCacheHit: 64, ExternalKV: 128, LocalCompute: 8}},
		{"no P/D: all computed", PolicyFail, 200, 0, "", nil, PromptTokens{LocalCompute: 200}},
		{"short prompt: nothing to pull, computed", PolicyFail, 13, 0, "x", nil, PromptTokens{LocalCompute: 13}},
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
