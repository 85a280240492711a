// One client request from its parsed body to its answer: attempts on pairs of engines, each
// failure that nothing reached the client with retried on another endpoint within the
// budgets, the failed endpoint ejected, and the hang budget over all of it.

package router

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// exchange is one client request.
type exchange struct {
	r     *Router
	w     *statusWriter
	req   *http.Request
	body  map[string]json.RawMessage
	reqID string
	pools *Pools
	start time.Time // the request's arrival
	// firstToken is how long the request may wait for its first byte (firstTokenBudget); 0:
	// no limit.
	firstToken time.Duration

	mu       sync.Mutex
	tried    []string // endpoints that failed in this request
	retries  int      // retries taken
	reserved bool     // a retry taken already for the failure that abandoned the attempt

	cur      atomic.Pointer[attempt]
	timedOut atomic.Bool
	// first is the first attempt's memory (most requests make only one).
	first attempt
	// scorer is the routing strategy's state of this request (strategy.go).
	scorer scorer
}

func (x *exchange) run() {
	r := x.r
	r.budget.request()
	if x.firstToken > 0 {
		t := time.AfterFunc(x.firstToken, func() {
			x.timedOut.Store(true)
			if a := x.cur.Load(); a != nil {
				a.abandon(a.hung())
			}
		})
		defer t.Stop()
	}
	decodeOnly := false
	for {
		a, lerr := x.newAttempt(decodeOnly)
		if lerr == nil {
			x.cur.Store(a)
			if x.timedOut.Load() {
				a.abandon(a.hung())
			}
			if decodeOnly {
				lerr = r.decodeAlone(a)
			} else {
				lerr = r.flow(a)
			}
			if lerr != nil && lerr != errClientGone {
				a.cancelPrefill() // a decode that failed will not pull the blocks: free them
			}
			a.release()
		}
		switch {
		case lerr == nil, lerr == errClientGone:
			return
		case x.timedOut.Load():
			// The hung leg's endpoint counts a failure toward its ejection; the client gets a
			// typed 504 naming it.
			x.record(lerr)
			if lerr.cause != causeFirstToken {
				lerr = a.hung()
			}
			writeTypedError(x.w, lerr.status, string(causeFirstToken), lerr.msg, map[string]any{"leg": string(lerr.leg), "engine": lerr.endpoint})
			return
		}
		x.record(lerr)
		if x.retry(lerr) {
			continue
		}
		if !decodeOnly && lerr.prefillUnavailable() && r.policy.OnPrefillFailure == routerconfig.PrefillFailureDecodeOnly {
			r.log.Info("prefill cannot be served: decode alone", "request", x.reqID, "reason", lerr.msg)
			decodeOnly = true
			continue
		}
		if lerr.cause == causeNoEndpoint {
			if d := r.eject.returnsIn(x.poolURLs(lerr.leg)); d > 0 {
				x.w.Header().Set("Retry-After", strconv.Itoa(int(d.Round(time.Second)/time.Second)))
			}
		}
		writeError(x.w, lerr.status, lerr.msg)
		return
	}
}

// firstTokenBudget is how long the request may wait for its first byte: the policy's
// firstTokenTimeoutSeconds, else, for a streaming request, the derived default (a request
// that does not stream has its whole answer as its first byte, however long it generates).
func firstTokenBudget(p FailurePolicy, body map[string]json.RawMessage) time.Duration {
	if p.FirstTokenTimeout > 0 {
		return p.FirstTokenTimeout
	}
	if string(body["stream"]) == "true" {
		return p.StreamFirstTokenTimeout
	}
	return 0
}

// avoid leaves out the endpoints ejected or failed in this request; nil (nothing to check)
// on the happy path.
func (x *exchange) avoid() func(string) bool {
	x.mu.Lock()
	var tried []string
	if len(x.tried) > 0 {
		tried = slices.Clone(x.tried)
	}
	x.mu.Unlock()
	if tried == nil && x.r.eject.count() == 0 {
		return nil
	}
	return func(u string) bool { return slices.Contains(tried, u) || x.r.eject.out(u) }
}

func (x *exchange) poolURLs(l leg) []string {
	if l == legDecode {
		return slices.Clone(x.pools.Decode)
	}
	urls := make([]string, len(x.pools.Prefill))
	for i, p := range x.pools.Prefill {
		urls[i] = p.URL
	}
	return urls
}

// recheck asks the ejected endpoints of l's pool that this request has not tried whether they
// are back (see ejector.recheck).
func (x *exchange) recheck(l leg) bool {
	x.mu.Lock()
	tried := slices.Clone(x.tried)
	x.mu.Unlock()
	urls := slices.DeleteFunc(x.poolURLs(l), func(u string) bool { return slices.Contains(tried, u) })
	return len(urls) > 0 && x.r.eject.recheck(urls)
}

func (x *exchange) noEndpoint(l leg) *legError {
	return &legError{leg: l, cause: causeNoEndpoint, status: http.StatusServiceUnavailable,
		msg: fmt.Sprintf("no %s endpoint left to try: each of the %d failed in this request or is ejected after failing", l, len(x.poolURLs(l)))}
}

// newAttempt picks the engines of the next attempt.
func (x *exchange) newAttempt(decodeOnly bool) (*attempt, *legError) {
	r, pools := x.r, x.pools
	avoid := x.avoid()
	a := &x.first
	if x.cur.Load() != nil {
		a = new(attempt)
	}
	a.x, a.decodeOnly = x, decodeOnly
	pairing := r.cfg.Pairing != "" && !decodeOnly
	var prefillPref *preference
	if !decodeOnly {
		prefillURL := func(i int) string { return pools.Prefill[i].URL }
		pref := x.scorer.score(legPrefill, len(pools.Prefill), prefillURL)
		pp, ok := r.prefill.pick(len(pools.Prefill), prefillURL, x.pairablePrefill(avoid), pref)
		if !ok && x.recheck(legPrefill) {
			pp, ok = r.prefill.pick(len(pools.Prefill), prefillURL, x.pairablePrefill(x.avoid()), pref)
		}
		prefillPref = pref
		if !ok {
			return nil, x.noEndpoint(legPrefill)
		}
		a.pp, a.p = pp, pools.Prefill[pp.index]
	}
	pref := x.scorer.score(legDecode, len(pools.Decode), func(i int) string { return pools.Decode[i] })
	dp, ok := x.pickDecode(avoid, a.p.URL, pairing, pref)
	if !ok && x.recheck(legDecode) {
		dp, ok = x.pickDecode(x.avoid(), a.p.URL, pairing, pref)
	}
	if !ok {
		if !decodeOnly {
			r.prefill.done(a.pp)
		}
		return nil, x.noEndpoint(legDecode)
	}
	a.dp, a.d = dp, pools.Decode[dp.index]
	if !decodeOnly {
		x.scorer.record(legPrefill, a.pp, a.p.URL, prefillPref)
	}
	x.scorer.record(legDecode, a.dp, a.d, pref)
	// Only an attempt that can be abandoned gets a context of its own (Mooncake's decode leg
	// waits while its prefill may fail; the hang budget abandons any): NIXL's legs run one
	// after the other on the client's.
	if (r.cfg.Flow == routerconfig.FlowMooncake && !decodeOnly) || x.firstToken > 0 {
		a.ctx, a.cancel = context.WithCancelCause(x.req.Context())
	} else {
		a.ctx, a.cancel = x.req.Context(), noCancel
	}
	return a, nil
}

// mayRetry reports whether a failure may be retried: the policy allows it, the request has
// retries left, the router's budget has one.
func (x *exchange) mayRetry(e *legError) bool {
	r := x.r
	if !e.retriable || (e.leg == legPrefill && r.policy.OnPrefillFailure == routerconfig.PrefillFailureFail) {
		return false
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.retries < r.policy.Retries
}

// takeRetry spends a retry for e from the request's and the router's budgets.
func (x *exchange) takeRetry(e *legError) bool {
	r := x.r
	if !x.mayRetry(e) {
		return false
	}
	if !r.budget.take() {
		r.metrics.budgetDenied.Inc()
		return false
	}
	x.mu.Lock()
	x.retries++
	x.mu.Unlock()
	r.metrics.retries.WithLabelValues(string(e.leg), string(e.cause)).Inc()
	return true
}

// retry reports whether the exchange tries again after e: with the retry taken when e
// abandoned the attempt, or one taken now.
func (x *exchange) retry(e *legError) bool {
	x.mu.Lock()
	reserved := x.reserved
	x.reserved = false
	x.mu.Unlock()
	return reserved || x.takeRetry(e)
}

// retryInstead abandons a, whose prefill failed with e while its decode leg still waits for
// the KV, when nothing reached the client yet: to retry on another prefill endpoint when one is
// left (the retry is taken for the exchange's next attempt), and also without one when the
// prefill is gone (refused, reset, bootstrap down): its KV will never come, and vLLM's decode
// does not fail such a pull but waits for it until its own abort timeout (minutes, measured on
// a real vLLM 0.30.0 engine), so the client gets prefill's failure now, or decode computes the
// prompt alone (onPrefillFailure DecodeOnly). A prefill that answered with its verdict (a 5xx)
// is left to decode, which answers for itself.
func (x *exchange) retryInstead(a *attempt, e *legError) {
	if x.mayRetry(e) {
		avoid := x.avoid()
		if slices.ContainsFunc(x.poolURLs(e.leg), func(u string) bool { return avoid == nil || !avoid(u) }) {
			if a.abandon(e) && x.takeRetry(e) {
				x.mu.Lock()
				x.reserved = true
				x.mu.Unlock()
			}
			return
		}
	}
	if e.prefillUnavailable() {
		a.abandon(e)
	}
}

// record counts e and, when it says its endpoint is not there or not serving, ejects the
// endpoint and leaves it out of this request's next attempts. Once per failure.
func (x *exchange) record(e *legError) {
	r := x.r
	if e == errClientGone || e.recorded.Swap(true) {
		return
	}
	r.metrics.legFailures.WithLabelValues(string(e.leg), string(e.cause)).Inc()
	// A hang is not retried (the client waited its budget already) but counts toward its
	// endpoint's ejection: an engine that takes requests and never answers them fills the
	// router with clients waiting.
	if (!e.retriable && e.cause != causeFirstToken) || e.endpoint == "" {
		return
	}
	x.mu.Lock()
	x.tried = append(x.tried, e.endpoint)
	x.mu.Unlock()
	// One that is there and said no (503) waits out its ejection, and so does a hung one (its
	// health check answers as before); one that was not there is back when its check answers.
	var check func(context.Context) error
	if e.cause != causeUnavailable && e.cause != causeFirstToken {
		if check = e.check; check == nil {
			check = r.healthCheck(e.endpoint)
		}
	}
	// Nothing listens where a connection is refused: out at the first, back when it answers.
	after := r.policy.ConsecutiveFailures
	if e.cause == causeConnect || e.cause == causeBootstrap {
		after = 1
	}
	switch r.eject.failed(e.endpoint, x.poolURLs(e.leg), after, r.policy.Eject, check) {
	case ejected:
		r.metrics.ejections.WithLabelValues(string(e.leg)).Inc()
		r.log.Info("endpoint ejected", "endpoint", e.endpoint, "leg", e.leg, "cause", e.cause, "for", r.policy.Eject.String())
		if check != nil {
			go r.watch(e.endpoint)
		}
	case withheld:
		r.metrics.ejectionsWithheld.WithLabelValues(string(e.leg)).Inc()
		r.log.Info("endpoint not ejected: it is the last of its pool still in", "endpoint", e.endpoint, "leg", e.leg, "cause", e.cause)
	}
}

// decodeLeg posts body to the attempt's decode engine. A decode that refused the connection
// never got the request, so another one may take it with the same transfer (prefill's blocks
// are then pulled, not left held): the attempt moves on to it within the budgets.
func (r *Router) decodeLeg(a *attempt, body map[string]json.RawMessage) (*http.Response, *legError) {
	x := a.x
	if !a.decodeSent {
		a.decodeSent = true
		r.decodeLegs.Add(1)
	}
	defer func() {
		if seen, ok := x.req.Context().Value(decodeSeenKey{}).(*string); ok {
			*seen = a.d // the canary's: the decode engine that got its last attempt
		}
	}()
	for {
		resp, err := r.post(a.ctx, a.d+x.req.URL.Path, body, x.reqID, nil)
		if err == nil {
			return resp, nil
		}
		if a.ctx.Err() != nil {
			return nil, a.ended()
		}
		lerr := transportError(legDecode, a.d, err)
		if lerr.cause != causeConnect {
			return nil, lerr
		}
		x.record(lerr)
		if !x.takeRetry(lerr) {
			return nil, lerr
		}
		pools := x.pools
		dp, ok := r.decode.pick(len(pools.Decode), func(i int) string { return pools.Decode[i] }, x.avoid(), nil)
		if !ok {
			return nil, x.noEndpoint(legDecode)
		}
		r.decode.done(a.dp)
		a.dp, a.d = dp, pools.Decode[dp.index]
	}
}

// decodeAlone sends the client's request to decode without kv_transfer_params: decode computes
// the prompt itself (onPrefillFailure: DecodeOnly, once prefill cannot serve it).
func (r *Router) decodeAlone(a *attempt) *legError {
	r.metrics.decodeOnly.Inc()
	resp, lerr := r.decodeLeg(a, a.x.body)
	if lerr != nil {
		return lerr
	}
	return a.answer(resp)
}
