package router

import (
	"bytes"
	"encoding/json"
	"net"
	"net/http"
	"strings"
	"time"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/bounded"
)

// The router is a P/D cluster's front door: what a client sends and how long it may take are
// bounded here, and nothing a client sends may steer a leg's KV transfer.

// clientSetsTransferParams reports a body key equal to kv_transfer_params under Unicode case
// folding: an engine whose JSON decoder folds keys (Go's does) would read "kv_tranſfer_params"
// (U+017F) or "KV_TRANSFER_PARAMS" as the router's parameters.
func clientSetsTransferParams(body map[string]json.RawMessage) bool {
	for k := range body {
		if strings.EqualFold(k, vllm.KVTransferParams) {
			return true
		}
	}
	return false
}

// maxRequestIDBytes bounds a client's X-Request-Id, which reaches both engines' logs and ids.
const maxRequestIDBytes = 128

func validRequestID(id string) bool {
	if len(id) > maxRequestIDBytes {
		return false
	}
	for i := 0; i < len(id); i++ {
		if id[i] <= ' ' || id[i] > '~' {
			return false
		}
	}
	return true
}

// maxResponseBytes bounds a non-streaming engine answer the router holds to inspect.
const maxResponseBytes = 64 << 20

// withoutTransferParams is an engine's JSON answer without a non-null kv_transfer_params (it
// names engines, addresses and blocks, which are not the client's to see), and whether it had
// one. vLLM writes the key into every non-streaming answer, null on decode: that answer is
// passed on untouched, without decoding it.
func withoutTransferParams(b []byte) ([]byte, bool) {
	i := bytes.Index(b, []byte(`"`+vllm.KVTransferParams+`"`))
	if i < 0 {
		return nil, false
	}
	rest := bytes.TrimLeft(b[i+len(vllm.KVTransferParams)+2:], " \t\r\n")
	if rest, ok := bytes.CutPrefix(rest, []byte(":")); ok && bytes.HasPrefix(bytes.TrimLeft(rest, " \t\r\n"), []byte("null")) {
		return nil, false
	}
	var answer map[string]json.RawMessage
	if err := json.Unmarshal(b, &answer); err != nil {
		return nil, false
	}
	if _, ok := answer[vllm.KVTransferParams]; !ok {
		return nil, false
	}
	delete(answer, vllm.KVTransferParams)
	return encodeBody(answer), true
}

// upstreamClient is the client of the legs: connections kept for every engine busy at once, a
// bounded dial and wait for headers, and no redirects (a leg goes to its pool's engine only).
func upstreamClient(headerTimeout time.Duration) *http.Client {
	return &http.Client{
		Transport: &http.Transport{
			DialContext:           (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
			MaxIdleConnsPerHost:   256,
			IdleConnTimeout:       90 * time.Second,
			ResponseHeaderTimeout: headerTimeout,
		},
		CheckRedirect: bounded.NoRedirect,
	}
}

// ServerLimits bound a client's connection; a zero field takes its default.
type ServerLimits struct {
	// ReadHeader bounds reading a request's headers (default 10 s).
	ReadHeader time.Duration
	// Read bounds reading a whole request, body included (default 60 s): a body sent a byte at
	// a time would hold its connection and memory forever.
	Read time.Duration
	// Idle bounds a keep-alive connection between requests (default 90 s).
	Idle time.Duration
	// MaxHeaderBytes bounds a request's headers (default 64 KiB).
	MaxHeaderBytes int
}

// NewServer is the router's HTTP server on addr with limits. Responses have no write timeout:
// a streamed completion lasts as long as it generates.
func NewServer(addr string, h http.Handler, limits ServerLimits) *http.Server {
	or := func(d, def time.Duration) time.Duration {
		if d > 0 {
			return d
		}
		return def
	}
	maxHeader := limits.MaxHeaderBytes
	if maxHeader <= 0 {
		maxHeader = 64 << 10
	}
	return &http.Server{
		Addr: addr, Handler: h,
		ReadHeaderTimeout: or(limits.ReadHeader, 10*time.Second),
		ReadTimeout:       or(limits.Read, 60*time.Second),
		IdleTimeout:       or(limits.Idle, 90*time.Second),
		MaxHeaderBytes:    maxHeader,
	}
}
