package enginesim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer"
)

// KVTransferParams is the kv_transfer_params field of a request body, Mooncake and NIXL keys.
type KVTransferParams struct {
	DoRemoteDecode      bool                  `json:"do_remote_decode,omitempty"`
	DoRemotePrefill     bool                  `json:"do_remote_prefill,omitempty"`
	TransferID          kvtransfer.TransferID `json:"transfer_id,omitempty"`
	RemoteEngineID      string                `json:"remote_engine_id,omitempty"`
	RemoteBootstrapAddr string                `json:"remote_bootstrap_addr,omitempty"`
	RemoteBlockIDs      []kvtransfer.BlockID  `json:"remote_block_ids,omitempty"`
	RemoteRequestID     string                `json:"remote_request_id,omitempty"`
}

// CompletionRequest is the subset of the OpenAI completions and chat bodies the engine uses.
type CompletionRequest struct {
	Model         string          `json:"model"`
	Prompt        json.RawMessage `json:"prompt,omitempty"`
	Messages      []ChatMessage   `json:"messages,omitempty"`
	MaxTokens     *int            `json:"max_tokens,omitempty"`
	MaxCompletion *int            `json:"max_completion_tokens,omitempty"`
	IgnoreEOS     bool            `json:"ignore_eos,omitempty"`
	Stream        bool            `json:"stream,omitempty"`
	StreamOptions *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options,omitempty"`
	KVTransferParams *KVTransferParams `json:"kv_transfer_params,omitempty"`
}

// ChatMessage is one chat message.
type ChatMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// Usage is the token accounting of a response.
type Usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
}

// Handler serves the OpenAI-compatible API and /health.
func (e *Engine) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, r *http.Request) { e.serve(w, r, false) })
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) { e.serve(w, r, true) })
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": []map[string]any{{
			"id": e.cfg.Model, "object": "model", "owned_by": "pdcluster-enginesim", "max_model_len": e.cfg.MaxModelLen,
		}}})
	})
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) {
		if err := e.Dead(); err != nil {
			writeError(w, http.StatusInternalServerError, "EngineCore died: "+err.Error(), "EngineDeadError")
			return
		}
		w.WriteHeader(http.StatusOK)
	})
	mux.HandleFunc("GET /debug/state", func(w http.ResponseWriter, _ *http.Request) {
		state := map[string]any{"scheduler": e.Scheduler(), "engine": e.Stats()}
		if e.link != nil {
			pulls, holds := e.link.Outstanding()
			state["connector"] = map[string]int{"pullsAwaitingReport": pulls, "transfersHeld": holds}
		}
		writeJSON(w, http.StatusOK, state)
	})
	return mux
}

// parsePrompt accepts a string, a list of token ids, or a one-element list of either.
func parsePrompt(raw json.RawMessage) ([]int, error) {
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return tokenize(s), nil
	}
	var ids []int
	if err := json.Unmarshal(raw, &ids); err == nil {
		for _, id := range ids {
			if id < 0 {
				return nil, fmt.Errorf("token id %d is negative", id)
			}
		}
		return ids, nil
	}
	var batch []json.RawMessage
	if err := json.Unmarshal(raw, &batch); err == nil && len(batch) == 1 {
		return parsePrompt(batch[0])
	}
	return nil, errors.New("prompt must be a string, a list of token ids, or a one-element list of either")
}

func (e *Engine) serve(w http.ResponseWriter, hr *http.Request, chat bool) {
	if err := e.Dead(); err != nil {
		writeError(w, http.StatusInternalServerError, "EngineCore died: "+err.Error(), "EngineDeadError")
		return
	}
	var body CompletionRequest
	if err := json.NewDecoder(io.LimitReader(hr.Body, 32<<20)).Decode(&body); err != nil {
		writeError(w, http.StatusBadRequest, "invalid JSON body: "+err.Error(), "BadRequestError")
		return
	}
	r, status, err := e.admit(hr, &body, chat)
	if err != nil {
		e.rejectedKVTransfer(body.KVTransferParams)
		writeError(w, status, err.Error(), "BadRequestError")
		return
	}
	if body.Stream {
		e.stream(w, hr, r, &body, chat)
		return
	}
	var text strings.Builder
	n := 0
	aborted := e.collect(hr.Context(), r, func(tok int) { text.WriteString(detokenize(tok)); n++ })
	if aborted {
		// vLLM's _with_kv_transfer_rejection_cleanup: a non-streaming request that raised (a
		// cancelled client) is rejected too, a second cleanup pull for its transfer.
		e.rejectedKVTransfer(body.KVTransferParams)
		return
	}
	if r.err != nil {
		e.rejectedKVTransfer(body.KVTransferParams)
		writeError(w, http.StatusInternalServerError, r.err.Error(), "InternalServerError")
		return
	}
	resp := map[string]any{
		"id": string(r.id), "created": time.Now().Unix(), "model": e.cfg.Model,
		"usage": Usage{PromptTokens: len(r.tokens), CompletionTokens: n, TotalTokens: len(r.tokens) + n},
	}
	if chat {
		resp["object"] = "chat.completion"
		resp["choices"] = []map[string]any{{"index": 0, "message": ChatMessage{Role: "assistant", Content: text.String()}, "finish_reason": r.finish}}
	} else {
		resp["object"] = "text_completion"
		resp["choices"] = []map[string]any{{"index": 0, "text": text.String(), "logprobs": nil, "finish_reason": r.finish}}
	}
	if p := e.producedParams(r, &body); p != nil {
		resp["kv_transfer_params"] = p
	}
	writeJSON(w, http.StatusOK, resp)
}

// admit validates the request, announces a prefill hold to the agent, and queues it.
func (e *Engine) admit(hr *http.Request, body *CompletionRequest, chat bool) (*request, int, error) {
	var tokens []int
	switch {
	case chat:
		if len(body.Messages) == 0 {
			return nil, http.StatusBadRequest, errors.New("messages must not be empty")
		}
		var sb strings.Builder
		for _, m := range body.Messages {
			fmt.Fprintf(&sb, "<|%s|> %s ", m.Role, m.Content)
		}
		tokens = tokenize(sb.String())
	default:
		if len(body.Prompt) == 0 {
			return nil, http.StatusBadRequest, errors.New("prompt is required")
		}
		var err error
		if tokens, err = parsePrompt(body.Prompt); err != nil {
			return nil, http.StatusBadRequest, err
		}
	}
	if len(tokens) == 0 {
		return nil, http.StatusBadRequest, errors.New("prompt must have at least one token")
	}
	maxTok := 16
	if body.MaxCompletion != nil {
		maxTok = *body.MaxCompletion
	}
	if body.MaxTokens != nil {
		maxTok = *body.MaxTokens
	}
	if maxTok < 1 {
		return nil, http.StatusBadRequest, fmt.Errorf("max_tokens must be at least 1, got %d", maxTok)
	}
	if len(tokens)+maxTok > e.cfg.MaxModelLen {
		return nil, http.StatusBadRequest, fmt.Errorf("this model's maximum context length is %d tokens; the prompt has %d and max_tokens is %d", e.cfg.MaxModelLen, len(tokens), maxTok)
	}
	if body.Model != "" && body.Model != e.cfg.Model {
		return nil, http.StatusNotFound, fmt.Errorf("the model %q does not exist; this engine serves %q", body.Model, e.cfg.Model)
	}
	if blocks := (len(tokens) + e.cfg.BlockSize - 1) / e.cfg.BlockSize; blocks > e.cfg.Capacity {
		return nil, http.StatusBadRequest, fmt.Errorf("prompt needs %d KV blocks, the engine has %d", blocks, e.cfg.Capacity)
	}
	r := &request{
		id: e.newID(), tokens: tokens, hashes: blockHashes(tokens, e.cfg.BlockSize), maxTok: maxTok,
		ignoreEO: body.IgnoreEOS, seed: seedOf(tokens), out: make(chan int, maxTok), done: make(chan struct{}),
	}
	if id := hr.Header.Get("X-Request-Id"); id != "" {
		r.id = kvtransfer.RequestID(id + "-" + string(r.id)) // unique even if a client reuses ids
	}
	if e.cfg.DropKVTransferParams && e.cfg.Role == vllm.KVConsumer {
		body.KVTransferParams = nil
	}
	if p := body.KVTransferParams; p != nil {
		switch {
		case p.DoRemoteDecode && e.cfg.Role != vllm.KVProducer:
			return nil, http.StatusBadRequest, fmt.Errorf("do_remote_decode needs a kv_producer engine; this one is %q", roleName(e.cfg.Role))
		case p.DoRemotePrefill && e.cfg.Role != vllm.KVConsumer:
			return nil, http.StatusBadRequest, fmt.Errorf("do_remote_prefill needs a kv_consumer engine; this one is %q", roleName(e.cfg.Role))
		case p.DoRemoteDecode:
			r.transfer = p.TransferID
			if r.transfer == "" { // the sequential (NIXL-style) flow: this engine names the transfer
				r.transfer = kvtransfer.TransferID("xfer-" + string(r.id))
			}
			if err := e.link.Expect(hr.Context(), r.transfer, r.id); err != nil {
				return nil, http.StatusServiceUnavailable, fmt.Errorf("transfer engine unavailable: %w", err)
			}
		case p.DoRemotePrefill:
			if p.TransferID == "" || p.RemoteEngineID == "" || p.RemoteBootstrapAddr == "" {
				// As vLLM: warn and compute locally rather than wait for a transfer that cannot come.
				e.cfg.Log.Info("kv_transfer_params lack transfer_id, remote_engine_id or remote_bootstrap_addr; computing locally", "request", r.id)
				break
			}
			r.transfer = p.TransferID
		}
	}
	hit := e.localHit(r.hashes[:len(tokens)/e.cfg.BlockSize])
	e.mu.Lock()
	e.reqs[r.id] = r
	if r.transfer != "" && e.cfg.Role == vllm.KVConsumer {
		e.remotes[r.id] = remote{engine: body.KVTransferParams.RemoteEngineID, bootstrap: body.KVTransferParams.RemoteBootstrapAddr}
	}
	e.stats.Requests++
	e.mu.Unlock()
	if err := e.sched.Add(r.id, r.transfer, len(tokens), hit); err != nil {
		e.mu.Lock()
		delete(e.reqs, r.id)
		delete(e.remotes, r.id)
		e.mu.Unlock()
		return nil, http.StatusInternalServerError, err
	}
	e.kick()
	return r, 0, nil
}

// rejectedKVTransfer is vLLM's AsyncLLM.notify_kv_transfer_request_rejected, which its API
// server calls for a decode request that answered an error or raised (a cancelled client): a
// pre-aborted request whose only effect is the connector's cleanup pull (a pull with no local
// block) at the engine's next step.
func (e *Engine) rejectedKVTransfer(p *KVTransferParams) {
	if p == nil || !p.DoRemotePrefill || e.cfg.Role != vllm.KVConsumer ||
		p.TransferID == "" || p.RemoteEngineID == "" || p.RemoteBootstrapAddr == "" {
		return
	}
	r := &request{id: e.newID(), tokens: []int{0}, out: make(chan int, 1), done: make(chan struct{}), transfer: p.TransferID}
	e.mu.Lock()
	e.reqs[r.id] = r
	e.remotes[r.id] = remote{engine: p.RemoteEngineID, bootstrap: p.RemoteBootstrapAddr}
	e.mu.Unlock()
	if err := e.sched.AddAborted(r.id, r.transfer); err != nil {
		e.cfg.Log.Info("rejected request not freed on prefill", "request", r.id, "err", err.Error())
	}
	e.end(r, nil, "abort")
}

func roleName(r vllm.KVRole) string {
	if r == "" {
		return "none"
	}
	return string(r)
}

// collect feeds generated tokens to fn until the request ends; a client that goes away aborts
// the request (vLLM's abort on disconnect). It reports whether the request was aborted.
func (e *Engine) collect(ctx context.Context, r *request, fn func(int)) bool {
	for {
		select {
		case tok, ok := <-r.out:
			if !ok {
				return false
			}
			fn(tok)
		case <-ctx.Done():
			e.abort(r)
			return true
		}
	}
}

func (e *Engine) abort(r *request) {
	if err := e.sched.Abort(r.id); err != nil {
		e.cfg.Log.Info("abort", "request", r.id, "err", err.Error())
	}
	e.end(r, nil, "abort")
	e.kick()
}

// producedParams is what a prefill engine returns for the sequential (NIXL-style) flow: where
// the decode engine pulls from. The concurrent (Mooncake) flow ignores it.
func (e *Engine) producedParams(r *request, body *CompletionRequest) *KVTransferParams {
	if body.KVTransferParams == nil || !body.KVTransferParams.DoRemoteDecode || r.transfer == "" {
		return nil
	}
	return &KVTransferParams{
		DoRemotePrefill: true, TransferID: r.transfer, RemoteEngineID: e.engineIDOf(),
		RemoteBootstrapAddr: e.cfg.BootstrapAddr, RemoteRequestID: string(r.id),
	}
}

// engineIDOf asks the bootstrap registry for this producer's engine id (its dp rank's).
func (e *Engine) engineIDOf() string {
	if e.cfg.BootstrapAddr == "" {
		return ""
	}
	t, err := e.boot.Query(context.Background(), e.cfg.BootstrapAddr)
	if err != nil {
		return ""
	}
	return t[strconv.Itoa(e.cfg.DPRank)].EngineID
}

func (e *Engine) stream(w http.ResponseWriter, hr *http.Request, r *request, body *CompletionRequest, chat bool) {
	fl, _ := w.(http.Flusher)
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	object := "text_completion"
	if chat {
		object = "chat.completion.chunk"
	}
	send := func(v any) {
		b, _ := json.Marshal(v)
		fmt.Fprintf(w, "data: %s\n\n", b)
		if fl != nil {
			fl.Flush()
		}
	}
	chunk := func(text string, finish any) map[string]any {
		c := map[string]any{"index": 0, "finish_reason": finish}
		if chat {
			c["delta"] = map[string]string{"content": text}
		} else {
			c["text"] = text
		}
		return map[string]any{"id": string(r.id), "object": object, "created": time.Now().Unix(), "model": e.cfg.Model, "choices": []any{c}}
	}
	n := 0
	if e.collect(hr.Context(), r, func(tok int) { n++; send(chunk(detokenize(tok), nil)) }) {
		return
	}
	if r.err != nil {
		send(map[string]any{"error": map[string]any{"message": r.err.Error(), "type": "InternalServerError", "code": 500}})
		fmt.Fprint(w, "data: [DONE]\n\n")
		return
	}
	send(chunk("", r.finish))
	if body.StreamOptions != nil && body.StreamOptions.IncludeUsage {
		send(map[string]any{"id": string(r.id), "object": object, "model": e.cfg.Model, "choices": []any{},
			"usage": Usage{PromptTokens: len(r.tokens), CompletionTokens: n, TotalTokens: len(r.tokens) + n}})
	}
	fmt.Fprint(w, "data: [DONE]\n\n")
	if fl != nil {
		fl.Flush()
	}
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func writeError(w http.ResponseWriter, status int, msg, typ string) {
	writeJSON(w, status, map[string]any{"error": map[string]any{"message": msg, "type": typ, "code": status}})
}
