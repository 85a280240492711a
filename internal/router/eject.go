// Outlier ejection: an endpoint that failed in a way that says it is not there or not serving
// is left out at once, for FailurePolicy.Eject, not until the next resolution of the pools.

package router

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"k8s.io/utils/clock"
)

// ejector holds the ejected endpoints by URL. out is on every pick: with nothing ejected it is
// one atomic load.
type ejector struct {
	clock clock.PassiveClock
	n     atomic.Int32 // entries in until
	mu    sync.Mutex
	until map[string]time.Time
}

func newEjector(c clock.PassiveClock) *ejector {
	return &ejector{clock: c, until: map[string]time.Time{}}
}

// out reports whether url is ejected now; an ejection past its time ends here.
func (e *ejector) out(url string) bool {
	if e.n.Load() == 0 {
		return false
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	t, ok := e.until[url]
	if ok && !e.clock.Now().Before(t) {
		delete(e.until, url)
		e.n.Add(-1)
		return false
	}
	return ok
}

// eject leaves url out for d; it reports whether url was not ejected already.
func (e *ejector) eject(url string, d time.Duration) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	_, was := e.until[url]
	if !was {
		e.n.Add(1)
	}
	e.until[url] = e.clock.Now().Add(d)
	return !was
}

// restore ends url's ejection (its health check answered).
func (e *ejector) restore(url string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if _, ok := e.until[url]; ok {
		delete(e.until, url)
		e.n.Add(-1)
	}
}

// returnsIn is the time until the first of urls comes back (for Retry-After).
func (e *ejector) returnsIn(urls []string) time.Duration {
	e.mu.Lock()
	defer e.mu.Unlock()
	var first time.Duration
	for _, u := range urls {
		if t, ok := e.until[u]; ok {
			if d := t.Sub(e.clock.Now()); first == 0 || d < first {
				first = max(d, time.Second)
			}
		}
	}
	return first
}

// count is how many endpoints are ejected now.
func (e *ejector) count() int { return int(e.n.Load()) }

// probeEvery is how often an endpoint ejected for not being there is asked whether it is back.
const probeEvery = 500 * time.Millisecond

// watch asks an endpoint that was not there (refused, reset, bootstrap down) whether it is back
// and ends its ejection as soon as check succeeds: a restarted engine at the same address
// serves again at once, not after the whole ejection. An endpoint that answered 503 is serving
// a verdict, not absent: it waits out its ejection.
func (r *Router) watch(url string, check func(context.Context) error) {
	t := time.NewTicker(r.probeEvery)
	defer t.Stop()
	for range t.C {
		if !r.eject.out(url) {
			return // its ejection ended
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		err := check(ctx)
		cancel()
		if err == nil {
			r.eject.restore(url)
			r.log.Info("ejected endpoint answers again", "endpoint", url)
			return
		}
	}
}

var errNotHealthy = errors.New("health check failed")

// healthCheck is an engine's GET /health.
func (r *Router) healthCheck(url string) func(context.Context) error {
	return func(ctx context.Context) error {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url+"/health", nil)
		if err != nil {
			return err
		}
		resp, err := r.hc.Do(req)
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return errNotHealthy
		}
		return nil
	}
}
