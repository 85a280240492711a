// The Mooncake flow: both legs at once, sharing a transfer_id; prefill's engine id from its
// bootstrap server.

package router

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"time"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/bounded"
)

// A prefill's engine id is asked again in the background once its answer is older than
// bootstrapRefresh, and not used at all past bootstrapMaxAge: a producer that restarted has a
// new id, and a pull naming the old one fails (or, with kv_load_failure_policy recompute,
// quietly recomputes), so a busy router must learn the new id within about bootstrapRefresh.
// A failed leg makes it ask at once. Asking on every request was a tenth of a request's cost.
const (
	bootstrapRefresh = 100 * time.Millisecond
	bootstrapMaxAge  = 2 * time.Second
)

// mooncake runs both legs at once. The client does not cancel the prefill leg: its blocks are
// released by the decode's pull (or cleanup pull) either way. The router cancels it when the
// decode leg failed, so that a decode that never got the request does not leave them held.
func (r *Router) mooncake(a *attempt) *legError {
	x, p := a.x, a.p
	engineID, dp, err := r.engine(a.ctx, p.Bootstrap)
	if err != nil {
		if a.ctx.Err() != nil {
			return a.ended()
		}
		return &legError{leg: legPrefill, cause: causeBootstrap, endpoint: p.URL, status: http.StatusBadGateway, retriable: true,
			msg:   fmt.Sprintf("prefill bootstrap %s: %v", p.Bootstrap, err),
			check: func(ctx context.Context) error { _, _, err := r.engine(ctx, p.Bootstrap); return err }}
	}
	transfer := "xfer-" + newID()
	pb := prefillBody(x.body, map[string]any{vllm.DoRemoteDecode: true, vllm.DoRemotePrefill: false, vllm.TransferID: transfer})
	db := withParams(x.body, map[string]any{
		vllm.DoRemotePrefill: true, vllm.DoRemoteDecode: false, vllm.TransferID: transfer,
		vllm.RemoteBootstrapAddr: p.Bootstrap, vllm.RemoteEngineID: engineID,
	})
	pctx, pcancel := context.WithTimeout(context.WithoutCancel(a.ctx), r.cfg.PrefillTimeout)
	a.prefillCancel = pcancel
	prefillErr := make(chan *legError, 1)
	r.prefillLegs.Add(1)
	go func() {
		defer pcancel()
		resp, err := r.post(pctx, p.URL+x.req.URL.Path, pb, x.reqID, map[string]string{vllm.DataParallelRankHeader: dp})
		var lerr *legError
		switch {
		case err != nil && errors.Is(pctx.Err(), context.Canceled):
			// Cancelled by the router: the attempt failed or was abandoned already.
		case err != nil:
			lerr = transportError(legPrefill, p.URL, err)
		default:
			if derr := drain(resp); derr != nil {
				lerr = statusError(legPrefill, p.URL, resp.StatusCode, fmt.Sprintf("prefill leg %s: %v", p.URL, derr))
			} else {
				r.metrics.prefillLeg.Observe(time.Since(x.start).Seconds())
				r.eject.answered(p.URL)
				a.prefillAnswered.Store(true)
			}
		}
		r.prefillLegs.Add(-1)
		if lerr != nil {
			r.log.Info("prefill leg failed", "request", x.reqID, "prefill", p.URL, "err", lerr.msg)
			r.boot.Invalidate(p.Bootstrap)
			x.record(lerr)
			// The decode waits for KV that will not come: if another prefill can take the
			// request and nothing reached the client yet, try there instead.
			x.retryInstead(a, lerr)
		}
		prefillErr <- lerr
	}()
	resp, lerr := r.decodeLeg(a, db)
	if lerr != nil {
		r.boot.Invalidate(p.Bootstrap)
		return lerr
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 500 {
		// A decode that failed may have pulled with a stale engine id: ask again next time.
		r.boot.Invalidate(p.Bootstrap)
		// Say why: the prefill leg's failure is usually the cause of the decode's.
		reason := fmt.Sprintf("decode leg %s: %s: %s", a.d, resp.Status, bounded.Snippet(resp.Body))
		select {
		case perr := <-prefillErr:
			if perr != nil {
				if a.state.Load() == attemptAbandoned {
					return a.ended() // the decode failed because its prefill did: retried
				}
				reason += fmt.Sprintf("; prefill leg %s: %s", p.URL, perr.msg)
			}
		case <-time.After(100 * time.Millisecond):
		}
		return statusError(legDecode, a.d, resp.StatusCode, reason)
	}
	return a.relay(resp)
}

// engine picks a data-parallel rank registered at the prefill's bootstrap registry, and its
// engine id.
func (r *Router) engine(ctx context.Context, addr string) (engineID, dp string, err error) {
	topo, err := r.boot.Query(ctx, addr)
	if err != nil {
		return "", "", err
	}
	if len(topo) == 0 {
		r.boot.Invalidate(addr)
		return "", "", errors.New("no prefill worker registered yet")
	}
	// A producer runs an engine per data-parallel rank: requests go to them at random, each
	// prefill leg pinned (X-data-parallel-rank) to the rank whose engine id decode is given.
	k := rand.IntN(len(topo))
	for dp, e := range topo {
		if k == 0 {
			return e.EngineID, dp, nil
		}
		k--
	}
	return "", "", errors.New("unreachable")
}
