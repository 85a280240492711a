// HTTP plumbing: posting a leg, reading and copying engine answers, errors, the status a
// handler wrote.

package router

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"

	"pdcluster.dev/pdcluster-operator/internal/bounded"
)

func (r *Router) post(ctx context.Context, url string, body map[string]json.RawMessage, reqID string, headers map[string]string) (*http.Response, error) {
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(encodeBody(body)))
	if err != nil {
		return nil, err
	}
	hr.Header.Set("Content-Type", "application/json")
	hr.Header.Set("X-Request-Id", reqID)
	for k, v := range headers {
		hr.Header.Set(k, v)
	}
	return r.hc.Do(hr)
}

// drain ends a leg whose answer the client never sees (Mooncake's prefill): its error, or nil.
func drain(resp *http.Response) error {
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", resp.Status, bounded.Snippet(resp.Body))
	}
	// Read what is left (a short completion), so the connection is kept for the next leg.
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	return nil
}

// copyResponse streams resp to w: a stream of server-sent events flushed as chunks arrive,
// any other answer copied whole with its length (no flush per read, no chunked encoding).
func copyResponse(w http.ResponseWriter, resp *http.Response) {
	stream := strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream")
	for _, h := range []string{"Content-Type", "Cache-Control", "Content-Length"} {
		if v := resp.Header.Get(h); v != "" && (h != "Content-Length" || !stream) {
			w.Header().Set(h, v)
		}
	}
	if !stream {
		b, err := bounded.ReadAll(resp.Body, maxResponseBytes)
		if err != nil {
			w.Header().Del("Content-Length")
			writeError(w, http.StatusBadGateway, "read engine answer: "+err.Error())
			return
		}
		if stripped, ok := withoutTransferParams(b); ok {
			b = stripped
			w.Header().Set("Content-Length", strconv.Itoa(len(b)))
		}
		w.WriteHeader(resp.StatusCode)
		_, _ = w.Write(b)
		return
	}
	w.WriteHeader(resp.StatusCode)
	fl, _ := w.(http.Flusher)
	buf := make([]byte, 32<<10)
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				return
			}
			if fl != nil {
				fl.Flush()
			}
		}
		if err != nil {
			return
		}
	}
}

func writeError(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]any{"error": map[string]any{"message": msg, "code": status}})
}

type statusWriter struct {
	http.ResponseWriter
	status int
}

func (s *statusWriter) WriteHeader(code int) {
	if s.status == 0 {
		s.status = code
	}
	s.ResponseWriter.WriteHeader(code)
}

func (s *statusWriter) Write(b []byte) (int, error) {
	if s.status == 0 {
		s.status = http.StatusOK
	}
	return s.ResponseWriter.Write(b)
}

func (s *statusWriter) Flush() {
	if f, ok := s.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

func (s *statusWriter) code() int {
	if s.status == 0 {
		return 499 // the client went away before an answer
	}
	return s.status
}
