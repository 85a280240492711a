package scaling

import (
	"testing"

	"github.com/google/go-cmp/cmp"
	"k8s.io/utils/ptr"
)

func TestDecide(t *testing.T) {
	ratio := func(minText, maxText string) Ratio {
		r, err := ParseRatio(minText, maxText)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	pool := func(req, lo int32, hi *int32) Pool { return Pool{Requested: req, Min: lo, Max: hi} }
	cases := []struct {
		name            string
		prefill, decode Pool
		ratio           Ratio
		want            Effective
	}{
		{"no bounds", pool(3, 0, nil), pool(5, 0, nil), Ratio{}, Effective{3, 5, AsRequested}},
		{"no ratio: a pool at 0 stays", pool(0, 0, nil), pool(2, 0, nil), Ratio{}, Effective{0, 2, AsRequested}},
		{"within the ratio", pool(2, 1, nil), pool(4, 1, nil), ratio("0.5", "1"), Effective{2, 4, AsRequested}},
		{"request below min", pool(0, 1, nil), pool(2, 1, nil), Ratio{}, Effective{1, 2, ReplicaBounds}},
		{"request above max", pool(9, 1, ptr.To[int32](4)), pool(2, 1, nil), Ratio{}, Effective{4, 2, ReplicaBounds}},
		{"prefill short: raised", pool(1, 1, nil), pool(6, 1, nil), ratio("0.5", ""), Effective{3, 6, RatioBounds}},
		{"decode short: raised", pool(8, 1, nil), pool(2, 1, nil), ratio("", "2"), Effective{8, 4, RatioBounds}},
		{"decode short, a fractional max: ceil", pool(5, 1, nil), pool(1, 1, nil), ratio("", "1.5"), Effective{5, 4, RatioBounds}},
		{"prefill at its max: decode lowered to what it can feed", pool(2, 1, ptr.To[int32](2)), pool(8, 1, nil), ratio("0.5", ""), Effective{2, 4, RatioBounds}},
		{"decode at its max: prefill lowered to what it can drain", pool(10, 1, nil), pool(2, 1, ptr.To[int32](3)), ratio("", "2"), Effective{6, 3, RatioBounds}},
		{"saturated at both maxes", pool(9, 1, ptr.To[int32](4)), pool(9, 1, ptr.To[int32](4)), ratio("0.5", "2"), Effective{4, 4, ReplicaBounds}},
		{"both at 0: scale to zero", pool(0, 0, nil), pool(0, 0, nil), ratio("0.5", "2"), Effective{0, 0, AsRequested}},
		{"prefill at 0 beside decode: raised", pool(0, 0, nil), pool(3, 0, nil), ratio("0.25", "4"), Effective{1, 3, RatioBounds}},
		{"decode at 0 beside prefill: raised", pool(2, 0, nil), pool(0, 0, nil), ratio("0.5", "4"), Effective{2, 1, RatioBounds}},
		{"a pool at 0 with only a max ratio: raised to 1", pool(0, 0, nil), pool(5, 0, nil), ratio("", "4"), Effective{1, 5, RatioBounds}},
		{"exact ratio met by raising both", pool(1, 1, nil), pool(3, 1, nil), ratio("0.5", "0.5"), Effective{2, 4, RatioBounds}},
		{"exact ratio of 7:10", pool(1, 1, nil), pool(3, 1, nil), ratio("0.7", "0.7"), Effective{7, 10, RatioBounds}},
		{"unsatisfiable within the bounds", pool(1, 1, ptr.To[int32](1)), pool(4, 4, nil), ratio("0.5", ""), Effective{1, 4, RatioUnsatisfiable}},
		{"bounds and ratio together", pool(0, 2, nil), pool(1, 1, ptr.To[int32](2)), ratio("", "1"), Effective{2, 2, RatioBounds}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := Decide(c.prefill, c.decode, c.ratio)
			if d := cmp.Diff(c.want, got); d != "" {
				t.Errorf("Decide (-want +got):\n%s", d)
			}
			if c.want.Why == RatioUnsatisfiable {
				return
			}
			// Whatever the request, the result is within the bounds and the ratio.
			for _, pc := range []struct {
				n int32
				p Pool
			}{{got.Prefill, c.prefill}, {got.Decode, c.decode}} {
				if pc.n < pc.p.Min || (pc.p.Max != nil && pc.n > *pc.p.Max) {
					t.Errorf("%d outside [%d, %v]", pc.n, pc.p.Min, pc.p.Max)
				}
			}
			if c.ratio.Set() && (got.Prefill != 0 || got.Decode != 0) {
				if got.Decode == 0 || got.Prefill == 0 {
					t.Errorf("%d:%d: a pool at 0 beside a serving one", got.Prefill, got.Decode)
				}
				if r := c.ratio.min; r != nil && int64(got.Prefill)*r.den < int64(got.Decode)*r.num {
					t.Errorf("%d:%d below ratio min %d/%d", got.Prefill, got.Decode, r.num, r.den)
				}
				if r := c.ratio.max; r != nil && int64(got.Prefill)*r.den > int64(got.Decode)*r.num {
					t.Errorf("%d:%d above ratio max %d/%d", got.Prefill, got.Decode, r.num, r.den)
				}
			}
		})
	}
}

func TestParseRatio(t *testing.T) {
	for _, c := range []struct {
		min, max string
		ok       bool
	}{
		{"0.5", "2", true}, {"", "", true}, {"1", "1", true}, {"0.25", "", true},
		{"2", "0.5", false}, {"0", "", false}, {"-1", "", false}, {"abc", "", false}, {"0.001", "", false},
	} {
		_, err := ParseRatio(c.min, c.max)
		if (err == nil) != c.ok {
			t.Errorf("ParseRatio(%q, %q) = %v, want ok %v", c.min, c.max, err, c.ok)
		}
	}
}
