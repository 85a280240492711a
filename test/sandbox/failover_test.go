package sandbox_test

import (
	"context"
	"net/http"
	"sync"
	"syscall"
	"testing"
	"time"
)

// loadResult is one request of a load loop and when it started.
type loadResult struct {
	result
	started time.Time
}

// loadUntil sends requests from clients loops until stop, each loop one request at a time.
func loadUntil(b *box, clients int, stop time.Time) []loadResult {
	var mu sync.Mutex
	var out []loadResult
	var wg sync.WaitGroup
	for c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; time.Now().Before(stop); i++ {
				started := time.Now()
				r := post(context.Background(), b.state.Router+"/v1/completions", map[string]any{
					"prompt": tokens(16*8, 100_000*c+1_000*i), "max_tokens": 4, "ignore_eos": true,
				})
				mu.Lock()
				out = append(out, loadResult{r, started})
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return out
}

// A prefill engine killed under load loses only the requests it had in flight: with two
// prefill engines, every request sent after the kill is served (the router retries it on the
// other engine and ejects the dead one; those in flight are mostly saved too). With
// onPrefillFailure Fail the same kill fails requests, so the test can fail.
func TestPrefillKilledUnderLoad(t *testing.T) {
	for _, tc := range []struct {
		policy    string
		wantFails bool
	}{{"Retry", false}, {"Fail", true}} {
		t.Run(tc.policy, func(t *testing.T) {
			b := start(t, "--prefill", "2", "--block-size", "16", "--send-delay", "1ms", "--on-prefill-failure", tc.policy,
				"--hold-timeout", "3s", "--pull-timeout", "5s")
			start := time.Now()
			kill := start.Add(500 * time.Millisecond)
			go func() {
				time.Sleep(time.Until(kill))
				_ = syscall.Kill(b.state.Prefill[0].EnginePID, syscall.SIGKILL)
			}()
			results := loadUntil(b, 4, start.Add(3*time.Second))
			var inFlight, late, ok int
			for _, r := range results {
				switch {
				case r.status == http.StatusOK && r.tokens == 4:
					ok++
				case r.started.Before(kill):
					inFlight++
				default:
					late++
					if !tc.wantFails {
						t.Errorf("request sent %s after the kill failed: %d %v %s", r.started.Sub(kill).Round(time.Millisecond), r.status, r.err, tail(r.body, 300))
					}
				}
			}
			t.Logf("onPrefillFailure %s: %d requests, %d ok, %d failed in flight at the kill, %d failed after it", tc.policy, len(results), ok, inFlight, late)
			if ok == 0 || ok+inFlight+late != len(results) {
				t.Fatalf("%d of %d ok", ok, len(results))
			}
			if tc.wantFails && inFlight+late == 0 {
				t.Errorf("with onPrefillFailure Fail no request failed: the kill did not reach the router's path")
			}
			if got := metric(t, b.state.Router, "pdcluster_router_ejections_total", "pool", "prefill"); got == 0 {
				t.Error("the killed prefill engine was never ejected")
			}
			if tc.policy == "Retry" && metric(t, b.state.Router, "pdcluster_router_retries_total") == 0 {
				t.Error("no request was retried: the kill came too late to test anything")
			}
		})
	}
}
