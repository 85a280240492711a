// The NIXL flow: prefill first, its kv_transfer_params passed to decode.

package router

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"time"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/bounded"
)

// nixl runs the prefill leg first and passes its kv_transfer_params to decode. Nothing reaches
// decode before prefill answered, so any prefill failure that says the endpoint is not there
// or not serving is retried elsewhere.
func (r *Router) nixl(a *attempt) *legError {
	x, p := a.x, a.p
	pb := prefillBody(x.body, map[string]any{
		vllm.DoRemoteDecode: true, vllm.DoRemotePrefill: false,
		vllm.RemoteEngineID: nil, vllm.RemoteBlockIDs: nil, vllm.RemoteHost: nil, vllm.RemotePort: nil,
	})
	ctx, cancel := context.WithTimeout(a.ctx, r.cfg.PrefillTimeout)
	defer cancel()
	r.prefillLegs.Add(1)
	presp, err := r.post(ctx, p.URL+x.req.URL.Path, pb, x.reqID, nil)
	if err != nil {
		r.prefillLegs.Add(-1)
		if a.ctx.Err() != nil {
			return a.ended()
		}
		return transportError(legPrefill, p.URL, err)
	}
	pbody, err := bounded.ReadAll(presp.Body, maxResponseBytes)
	presp.Body.Close()
	r.prefillLegs.Add(-1)
	switch {
	case err != nil && a.ctx.Err() != nil:
		return a.ended()
	case errors.Is(err, bounded.ErrTooLarge):
		return &legError{leg: legPrefill, cause: causeAnswer, endpoint: p.URL, status: http.StatusBadGateway, msg: fmt.Sprintf("prefill leg %s: read: %v", p.URL, err)}
	case err != nil:
		return transportError(legPrefill, p.URL, fmt.Errorf("read: %w", err))
	case presp.StatusCode == http.StatusServiceUnavailable:
		return statusError(legPrefill, p.URL, presp.StatusCode, fmt.Sprintf("prefill leg %s: %s: %s", p.URL, presp.Status, bytes.TrimSpace(pbody)))
	case presp.StatusCode != http.StatusOK:
		// The prefill's own answer (a 4xx for a bad request) is the client's answer.
		if !a.commit() {
			return a.ended()
		}
		x.w.Header().Set("Content-Type", presp.Header.Get("Content-Type"))
		x.w.WriteHeader(presp.StatusCode)
		_, _ = x.w.Write(pbody)
		return nil
	}
	var pr struct {
		KVTransferParams json.RawMessage `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(pbody, &pr); err != nil || len(pr.KVTransferParams) == 0 || string(pr.KVTransferParams) == "null" {
		return &legError{leg: legPrefill, cause: causeAnswer, endpoint: p.URL, status: http.StatusBadGateway, msg: fmt.Sprintf("prefill leg %s returned no kv_transfer_params", p.URL)}
	}
	r.metrics.prefillLeg.Observe(time.Since(x.start).Seconds())
	r.eject.answered(p.URL)
	a.prefillAnswered.Store(true)
	db := maps.Clone(x.body)
	db[vllm.KVTransferParams] = pr.KVTransferParams
	// Past here a failed decode leaves prefill's blocks held until NIXL's abort timeout
	// (VLLM_NIXL_ABORT_REQUEST_TIMEOUT): vLLM gives the router no call to free them.
	resp, lerr := r.decodeLeg(a, db)
	if lerr != nil {
		return lerr
	}
	return a.answer(resp)
}
