// The Mooncake flow: both legs at once, sharing a transfer_id; prefill's engine id from its
// bootstrap server.

package router

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"slices"
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

// mooncake runs both legs at once. The prefill leg is never cancelled by the client: its
// blocks are released by the decode's pull (or cleanup pull) either way.
func (r *Router) mooncake(w http.ResponseWriter, req *http.Request, body map[string]json.RawMessage, reqID string, p Prefill, d string) {
	engineID, dp, err := r.engine(req.Context(), p.Bootstrap)
	if err != nil {
		writeError(w, http.StatusBadGateway, fmt.Sprintf("prefill bootstrap %s: %v", p.Bootstrap, err))
		return
	}
	transfer := "xfer-" + newID()
	pb := prefillBody(body, map[string]any{vllm.DoRemoteDecode: true, vllm.DoRemotePrefill: false, vllm.TransferID: transfer})
	db := withParams(body, map[string]any{
		vllm.DoRemotePrefill: true, vllm.DoRemoteDecode: false, vllm.TransferID: transfer,
		vllm.RemoteBootstrapAddr: p.Bootstrap, vllm.RemoteEngineID: engineID,
	})
	prefillErr := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(req.Context()), r.cfg.PrefillTimeout)
		defer cancel()
		resp, err := r.post(ctx, p.URL+req.URL.Path, pb, reqID, map[string]string{vllm.DataParallelRankHeader: dp})
		if err == nil {
			err = drain(resp)
		}
		if err != nil {
			r.log.Info("prefill leg failed", "request", reqID, "prefill", p.URL, "err", err.Error())
			r.boot.Invalidate(p.Bootstrap)
		}
		prefillErr <- err
	}()
	resp, err := r.post(req.Context(), d+req.URL.Path, db, reqID, nil)
	if err != nil {
		if req.Context().Err() != nil {
			return // the client went away
		}
		r.boot.Invalidate(p.Bootstrap)
		writeError(w, http.StatusBadGateway, fmt.Sprintf("decode leg %s failed: %v", d, err))
		return
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 500 {
		// A decode that failed may have pulled with a stale engine id: ask again next time.
		r.boot.Invalidate(p.Bootstrap)
		// Say why: the prefill leg's failure is usually the cause of the decode's.
		reason := fmt.Sprintf("decode leg %s: %s: %s", d, resp.Status, bounded.Snippet(resp.Body))
		select {
		case perr := <-prefillErr:
			if perr != nil {
				reason += fmt.Sprintf("; prefill leg %s: %v", p.URL, perr)
			}
		case <-time.After(100 * time.Millisecond):
		}
		writeError(w, resp.StatusCode, reason)
		return
	}
	copyResponse(w, resp)
}

// engine picks the first data-parallel rank registered at the prefill's bootstrap registry.
func (r *Router) engine(ctx context.Context, addr string) (engineID, dp string, err error) {
	topo, err := r.boot.Query(ctx, addr)
	if err != nil {
		return "", "", err
	}
	if len(topo) == 0 {
		r.boot.Invalidate(addr)
		return "", "", errors.New("no prefill worker registered yet")
	}
	dp = slices.Min(slices.Collect(maps.Keys(topo)))
	return topo[dp].EngineID, dp, nil
}
