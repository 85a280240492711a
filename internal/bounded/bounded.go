// Package bounded reads HTTP answers from peers that are not trusted to be small or to stay
// where they were asked: the router's engines, the Mooncake bootstrap registries, the
// connector sidecars the operator reads. Every reader of such an answer goes through here, so
// the bounds and the refusal to follow redirects are one decision, not one per call site.
package bounded

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/http"
)

// ErrRedirect is returned for a redirect: a peer is asked at the address it was found at
// (a registry its engine registered, an engine of a pool, a pod's IP), never where it points.
var ErrRedirect = errors.New("the peer answered with a redirect, which is not followed")

// NoRedirect is an http.Client.CheckRedirect that follows none.
func NoRedirect(*http.Request, []*http.Request) error { return ErrRedirect }

// ErrTooLarge is returned by ReadAll for a body past its limit.
var ErrTooLarge = errors.New("answer too large")

// ReadAll reads r whole, failing with ErrTooLarge past limit bytes (never a silently
// truncated answer).
func ReadAll(r io.Reader, limit int) ([]byte, error) {
	b, err := io.ReadAll(io.LimitReader(r, int64(limit)+1))
	if err != nil {
		return nil, err
	}
	if len(b) > limit {
		return nil, fmt.Errorf("%w: larger than %d bytes", ErrTooLarge, limit)
	}
	return b, nil
}

// snippetBytes is how much of an error answer goes into an error message.
const snippetBytes = 4 << 10

// Snippet is the start of an error answer's body, trimmed, for an error message; what does not
// fit is left unread.
func Snippet(r io.Reader) string {
	b, _ := io.ReadAll(io.LimitReader(r, snippetBytes))
	return string(bytes.TrimSpace(b))
}
