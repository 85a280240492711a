package enginesim

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// The collector registers for every engine: with a connector's counters, and without (an
// engine without P/D, as the sandbox's reference engines are).
func TestCollectorRegisters(t *testing.T) {
	for _, connector := range []string{"", "mooncake", "nixl"} {
		e, err := New(Config{Model: "m", BlockSize: 16, Capacity: 16, Connector: connector})
		if err != nil {
			t.Fatal(err)
		}
		reg := prometheus.NewRegistry()
		if err := reg.Register(Collector(e)); err != nil {
			t.Fatalf("connector %q: %v", connector, err)
		}
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		if want := map[string]int{"": 1, "mooncake": 3, "nixl": 3}[connector]; len(mfs) != want {
			t.Errorf("connector %q: %d metric families, want %d", connector, len(mfs), want)
		}
	}
}
