package routerconfig

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestLoad(t *testing.T) {
	cases := []struct {
		name, json, wantErr string
		wantFlow            Flow
	}{
		{"mooncake", `{"flow":"mooncake","prefillHost":"p","decodeHost":"d","enginePort":8000,"bootstrapPort":8998}`, "", FlowMooncake},
		{"nixl", `{"flow":"nixl","prefillHost":"p","decodeHost":"d","enginePort":8000}`, "", FlowNIXL},
		{"mooncake without bootstrap", `{"flow":"mooncake","prefillHost":"p","decodeHost":"d","enginePort":8000}`, "needs bootstrapPort", ""},
		{"unknown flow", `{"flow":"x","prefillHost":"p","decodeHost":"d","enginePort":8000}`, "flow must be mooncake or nixl", ""},
		{"some hosts", `{"flow":"nixl","enginePort":8000}`, "prefillHost, decodeHost and enginePort go together", ""},
		{"no pools (given by flag)", `{"flow":"nixl"}`, "", FlowNIXL},
		{"failure policy", `{"flow":"nixl","failurePolicy":{"retries":0,"retryBudgetPercent":0,"ejectSeconds":1,"onPrefillFailure":"Fail"}}`, "", FlowNIXL},
		{"bad budget", `{"flow":"nixl","failurePolicy":{"retries":1,"retryBudgetPercent":101,"ejectSeconds":1,"onPrefillFailure":"Retry"}}`, "retryBudgetPercent must be 0 to 100", ""},
		{"bad eject", `{"flow":"nixl","failurePolicy":{"retries":1,"retryBudgetPercent":1,"ejectSeconds":0,"onPrefillFailure":"Retry"}}`, "ejectSeconds must be at least 1", ""},
		{"bad action", `{"flow":"nixl","failurePolicy":{"retries":1,"retryBudgetPercent":1,"ejectSeconds":1,"onPrefillFailure":"Pray"}}`, "onPrefillFailure must be Retry, Fail or DecodeOnly", ""},
		{"not JSON", `flow: x`, "decode router config", ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), FileName)
			if err := os.WriteFile(path, []byte(tc.json), 0o600); err != nil {
				t.Fatal(err)
			}
			f, err := Load(path)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if f.Flow != tc.wantFlow {
				t.Errorf("flow = %s, want %s", f.Flow, tc.wantFlow)
			}
			if strings.Contains(tc.json, "failurePolicy") == (f.Failure() == DefaultFailurePolicy()) {
				t.Errorf("failure policy = %+v: a file's own policy must be read, and the default taken only without one", f.Failure())
			}
		})
	}
}

// Each revision of router.json names its revision and both Services.
func TestRevisionsValidate(t *testing.T) {
	f := File{Flow: FlowNIXL, PrefillHost: "p", DecodeHost: "d", EnginePort: 8000,
		Revisions: []RevisionHosts{{Revision: "r1", PrefillHost: "p1", DecodeHost: "d1"}}}
	if err := f.Validate(); err != nil {
		t.Errorf("valid revisions refused: %v", err)
	}
	f.Revisions = append(f.Revisions, RevisionHosts{Revision: "r2", PrefillHost: "p2"})
	if err := f.Validate(); err == nil || !strings.Contains(err.Error(), "decodeHost") {
		t.Errorf("a revision without decodeHost: %v", err)
	}
}

func TestRoutingValidate(t *testing.T) {
	events := &KVEventsEndpoints{Port: 5557, ReplayPort: 5757, Topic: "kv"}
	for _, tc := range []struct {
		name    string
		routing Routing
		balance Balance
		wantErr string
	}{
		{"least in flight", Routing{Strategy: RoutingLeastInFlight}, BalanceRoundRobin, ""},
		{"prefix aware", Routing{Strategy: RoutingPrefixAware, LoadSlack: 2}, BalanceLeastInFlight, ""},
		{"prefix aware with round robin", Routing{Strategy: RoutingPrefixAware}, BalanceRoundRobin, "needs balance least-in-flight"},
		{"prefix aware with kv events ports", Routing{Strategy: RoutingPrefixAware, KVEvents: events}, BalanceLeastInFlight, "routing.kvEvents is for strategy KVEvents only"},
		{"kv events", Routing{Strategy: RoutingKVEvents, KVEvents: events}, BalanceLeastInFlight, ""},
		{"kv events without ports", Routing{Strategy: RoutingKVEvents}, BalanceLeastInFlight, "needs routing.kvEvents"},
		{"kv events on one port", Routing{Strategy: RoutingKVEvents, KVEvents: &KVEventsEndpoints{Port: 5557, ReplayPort: 5557}}, BalanceLeastInFlight, "two different ports"},
		{"kv events with round robin", Routing{Strategy: RoutingKVEvents, KVEvents: events}, BalanceRoundRobin, "needs balance least-in-flight"},
		{"unknown", Routing{Strategy: "Sticky"}, BalanceLeastInFlight, `must be LeastInFlight, PrefixAware or KVEvents, got "Sticky"`},
		{"negative slack", Routing{Strategy: RoutingPrefixAware, LoadSlack: -1}, BalanceLeastInFlight, "must not be negative"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.routing.Validate(tc.balance)
			if (err == nil) != (tc.wantErr == "") || (err != nil && !strings.Contains(err.Error(), tc.wantErr)) {
				t.Errorf("Validate() = %v, want an error with %q", err, tc.wantErr)
			}
		})
	}
}
