// HTTP plumbing: posting a leg, reading and copying engine answers, errors, the status a
// handler wrote.

package router

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
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

// copyResponse streams resp to w (an answer the router does not retry).
func copyResponse(w http.ResponseWriter, resp *http.Response) {
	_ = relay(w, resp, committed{})
}

// committer says whether an answer may still be written: an attempt not abandoned.
type committer interface{ commit() bool }

// committed is an answer that is always the client's.
type committed struct{}

func (committed) commit() bool { return true }

// relay answers the client with decode's answer: a stream of server-sent events flushed as
// chunks arrive, any other answer copied whole with its length (no flush per read, no chunked
// encoding). Nothing is written before commit says the answer is the client's: a stream's
// headers wait for its first bytes, so a failure before them can still be retried. It returns
// errRead when the answer broke before anything was written, errCommit when commit refused.
func relay(w http.ResponseWriter, resp *http.Response, c committer) error {
	stream := strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream")
	if !stream {
		b, err := bounded.ReadAll(resp.Body, maxResponseBytes)
		if err != nil && !errors.Is(err, bounded.ErrTooLarge) {
			return fmt.Errorf("%w: %v", errRead, err)
		}
		if !c.commit() {
			return errCommit
		}
		copyHeader(w, resp, false)
		if err != nil {
			w.Header().Del("Content-Length")
			writeError(w, http.StatusBadGateway, "read engine answer: "+err.Error())
			return nil
		}
		if stripped, ok := withoutTransferParams(b); ok {
			b = stripped
			w.Header().Set("Content-Length", strconv.Itoa(len(b)))
		}
		w.WriteHeader(resp.StatusCode)
		_, _ = w.Write(b)
		return nil
	}
	buf := make([]byte, 32<<10)
	n, err := resp.Body.Read(buf)
	for n == 0 && err == nil {
		n, err = resp.Body.Read(buf)
	}
	if n == 0 && !errors.Is(err, io.EOF) {
		return fmt.Errorf("%w: %v", errRead, err)
	}
	if !c.commit() {
		return errCommit
	}
	copyHeader(w, resp, true)
	w.WriteHeader(resp.StatusCode)
	fl, _ := w.(http.Flusher)
	for {
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				return nil
			}
			if fl != nil {
				fl.Flush()
			}
		}
		if err != nil {
			return nil
		}
		n, err = resp.Body.Read(buf)
	}
}

// copyHeader copies the headers of resp the client needs (a stream's length is not known).
func copyHeader(w http.ResponseWriter, resp *http.Response, stream bool) {
	for _, h := range []string{"Content-Type", "Cache-Control", "Content-Length"} {
		if v := resp.Header.Get(h); v != "" && (h != "Content-Length" || !stream) {
			w.Header().Set(h, v)
		}
	}
}

var (
	errRead   = errors.New("the answer broke before its first byte")
	errCommit = errors.New("the attempt was abandoned")
)

func writeError(w http.ResponseWriter, status int, msg string) {
	writeTypedError(w, status, "", msg, nil)
}

// writeTypedError is an OpenAI-style error answer with a type a client can act on and more
// fields about it (the engine that hung, say).
func writeTypedError(w http.ResponseWriter, status int, typ, msg string, fields map[string]any) {
	e := map[string]any{"message": msg, "code": status}
	if typ != "" {
		e["type"] = typ
	}
	for k, v := range fields {
		e[k] = v
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]any{"error": e})
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
