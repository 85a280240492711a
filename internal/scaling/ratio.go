// Package scaling decides how many replicas each pool of a PDCluster runs: what its scaler asks
// (spec.<pool>.replicas, or the pool's PoolScale with spec.scaling.<pool>.mode External),
// brought within spec.scaling's minReplicas/maxReplicas and P:D ratio. It is pure: the
// reconciler and pdctl render call it alike.
package scaling

import (
	"fmt"
	"math/big"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
)

// Pool is one pool's request and bounds.
type Pool struct {
	// Requested is what the pool's scaler asks.
	Requested int32
	// Min and Max bound Requested; Max nil is no bound.
	Min int32
	Max *int32
}

func (p Pool) clamp() int32 {
	n := max(p.Requested, p.Min)
	if p.Max != nil {
		n = min(n, *p.Max)
	}
	return n
}

// fraction is num/den, both above 0.
type fraction struct{ num, den int64 }

// Ratio bounds prefill replicas per decode replica; a nil side is no bound.
type Ratio struct{ min, max *fraction }

// Set reports whether the ratio bounds anything.
func (r Ratio) Set() bool { return r.min != nil || r.max != nil }

// ParseRatio reads spec.scaling.ratio's decimals ("0.5", "2"); "" is no bound.
func ParseRatio(minText, maxText string) (Ratio, error) {
	var r Ratio
	for _, s := range []struct {
		text, name string
		out        **fraction
	}{{minText, "min", &r.min}, {maxText, "max", &r.max}} {
		if s.text == "" {
			continue
		}
		v, ok := new(big.Rat).SetString(s.text)
		if !ok || v.Sign() <= 0 || !v.Num().IsInt64() || v.Denom().Int64() > 100 || v.Num().Int64() > 1<<20 {
			return Ratio{}, fmt.Errorf("spec.scaling.ratio.%s %q: want a decimal above 0 with at most 2 decimal places, such as 0.5", s.name, s.text)
		}
		*s.out = &fraction{v.Num().Int64(), v.Denom().Int64()}
	}
	if r.min != nil && r.max != nil && r.min.num*r.max.den > r.max.num*r.min.den {
		return Ratio{}, fmt.Errorf("spec.scaling.ratio.min %s exceeds max %s", minText, maxText)
	}
	return r, nil
}

// Why says what moved a count away from the request: the reason of the RatioConstrained
// condition.
type Why string

const (
	AsRequested        Why = v1alpha1.ReasonAsRequested
	ReplicaBounds      Why = v1alpha1.ReasonReplicaBounds
	RatioBounds        Why = v1alpha1.ReasonRatioBounds
	RatioUnsatisfiable Why = v1alpha1.ReasonRatioUnsatisfiable
)

// Effective is what the pools run.
type Effective struct {
	Prefill, Decode int32
	Why             Why
}

// searchSlack is how far past the counts the request needs Decide looks for decode counts
// that meet the ratio: a ratio of two-decimal bounds is met by some multiple of 100.
const searchSlack = 100

// Decide brings the requests within each pool's bounds and then within the ratio. Of the
// counts that meet the ratio within the bounds it picks, in order: the one that lowers the
// pools least (none, if raising is enough: a scale-down waits for the scaler to ask for both
// pools), then the one that raises them least. So the short side is raised first, and the
// other lowered only when the short side is at its max. Both pools at 0 is scale to zero; with
// a ratio, one pool at 0 beside a serving one (which cannot serve a request) is raised like
// any short side.
func Decide(prefill, decode Pool, ratio Ratio) Effective {
	p, d := prefill.clamp(), decode.clamp()
	e := Effective{Prefill: p, Decode: d, Why: AsRequested}
	if p != prefill.Requested || d != decode.Requested {
		e.Why = ReplicaBounds
	}
	if !ratio.Set() || (p == 0 && d == 0) {
		return e
	}
	dCap := max(int64(d), ceilTimes(int64(p), ratio.max, true)) + searchSlack
	if decode.Max != nil {
		dCap = min(dCap, int64(*decode.Max))
	}
	best, found := [2]int64{}, false
	var bestLowered, bestRaised int64
	for dd := max(int64(decode.Min), 1); dd <= dCap; dd++ {
		// The prefill counts that meet the ratio with dd decode, within prefill's bounds.
		lo := max(int64(prefill.Min), 1, ceilTimes(dd, ratio.min, false))
		hi := int64(1 << 30)
		if ratio.max != nil {
			hi = dd * ratio.max.num / ratio.max.den
		}
		if prefill.Max != nil {
			hi = min(hi, int64(*prefill.Max))
		}
		if lo > hi {
			continue
		}
		pp := min(max(int64(p), lo), hi)
		lowered := max(int64(p)-pp, 0) + max(int64(d)-dd, 0)
		raised := max(pp-int64(p), 0) + max(dd-int64(d), 0)
		if !found || lowered < bestLowered || (lowered == bestLowered && raised < bestRaised) {
			best, found, bestLowered, bestRaised = [2]int64{pp, dd}, true, lowered, raised
		}
	}
	switch {
	case !found:
		e.Why = RatioUnsatisfiable
	case best != [2]int64{int64(p), int64(d)}:
		e.Prefill, e.Decode, e.Why = int32(best[0]), int32(best[1]), RatioBounds
	}
	return e
}

// ceilTimes is ceil(n*f), or ceil(n/f) when divide; 0 with no f.
func ceilTimes(n int64, f *fraction, divide bool) int64 {
	if f == nil {
		return 0
	}
	num, den := n*f.num, f.den
	if divide {
		num, den = n*f.den, f.num
	}
	return (num + den - 1) / den
}
