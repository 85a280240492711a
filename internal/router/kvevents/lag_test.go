package kvevents

import (
	"math"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/vmihailenco/msgpack/v5"
)

// A batch's lag is from the engine's own timestamp: one dated 1970, far in the future, or not
// a number leaves the stream's last lag as it was (issue 56: a hostile engine put 56 years in
// status); one a little ahead of the router's clock is no lag.
func TestBatchLagOnlyFromPlausibleDates(t *testing.T) {
	now := time.Now()
	sec := func(d time.Duration) float64 { return float64(now.Add(-d).UnixNano()) / 1e9 }
	for _, tc := range []struct {
		name string
		ts   float64
		want time.Duration // -1: no lag
	}{
		{"250 ms late", sec(250 * time.Millisecond), 250 * time.Millisecond},
		{"59 minutes late", sec(59 * time.Minute), 59 * time.Minute},
		{"10 s ahead: skewed clocks", sec(-10 * time.Second), 0},
		{"dated 1970", 1, -1},
		{"dated 0", 0, -1},
		{"two hours late", sec(2 * time.Hour), -1},
		{"an hour ahead", sec(-time.Hour), -1},
		{"NaN", math.NaN(), -1},
		{"infinite", math.Inf(1), -1},
		{"past int64 nanoseconds", 1e300, -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := &Follower{Index: NewIndex(16, 0)}
			f.update("e", func(s *Stream) { s.Lag = 7 * time.Second })
			payload, err := msgpack.Marshal([]any{tc.ts, []any{}, 0})
			if err != nil {
				t.Fatal(err)
			}
			f.apply("e", payload, logr.Discard())
			got := f.Streams()["e"].Lag
			want := tc.want
			if want < 0 {
				want = 7 * time.Second
			}
			// Within 5 s: the test's own time between now and apply's.
			if got < want || got > want+5*time.Second {
				t.Errorf("lag %v, want %v", got, want)
			}
		})
	}
}
