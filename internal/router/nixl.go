// The NIXL flow: prefill first, its kv_transfer_params passed to decode.

package router

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/bounded"
)

// nixl runs the prefill leg first and passes its kv_transfer_params to decode.
func (r *Router) nixl(w http.ResponseWriter, req *http.Request, body map[string]json.RawMessage, reqID string, p Prefill, d string) {
	pb := prefillBody(body, map[string]any{
		vllm.DoRemoteDecode: true, vllm.DoRemotePrefill: false,
		vllm.RemoteEngineID: nil, vllm.RemoteBlockIDs: nil, vllm.RemoteHost: nil, vllm.RemotePort: nil,
	})
	ctx, cancel := context.WithTimeout(req.Context(), r.cfg.PrefillTimeout)
	defer cancel()
	presp, err := r.post(ctx, p.URL+req.URL.Path, pb, reqID, nil)
	if err != nil {
		if req.Context().Err() != nil {
			return
		}
		writeError(w, http.StatusBadGateway, fmt.Sprintf("prefill leg %s failed: %v", p.URL, err))
		return
	}
	pbody, err := bounded.ReadAll(presp.Body, maxResponseBytes)
	presp.Body.Close()
	if err != nil {
		writeError(w, http.StatusBadGateway, fmt.Sprintf("prefill leg %s: read: %v", p.URL, err))
		return
	}
	if presp.StatusCode != http.StatusOK {
		// The prefill's own answer (a 4xx for a bad request) is the client's answer.
		w.Header().Set("Content-Type", presp.Header.Get("Content-Type"))
		w.WriteHeader(presp.StatusCode)
		_, _ = w.Write(pbody)
		return
	}
	var pr struct {
		KVTransferParams json.RawMessage `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(pbody, &pr); err != nil || len(pr.KVTransferParams) == 0 || string(pr.KVTransferParams) == "null" {
		writeError(w, http.StatusBadGateway, fmt.Sprintf("prefill leg %s returned no kv_transfer_params", p.URL))
		return
	}
	db := maps.Clone(body)
	db[vllm.KVTransferParams] = pr.KVTransferParams
	resp, err := r.post(req.Context(), d+req.URL.Path, db, reqID, nil)
	if err != nil {
		if req.Context().Err() != nil {
			return
		}
		writeError(w, http.StatusBadGateway, fmt.Sprintf("decode leg %s failed: %v", d, err))
		return
	}
	defer resp.Body.Close()
	copyResponse(w, resp)
}
