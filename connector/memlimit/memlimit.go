// Package memlimit sets a Go program's soft memory limit from its container's memory limit,
// which the operator passes to the router and the sidecar (--memory-limit, from the downward
// API): without it the collector does not know the container's bound, and the router's GOGC of
// 400 lets its heap grow to five times what it holds before collecting.
package memlimit

import "runtime/debug"

// Percent of the container's limit the runtime keeps its memory under: the rest is for what
// the soft limit does not bound at once (the collector's lag, memory outside the Go heap).
const Percent = 90

// Apply sets the runtime's soft memory limit to Percent of limit bytes and returns it, unless
// the environment set GOMEMLIMIT (its choice stands) or limit is not positive (none known):
// then it returns 0 and changes nothing.
func Apply(limit int64, getenv func(string) string) int64 {
	if limit <= 0 || getenv("GOMEMLIMIT") != "" {
		return 0
	}
	soft := limit / 100 * Percent
	debug.SetMemoryLimit(soft)
	return soft
}
