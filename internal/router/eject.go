// Outlier ejection: an endpoint that failed in a way that says it is not there or not serving,
// FailurePolicy.ConsecutiveFailures times in a row (one that refuses connections: once), is left
// out for FailurePolicy.Eject, not until the next resolution of the pools; never the last one of
// its pool still in (Envoy's max ejection percent: a pool of one serves on, and each of its
// failures is the engine's own answer rather than the router's 503 for ejectSeconds).

package router

import (
	"context"
	"errors"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/singleflight"
	"k8s.io/utils/clock"
)

// ejector holds the ejected endpoints by URL. out is on every pick: with nothing ejected it is
// one atomic load.
type ejector struct {
	clock  clock.PassiveClock
	n      atomic.Int32 // entries in ejects
	mu     sync.Mutex
	ejects map[string]ejection
	// fails are the failures in a row of endpoints not ejected; failing is its size, so that an
	// answer on the happy path costs one atomic load.
	fails   map[string]int
	failing atomic.Int32
	// rechecks runs one health check per endpoint at a time, however many requests ask.
	rechecks singleflight.Group
}

// ejection is an endpoint left out until a time; check, when not nil, tells when it is back
// sooner (it was not there, rather than answering 503).
type ejection struct {
	until time.Time
	check func(context.Context) error
}

func newEjector(c clock.PassiveClock) *ejector {
	return &ejector{clock: c, ejects: map[string]ejection{}, fails: map[string]int{}}
}

// out reports whether url is ejected now; an ejection past its time ends here.
func (e *ejector) out(url string) bool {
	if e.n.Load() == 0 {
		return false
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	j, ok := e.ejects[url]
	if ok && !e.clock.Now().Before(j.until) {
		delete(e.ejects, url)
		e.n.Add(-1)
		return false
	}
	return ok
}

// ejectOutcome is what a failure did to its endpoint.
type ejectOutcome int

const (
	// counted: a failure in a row, short of the policy's.
	counted ejectOutcome = iota
	// ejected: left out now.
	ejected
	// ejectedAlready: left out before (another request's failure).
	ejectedAlready
	// withheld: due, but every other endpoint of its pool is out: it serves on.
	withheld
)

// failed counts a failure of url, an endpoint of pool (every URL of it, as the request saw it),
// and leaves it out for d once it has failed after times in a row, unless it is the last of its
// pool not left out (check: see ejection).
func (e *ejector) failed(url string, pool []string, after int, d time.Duration, check func(context.Context) error) ejectOutcome {
	e.mu.Lock()
	defer e.mu.Unlock()
	now := e.clock.Now()
	if j, ok := e.ejects[url]; ok && now.Before(j.until) {
		return ejectedAlready
	}
	if _, ok := e.fails[url]; !ok {
		e.failing.Add(1)
	}
	e.fails[url]++
	if e.fails[url] < max(after, 1) {
		return counted
	}
	in := 0
	for _, u := range pool {
		if j, ok := e.ejects[u]; u != url && (!ok || !now.Before(j.until)) {
			in++
		}
	}
	if in == 0 {
		return withheld // its failures stay counted: the next one asks again
	}
	delete(e.fails, url)
	e.failing.Add(-1)
	if _, was := e.ejects[url]; !was {
		e.n.Add(1)
	}
	e.ejects[url] = ejection{until: now.Add(d), check: check}
	return ejected
}

// answered ends url's failures in a row: it served.
func (e *ejector) answered(url string) {
	if e.failing.Load() == 0 {
		return
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if _, ok := e.fails[url]; ok {
		delete(e.fails, url)
		e.failing.Add(-1)
	}
}

// recheck runs the checks of the ejected endpoints among urls and restores those that answer;
// it reports whether any came back. It is asked when a pool has no endpoint left, so that a
// pool of one engine serves again as soon as that engine does, not at the next probe.
func (e *ejector) recheck(urls []string) bool {
	e.mu.Lock()
	checks := map[string]func(context.Context) error{}
	for _, u := range urls {
		if j, ok := e.ejects[u]; ok && j.check != nil {
			checks[u] = j.check
		}
	}
	e.mu.Unlock()
	back := false
	for u, check := range checks {
		_, err, _ := e.rechecks.Do(u, func() (any, error) {
			ctx, cancel := context.WithTimeout(context.Background(), recheckTimeout)
			defer cancel()
			return nil, check(ctx)
		})
		if err == nil {
			e.restore(u)
			back = true
		}
	}
	return back
}

// recheckTimeout bounds a request's wait for the health of an ejected endpoint.
const recheckTimeout = 500 * time.Millisecond

// restore ends url's ejection (its health check answered).
func (e *ejector) restore(url string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if _, ok := e.ejects[url]; ok {
		delete(e.ejects, url)
		e.n.Add(-1)
	}
}

// returnsIn is the time until the first of urls comes back (for Retry-After).
func (e *ejector) returnsIn(urls []string) time.Duration {
	e.mu.Lock()
	defer e.mu.Unlock()
	var first time.Duration
	for _, u := range urls {
		if j, ok := e.ejects[u]; ok {
			if d := j.until.Sub(e.clock.Now()); first == 0 || d < first {
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
// a verdict, not absent: it waits out its ejection. The probes end with the ejection, when the
// endpoint leaves the pools (its address may be the next pod's, which they would ask) and when
// the router closes.
func (r *Router) watch(url string) {
	t := time.NewTicker(r.probeEvery)
	defer t.Stop()
	for {
		select {
		case <-r.closed:
			return
		case <-t.C:
		}
		if !r.eject.out(url) || !r.pooled(url) {
			return // its ejection ended (or a request's recheck ended it), or it is gone
		}
		if r.eject.recheck([]string{url}) {
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

// Close stops the router's work that outlives requests: the probes of ejected endpoints.
func (r *Router) Close() { r.closeOnce.Do(func() { close(r.closed) }) }

// pooled reports whether url is one of the router's engines now.
func (r *Router) pooled(url string) bool {
	p := r.pools.Load()
	return p != nil && (slices.Contains(p.Decode, url) || slices.ContainsFunc(p.Prefill, func(e Prefill) bool { return e.URL == url }))
}
