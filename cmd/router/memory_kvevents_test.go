package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
	"pdcluster.dev/pdcluster-operator/test/realengine"
	"pdcluster.dev/pdcluster-operator/test/sim/kvpublish"
	"pdcluster.dev/pdcluster-operator/test/sim/sandbox"
)

// Issue 56, medium 5: routing by the engines' KV events, a router parsed and hashed every
// token-id prompt outside its body budget. 8 clients at once sending 8 MiB of token ids took a
// 1 GiB router to 681 MiB (block size 16) and 930 MiB (block size 1), against 286 MiB for the
// same load routed by load alone. The same loads again, on the router binary with its default
// 1 GiB limit, prompts of single-digit ids (the most a body holds), engines publishing blocks
// of 1 token: KVEvents' peak resident memory stays within twice LeastInFlight's, measured in
// the same run, whether the body budget holds every prompt's ids (4 clients: all parsed and
// matched; 1.5 times measured) or not (8: the bodies fill it, and the prompts are routed by
// estimate; 1.0). The old code: 2.9 and 2.7 times.
func TestMemoryOfTokenPromptsUnderKVEvents(t *testing.T) {
	// The collector runs often, so that the peaks are what was live more than when a
	// collection happened to run (with the default GOGC they varied by a quarter run to run).
	t.Setenv("GOGC", "25")
	for _, clients := range []int{4, 8} {
		t.Run(fmt.Sprintf("%d clients", clients), func(t *testing.T) { tokenPromptsMemory(t, clients) })
	}
}

func tokenPromptsMemory(t *testing.T, clients int) {
	const (
		limit = 1 << 30
		body  = 8 << 20
		// margin over LeastInFlight's peak: KVEvents keeps an index and parses the ids the
		// budget charged (4 bytes each).
		margin = 2.0
	)
	// ids are a prompt of token ids, body bytes long; the engines hold its first 64 tokens.
	var b strings.Builder
	b.WriteString(`{"max_tokens":1,"prompt":[`)
	var ids []uint32
	for i := 0; b.Len() < body-16; i++ {
		if i > 0 {
			b.WriteByte(',')
		}
		id := uint32(i % 10) // the most ids a body can hold: 2 bytes each

		ids = append(ids, id)
		b.WriteString(strconv.Itoa(int(id)))
	}
	b.WriteString("]}")
	prompt := b.String()

	peaks := map[routerconfig.RoutingStrategy]int64{}
	for _, strategy := range []routerconfig.RoutingStrategy{routerconfig.RoutingLeastInFlight, routerconfig.RoutingKVEvents} {
		prefill, boot, decode := loadEngines(t)
		ports, err := sandbox.FreePorts(4)
		if err != nil {
			t.Fatal(err)
		}
		routing := routerconfig.Routing{Strategy: strategy, LoadSlack: 2}
		args := []string{"--prefill=" + prefill + "," + boot, "--decode=" + decode, "--memory-limit=" + strconv.Itoa(limit), "--max-body-bytes=" + strconv.Itoa(body+(1<<20))}
		var pubs []*kvpublish.Publisher
		if strategy == routerconfig.RoutingKVEvents {
			routing.KVEvents = &routerconfig.KVEventsEndpoints{Port: 1, ReplayPort: 2, Topic: "kv"}
			for i, e := range []string{prefill, decode} {
				at := func(port int) string { return "tcp://127.0.0.1:" + strconv.Itoa(port) }
				p, err := kvpublish.Listen(at(ports[2*i]), at(ports[2*i+1]), "kv", 0)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(p.Close)
				pubs = append(pubs, p)
				args = append(args, fmt.Sprintf("--kv-events-ports=%s=%d,%d", e, ports[2*i], ports[2*i+1]))
			}
		}
		config, err := json.Marshal(routerconfig.File{Flow: routerconfig.FlowMooncake, Routing: &routing})
		if err != nil {
			t.Fatal(err)
		}
		path := filepath.Join(t.TempDir(), "router.json")
		if err := os.WriteFile(path, config, 0o600); err != nil {
			t.Fatal(err)
		}
		url, pid := runRouter(t, append(args, "--config="+path)...)
		// Both engines state block size 1 and hold the prompt's first 64 tokens, as the
		// router's index says (a publisher drops what it sends before the router subscribed).
		for deadline := time.Now().Add(20 * time.Second); len(pubs) > 0 && scrape(t, url, "pdcluster_router_kv_events_index_blocks") < 128; time.Sleep(100 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("the router's index holds %v blocks, want the engines' 128", scrape(t, url, "pdcluster_router_kv_events_index_blocks"))
			}
			for _, p := range pubs {
				hashes := make([]uint64, 64)
				for i := range hashes {
					hashes[i] = uint64(1000 + i)
				}
				if err := p.Publish(kvpublish.Stored(hashes, nil, ids[:64], 1)); err != nil {
					t.Fatal(err)
				}
			}
		}

		byCode := load(t, url, prompt, clients)
		if byCode[http.StatusOK] == 0 || byCode[http.StatusOK]+byCode[http.StatusServiceUnavailable] != clients {
			t.Errorf("%s: answers by status %v: want some served and the rest refused with 503 (no failed connection)", strategy, byCode)
		}
		if strategy == routerconfig.RoutingKVEvents {
			// The prompts were routed by the events (or by estimate where the budget could not
			// also hold their ids), never parsed outside it.
			matched, budget := scrape(t, url, "pdcluster_router_kv_events_matched_blocks_total"), scrape(t, url, "pdcluster_router_kv_events_estimated_total", "reason", "budget")
			t.Logf("KVEvents: %v blocks matched, %v requests estimated for the budget", matched, budget)
			if clients == 4 && (matched == 0 || budget > 0) {
				t.Error("want every prompt's ids parsed and matched against the engines' events: the load did not exercise the parse")
			}
		}
		peaks[strategy] = peakRSS(t, pid)
		t.Logf("%s: router peak resident memory %d MiB of a %d MiB limit; answers by status %v", strategy, peaks[strategy]>>20, limit>>20, byCode)
	}
	if k, l := peaks[routerconfig.RoutingKVEvents], peaks[routerconfig.RoutingLeastInFlight]; float64(k) > margin*float64(l) {
		t.Errorf("KVEvents' peak resident memory %d MiB, LeastInFlight's %d MiB under the same load: want within %.2f times", k>>20, l>>20, margin)
	}
}

// scrape is realengine.Metric (the router's metric name summed over the series with labels),
// failing the test when it cannot be read.
func scrape(t *testing.T, url, name string, labels ...string) float64 {
	t.Helper()
	v, err := realengine.Metric(context.Background(), url, name, labels...)
	if err != nil {
		t.Fatal(err)
	}
	return v
}
