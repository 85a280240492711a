package memlimit

import (
	"math"
	"runtime/debug"
	"testing"
)

func TestApply(t *testing.T) {
	defer debug.SetMemoryLimit(debug.SetMemoryLimit(-1)) // restore the test binary's
	env := func(v string) func(string) string {
		return func(k string) string {
			if k == "GOMEMLIMIT" {
				return v
			}
			return ""
		}
	}
	for _, tc := range []struct {
		name   string
		limit  int64
		gomem  string
		want   int64
		wantRT int64 // the runtime's limit after
	}{
		{"a container limit", 1 << 30, "", (1 << 30) / 100 * 90, (1 << 30) / 100 * 90},
		{"no limit known", 0, "", 0, math.MaxInt64},
		{"GOMEMLIMIT set", 1 << 30, "500MiB", 0, math.MaxInt64},
	} {
		t.Run(tc.name, func(t *testing.T) {
			debug.SetMemoryLimit(math.MaxInt64)
			if got := Apply(tc.limit, env(tc.gomem)); got != tc.want {
				t.Errorf("Apply(%d) = %d, want %d", tc.limit, got, tc.want)
			}
			if got := debug.SetMemoryLimit(-1); got != tc.wantRT {
				t.Errorf("the runtime's limit = %d, want %d", got, tc.wantRT)
			}
		})
	}
}
