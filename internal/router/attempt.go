// One attempt of a request: a prefill (none when decode serves alone) and a decode engine,
// pending until its answer's first byte commits it to the client or it is abandoned.

package router

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync/atomic"
	"time"

	"pdcluster.dev/pdcluster-operator/internal/bounded"
)

// attempt is one try of the request on one prefill (none when decodeOnly) and one decode
// engine. The first byte written to the client commits it; before that it may be abandoned
// (its prefill failed and another will be tried, or the hang budget ran out), which cancels
// its legs.
type attempt struct {
	x          *exchange
	p          Prefill
	d          string
	decodeOnly bool
	pp, dp     picked
	// decodeSent is set once the decode leg was sent: it counts in flight until release.
	decodeSent bool
	// prefillAnswered is set once the prefill leg answered in full: a hang is decode's then.
	prefillAnswered atomic.Bool

	state atomic.Int32 // attemptPending, attemptCommitted, attemptAbandoned
	// ctx is the decode leg's (and NIXL's prefill leg's): the client's, cancelled with the
	// reason on abandonment.
	ctx    context.Context
	cancel context.CancelCauseFunc
	// prefillCancel ends Mooncake's prefill leg, which the client does not cancel: vLLM then
	// aborts the request and frees its blocks (a decode that never got its request will not
	// pull them).
	prefillCancel context.CancelFunc
}

func noCancel(error) {}

const (
	attemptPending int32 = iota
	attemptCommitted
	attemptAbandoned
)

// commit marks the attempt's answer as the client's; false when it was abandoned first. The
// answer's first byte follows at once.
func (a *attempt) commit() bool {
	if !a.state.CompareAndSwap(attemptPending, attemptCommitted) {
		return false
	}
	a.x.r.metrics.firstToken.Observe(time.Since(a.x.start).Seconds())
	return true
}

// abandon cancels a pending attempt's legs with why; false when it had committed.
func (a *attempt) abandon(why *legError) bool {
	if !a.state.CompareAndSwap(attemptPending, attemptAbandoned) {
		return false
	}
	a.cancel(why)
	if a.prefillCancel != nil {
		a.prefillCancel()
	}
	return true
}

// ended is why a leg of a cancelled attempt stopped: the reason it was abandoned, or the
// client going away.
func (a *attempt) ended() *legError {
	if why, ok := errors.AsType[*legError](context.Cause(a.ctx)); ok {
		return why
	}
	return errClientGone
}

// cancelPrefill ends Mooncake's prefill leg of an attempt that failed.
func (a *attempt) cancelPrefill() {
	if a.prefillCancel != nil {
		a.prefillCancel()
	}
}

func (a *attempt) release() {
	if a.decodeSent {
		a.x.r.decodeLegs.Add(-1)
	}
	if !a.decodeOnly {
		a.x.r.prefill.done(a.pp)
	}
	a.x.r.decode.done(a.dp)
	a.cancel(nil)
}

// hung is the failure of an attempt with no first byte within the budget: its prefill's,
// while the prefill leg has not answered (decode waits for its KV), else its decode's.
func (a *attempt) hung() *legError {
	l, endpoint := legDecode, a.d
	if !a.decodeOnly && !a.prefillAnswered.Load() {
		l, endpoint = legPrefill, a.p.URL
	}
	return &legError{leg: l, cause: causeFirstToken, endpoint: endpoint, status: http.StatusGatewayTimeout,
		msg: fmt.Sprintf("no first token within %s (failurePolicy.firstTokenTimeoutSeconds): the %s engine %s did not answer; both legs cancelled", a.x.firstToken, l, endpoint)}
}

// answer relays decode's answer, or, for a 503 (decode not serving), the failure to retry.
func (a *attempt) answer(resp *http.Response) *legError {
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusServiceUnavailable {
		return statusError(legDecode, a.d, resp.StatusCode, fmt.Sprintf("decode leg %s: %s: %s", a.d, resp.Status, bounded.Snippet(resp.Body)))
	}
	return a.relay(resp)
}

// relay answers the client with decode's answer, if the attempt still may.
func (a *attempt) relay(resp *http.Response) *legError {
	err := relay(a.x.w, resp, a)
	switch {
	case err == nil:
		if resp.StatusCode < http.StatusInternalServerError {
			a.x.r.eject.answered(a.d)
		}
		return nil
	case errors.Is(err, errCommit) || a.ctx.Err() != nil:
		return a.ended()
	default:
		// Decode broke before a byte reached the client: another attempt may serve it.
		return &legError{leg: legDecode, cause: causeReset, endpoint: a.d, status: http.StatusBadGateway, retriable: true,
			msg: fmt.Sprintf("decode leg %s: %v", a.d, err)}
	}
}
