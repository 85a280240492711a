package link

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer/agentapi"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

// The Link: an agent that restarts loses its pulls and holds; the engine hears of each once.
func TestLinkFailsWhatARestartedAgentLost(t *testing.T) {
	var mu sync.Mutex
	epoch := "run-1"
	var pending []agentapi.Completion
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		switch r.URL.Path {
		case agentapi.PathEvents:
			_ = json.NewEncoder(w).Encode(agentapi.Events{Epoch: epoch, Completions: pending})
			pending = nil
		default:
			_ = json.NewEncoder(w).Encode(agentapi.EpochReply{Epoch: epoch})
		}
	}))
	defer srv.Close()
	comp, rel := wrappers.NewSink(), wrappers.NewSink()
	l := New(srv.URL, comp, rel)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go l.Run(ctx)

	_ = l.Pull(ctx, agentapi.Pull{Request: "a", Transfer: "x", Blocks: kvtransfer.BlockIDs{{1}}, WaitingForRemote: true})
	_ = l.Pull(ctx, agentapi.Pull{Request: "quiet", Transfer: "y", WaitingForRemote: true}) // notify-only: never tracked
	_ = l.Ready(ctx, "h", "p", kvtransfer.BlockIDs{{4, 5}})
	mu.Lock()
	epoch = "run-2" // the agent restarted
	mu.Unlock()
	comp.Wait(t, 1, "lost pull failed")
	rel.Wait(t, 1, "lost hold released")
	// The dead run's report, if it ever came, must not be delivered a second time.
	mu.Lock()
	pending = []agentapi.Completion{{Request: "a"}}
	mu.Unlock()
	time.Sleep(1500 * time.Millisecond)
	if c := comp.Completions(); len(c) != 1 || !errors.Is(c[0].Err, ErrAgentLost) || c[0].Request != "a" {
		t.Errorf("completions = %+v, want one ErrAgentLost for a", c)
	}
	if r := rel.Releases(); len(r) != 1 || r[0].Request != "p" || r[0].Blocks != 2 {
		t.Errorf("releases = %+v, want one for p", r)
	}
	if pulls, holds := l.Outstanding(); pulls != 0 || holds != 0 {
		t.Errorf("outstanding %d pulls %d holds, want none", pulls, holds)
	}
}
