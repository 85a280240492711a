package router

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/go-logr/logr"
	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

func fakeLookup(answers map[string][]string) Lookup {
	return func(_ context.Context, host string) ([]string, error) {
		ips, ok := answers[host]
		if !ok {
			return nil, errors.New("no such host")
		}
		return append([]string(nil), ips...), nil
	}
}

// dnsLookup answers like DNS: a name it does not know is not found (a Service without a ready
// pod).
func dnsLookup(answers map[string][]string) Lookup {
	return func(_ context.Context, host string) ([]string, error) {
		if ips, ok := answers[host]; ok {
			return ips, nil
		}
		return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
	}
}

var mooncakeFile = routerconfig.File{Flow: routerconfig.FlowMooncake, PrefillHost: "c-prefill.ns.svc", DecodeHost: "c-decode.ns.svc", EnginePort: 8000, BootstrapPort: 8998}

func TestResolvePoolsGivesOneEndpointPerPodInAStableOrder(t *testing.T) {
	lookup := fakeLookup(map[string][]string{
		"c-prefill.ns.svc": {"10.0.0.2", "10.0.0.1"},
		"c-decode.ns.svc":  {"fd00::3"},
	})
	got, err := ResolvePools(context.Background(), mooncakeFile, lookup)
	if err != nil {
		t.Fatal(err)
	}
	want := Pools{
		Prefill: []Prefill{{URL: "http://10.0.0.1:8000", Bootstrap: "http://10.0.0.1:8998"}, {URL: "http://10.0.0.2:8000", Bootstrap: "http://10.0.0.2:8998"}},
		Decode:  []string{"http://[fd00::3]:8000"},
	}
	if d := cmp.Diff(want, got, cmpopts.IgnoreUnexported(Pools{})); d != "" {
		t.Errorf("pools (-want +got):\n%s", d)
	}
	nixl := mooncakeFile
	nixl.Flow, nixl.BootstrapPort = "sequential", 0
	got, err = ResolvePools(context.Background(), nixl, lookup)
	if err != nil || got.Prefill[0].Bootstrap != "" {
		t.Errorf("sequential flow: %+v, %v; want prefill without a bootstrap", got, err)
	}
	if _, err := ResolvePools(context.Background(), mooncakeFile, fakeLookup(nil)); err == nil || !strings.Contains(err.Error(), "c-prefill.ns.svc") {
		t.Errorf("err = %v, want the host that did not resolve", err)
	}
}

// A pool whose Service has no ready pod (its only pod being deleted or not ready yet) has no
// DNS name: the pool is empty, so the router answers at once that it has no engine instead of
// sending requests to the pod going away; any other DNS failure keeps the last pools. Found
// on real vLLM pods: with the only prefill pod deleted, the router kept sending to it until
// vLLM exited and the requests in flight hung.
func TestResolvePoolsEmptiesAPoolWithoutReadyPods(t *testing.T) {
	got, err := ResolvePools(context.Background(), mooncakeFile, dnsLookup(map[string][]string{"c-decode.ns.svc": {"10.0.0.2"}}))
	if err != nil {
		t.Fatalf("a Service without a ready pod: %v, want an empty pool", err)
	}
	want := Pools{Decode: []string{"http://10.0.0.2:8000"}}
	if d := cmp.Diff(want, got, cmpopts.IgnoreUnexported(Pools{})); d != "" {
		t.Errorf("pools (-want +got):\n%s", d)
	}
	failing := func(ctx context.Context, host string) ([]string, error) {
		return nil, &net.DNSError{Err: "server misbehaving", Name: host, IsTemporary: true}
	}
	if _, err := ResolvePools(context.Background(), mooncakeFile, failing); err == nil {
		t.Error("a DNS failure other than not found emptied the pools")
	}
}

// A router started from a config file has no engines until the first resolution: it answers
// 503, then proxies to the pools SetPools gives it.
func TestRouterServesThePoolsItIsGiven(t *testing.T) {
	r, err := New(Config{Flow: routerconfig.FlowNIXL}, logr.Discard(), nil)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(r.Handler(nil))
	defer srv.Close()
	if code, body := send(t, srv.URL, `{"prompt":"x"}`); code != http.StatusServiceUnavailable || !strings.Contains(body, "no ready engines") {
		t.Errorf("without engines: %d %s, want 503", code, body)
	}
	if resp, err := http.Get(srv.URL + "/v1/models"); err != nil || resp.StatusCode != http.StatusServiceUnavailable {
		t.Errorf("/v1/models without engines: %v %v, want 503", resp, err)
	}

	p := &fakeEngine{reply: `{"kv_transfer_params":{"do_remote_prefill":true,"transfer_id":"t"}}`}
	d := &fakeEngine{reply: `{"choices":[]}`}
	ps, ds := httptest.NewServer(p), httptest.NewServer(d)
	defer ps.Close()
	defer ds.Close()
	if err := r.SetPools(Pools{Prefill: []Prefill{{URL: ps.URL}}, Decode: []string{ds.URL}}); err != nil {
		t.Fatal(err)
	}
	if code, body := send(t, srv.URL, `{"prompt":"x"}`); code != http.StatusOK {
		t.Fatalf("with engines: %d %s", code, body)
	}
	d.last(t) // decode got the request

	moon, err := New(Config{Flow: routerconfig.FlowMooncake}, logr.Discard(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := moon.SetPools(Pools{Prefill: []Prefill{{URL: ps.URL}}, Decode: []string{ds.URL}}); err == nil {
		t.Error("mooncake pools without a bootstrap registry were accepted")
	}
}

// With revisions each revision's pair of Services is resolved on its own; one whose Service
// has no ready pod (NXDOMAIN) is empty in that pool, while any other DNS failure fails the
// resolution (the router keeps its last pools).
func TestResolvePoolsByRevision(t *testing.T) {
	fc := mooncakeFile
	fc.Revisions = []routerconfig.RevisionHosts{
		{Revision: "r1", PrefillHost: "c-prefill-r1.ns.svc", DecodeHost: "c-decode-r1.ns.svc"},
		{Revision: "r2", PrefillHost: "c-prefill-r2.ns.svc", DecodeHost: "c-decode-r2.ns.svc"},
	}
	lookup := dnsLookup(map[string][]string{"c-prefill-r1.ns.svc": {"10.0.0.1"}, "c-decode-r1.ns.svc": {"10.0.0.2"}, "c-prefill-r2.ns.svc": {"10.0.0.3"}})
	got, err := ResolvePools(context.Background(), fc, lookup)
	if err != nil {
		t.Fatal(err)
	}
	want := Pools{Revisions: []Revision{
		{Name: "r1", Prefill: []Prefill{{URL: "http://10.0.0.1:8000", Bootstrap: "http://10.0.0.1:8998"}}, Decode: []string{"http://10.0.0.2:8000"}},
		{Name: "r2", Prefill: []Prefill{{URL: "http://10.0.0.3:8000", Bootstrap: "http://10.0.0.3:8998"}}},
	}}
	if d := cmp.Diff(want, got, cmpopts.IgnoreUnexported(Revision{}, Pools{})); d != "" {
		t.Errorf("pools (-want +got):\n%s", d)
	}
	failing := func(ctx context.Context, host string) ([]string, error) {
		return nil, &net.DNSError{Err: "server misbehaving", Name: host, IsTemporary: true}
	}
	if _, err := ResolvePools(context.Background(), fc, failing); err == nil {
		t.Error("a DNS failure other than not found emptied the revisions")
	}
}

// With pairing, each domain's Services name its engines' domain, for one set and per revision;
// a domain whose Service has no ready pod is empty.
func TestResolvePoolsByDomain(t *testing.T) {
	fc := mooncakeFile
	fc.Pairing = &routerconfig.Pairing{Mode: routerconfig.PairingPreferred}
	fc.Domains = []routerconfig.DomainHosts{
		{Domain: "rack-a", PrefillHost: "p-a.ns.svc", DecodeHost: "d-a.ns.svc"},
		{Domain: "rack-b", PrefillHost: "p-b.ns.svc", DecodeHost: "d-b.ns.svc"},
	}
	lookup := dnsLookup(map[string][]string{
		"c-prefill.ns.svc": {"10.0.0.1", "10.0.0.2"}, "c-decode.ns.svc": {"10.0.0.3", "10.0.0.4"},
		"p-a.ns.svc": {"10.0.0.1"}, "d-a.ns.svc": {"10.0.0.3"}, "p-b.ns.svc": {"10.0.0.2"},
	})
	got, err := ResolvePools(context.Background(), fc, lookup)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"http://10.0.0.1:8000": "rack-a", "http://10.0.0.3:8000": "rack-a", "http://10.0.0.2:8000": "rack-b"}
	if d := cmp.Diff(want, got.Domains); d != "" {
		t.Errorf("domains (-want +got):\n%s", d)
	}
	fc.Pairing = nil
	if got, err := ResolvePools(context.Background(), fc, lookup); err != nil || got.Domains != nil {
		t.Errorf("without pairing: domains %v, %v; want none resolved", got.Domains, err)
	}
}
