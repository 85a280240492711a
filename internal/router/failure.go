// The failure policy: which failed legs are retried on another endpoint, the budgets that
// bound the retries, and how a failure is named for the client and the metrics.

package router

import (
	"cmp"
	"context"
	"errors"
	"net"
	"net/http"
	"sync/atomic"
	"time"

	"k8s.io/utils/clock"

	"pdcluster.dev/pdcluster-operator/internal/bounded"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// FailurePolicy is router.json's failurePolicy, in durations.
type FailurePolicy struct {
	// Retries bounds one request's retries, over both legs.
	Retries int
	// RetryBudgetPercent bounds the router's retries to this share of its requests over the
	// last budgetWindow (0: none).
	RetryBudgetPercent int
	// Eject is how long an endpoint that failed is left out.
	Eject time.Duration
	// ConsecutiveFailures is how many failures in a row eject an endpoint; one that refuses
	// connections (or whose bootstrap server does) goes at the first. 0 is 1.
	ConsecutiveFailures int
	// FirstTokenTimeout fails a request whose first byte has not come from decode in this
	// long, cancelling both legs; 0: StreamFirstTokenTimeout for a streaming request, else no
	// limit.
	FirstTokenTimeout time.Duration
	// StreamFirstTokenTimeout is a streaming request's first-byte budget when
	// FirstTokenTimeout is 0 (router.json's streamFirstTokenTimeoutSeconds); 0: no limit.
	StreamFirstTokenTimeout time.Duration
	// OnPrefillFailure is what happens once prefill cannot be served.
	OnPrefillFailure routerconfig.OnPrefillFailure
}

// PolicyFromFile is router.json's failure policy as the router applies it.
func PolicyFromFile(p routerconfig.FailurePolicy) FailurePolicy {
	return FailurePolicy{
		Retries: int(p.Retries), RetryBudgetPercent: int(p.RetryBudgetPercent),
		Eject:                   time.Duration(p.EjectSeconds) * time.Second,
		ConsecutiveFailures:     int(cmp.Or(p.ConsecutiveFailures, routerconfig.DefaultConsecutiveFailures)),
		FirstTokenTimeout:       time.Duration(p.FirstTokenTimeoutSeconds) * time.Second,
		StreamFirstTokenTimeout: time.Duration(p.StreamFirstTokenTimeoutSeconds) * time.Second,
		OnPrefillFailure:        p.OnPrefillFailure,
	}
}

// leg is the pool a failure happened in.
type leg string

const (
	legPrefill leg = "prefill"
	legDecode  leg = "decode"
)

// cause is why a leg failed, as the metrics label it.
type cause string

const (
	// causeConnect: the endpoint refused the connection or did not answer the dial; nothing
	// was sent to it.
	causeConnect cause = "connect"
	// causeReset: the connection broke before the endpoint's answer was read.
	causeReset cause = "reset"
	// causeBootstrap: prefill's bootstrap server was unreachable, failing or empty.
	causeBootstrap cause = "bootstrap"
	// causeUnavailable: the engine answered 503, it is not serving.
	causeUnavailable cause = "unavailable"
	// causeStatus: another error answer, the engine's verdict on this request: never retried
	// (a request that kills an engine must not be sent to the next one).
	causeStatus cause = "status"
	// causeAnswer: an answer the router cannot use (too large, no kv_transfer_params).
	causeAnswer cause = "answer"
	// causeNoEndpoint: every endpoint of the pool failed in this request or is ejected.
	causeNoEndpoint cause = "no_endpoint"
	// causeTimeout: the engine took the request and did not answer within the router's
	// header timeout; it may still be working on it, so it is not sent elsewhere as well.
	causeTimeout cause = "timeout"
	// causeFirstToken: no first byte from decode within FirstTokenTimeout.
	causeFirstToken cause = "first_token_timeout"
)

// legError is a failed leg of which nothing reached the client.
type legError struct {
	leg      leg
	cause    cause
	endpoint string // the engine's URL ("" for causeNoEndpoint)
	status   int    // what the client gets when the failure is final
	msg      string
	// retriable: the endpoint is not there or not serving, so another one may serve the
	// request (connect, reset, bootstrap, unavailable).
	retriable bool
	// check tells when an endpoint that was not there is back; nil: its GET /health.
	check    func(context.Context) error
	recorded atomic.Bool // counted and its endpoint ejected, once
}

func (e *legError) Error() string { return e.msg }

// prefillUnavailable reports a failure that says the prefill pool cannot serve the request
// (as opposed to its verdict on the request): onPrefillFailure applies to it.
func (e *legError) prefillUnavailable() bool {
	return e.leg == legPrefill && (e.retriable || e.cause == causeNoEndpoint)
}

// errClientGone ends a request whose client went away: nothing is written, nothing retried.
var errClientGone = &legError{cause: "client_gone", msg: "the client went away"}

// transportError names a leg whose request or answer failed in transport.
func transportError(l leg, endpoint string, err error) *legError {
	e := &legError{leg: l, endpoint: endpoint, status: http.StatusBadGateway, msg: string(l) + " leg " + endpoint + " failed: " + err.Error(), retriable: true, cause: causeReset}
	if ne, ok := errors.AsType[*net.OpError](err); ok && ne.Op == "dial" {
		e.cause = causeConnect
	} else if errors.Is(err, bounded.ErrRedirect) {
		e.cause, e.retriable = causeAnswer, false // an answer, and not one to follow
	} else if ne, ok := errors.AsType[net.Error](err); ok && ne.Timeout() {
		e.cause, e.retriable = causeTimeout, false
	}
	return e
}

// statusError names a leg that answered status with reason.
func statusError(l leg, endpoint string, status int, msg string) *legError {
	e := &legError{leg: l, endpoint: endpoint, status: status, msg: msg, cause: causeStatus}
	if status == http.StatusServiceUnavailable {
		e.cause, e.retriable = causeUnavailable, true
	}
	return e
}

// Retry budget: the router's retries over the last budgetWindow seconds stay under
// RetryBudgetPercent of its requests, with a floor of minRetriesPerWindow so a quiet router
// can still retry; past it, failures are answered, not multiplied.
const (
	budgetWindow        = 10
	minRetriesPerWindow = 3
)

type budgetBucket struct{ sec, requests, retries atomic.Int64 }

// retryBudget counts requests and retries in one-second buckets: one atomic add per request.
// A bucket reused for a new second may lose a few counts to a racing add: a budget need not
// be exact.
type retryBudget struct {
	percent int64
	clock   clock.PassiveClock
	buckets [budgetWindow]budgetBucket
}

func (b *retryBudget) bucket(sec int64) *budgetBucket {
	k := &b.buckets[sec%budgetWindow]
	if old := k.sec.Load(); old != sec && k.sec.CompareAndSwap(old, sec) {
		k.requests.Store(0)
		k.retries.Store(0)
	}
	return k
}

// request counts one request.
func (b *retryBudget) request() { b.bucket(b.clock.Now().Unix()).requests.Add(1) }

// take spends one retry, if the budget has one.
func (b *retryBudget) take() bool {
	if b.percent <= 0 {
		return false
	}
	now := b.clock.Now().Unix()
	var requests, retries int64
	for i := range b.buckets {
		k := &b.buckets[i]
		if now-k.sec.Load() < budgetWindow {
			requests += k.requests.Load()
			retries += k.retries.Load()
		}
	}
	if retries >= max(minRetriesPerWindow, requests*b.percent/100) {
		return false
	}
	b.bucket(now).retries.Add(1)
	return true
}
