// Package bootstrap is Mooncake's bootstrap registry: producer workers POST /register their
// data-plane address, consumers and routers GET /query the topology. It serves the same JSON as
// vLLM's mooncake_utils bootstrap server, so either side can be a real vLLM.
package bootstrap

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"time"

	"golang.org/x/sync/singleflight"
	"k8s.io/utils/clock"

	"pdcluster.dev/pdcluster-operator/internal/bounded"
)

// Registration is the body of POST /register.
type Registration struct {
	EngineID string `json:"engine_id"`
	DPRank   int    `json:"dp_rank"`
	TPRank   int    `json:"tp_rank"`
	PPRank   int    `json:"pp_rank"`
	Addr     string `json:"addr"`
}

// Engine is one data-parallel rank of GET /query: its engine id and worker addresses by
// tp rank, then pp rank (both as decimal strings, as in vLLM's JSON).
type Engine struct {
	EngineID   string                       `json:"engine_id"`
	WorkerAddr map[string]map[string]string `json:"worker_addr"`
}

// Topology is the body of GET /query, keyed by dp rank.
type Topology map[string]Engine

// Find returns the dp rank serving engineID.
func (t Topology) Find(engineID string) (string, Engine, bool) {
	for dp, e := range t {
		if e.EngineID == engineID {
			return dp, e, true
		}
	}
	return "", Engine{}, false
}

// Registry is the in-memory registry. It is safe for concurrent use.
type Registry struct {
	// Limits of what POST /register takes, set before the registry serves.
	Limits RegistryLimits

	mu   sync.Mutex
	topo Topology
}

// RegistryLimits narrow what a registration over HTTP may claim, beyond vLLM's rules: its
// bootstrap server takes any rank and address from anyone who reaches it, so a stranger could
// add a rank of its own to a real engine, and decode would pull from it.
type RegistryLimits struct {
	// DP, TP and PP, when set, are the engine's data-, tensor- and pipeline-parallel sizes
	// (DP: the ranks this server's pod runs): a rank past them is refused.
	DP, TP, PP int
	// SameHost refuses an address whose host is not the one the registration came from: a
	// worker registers its own transfer engine.
	SameHost bool
}

// NewRegistry returns an empty registry.
func NewRegistry() *Registry { return &Registry{topo: Topology{}} }

// admit applies the limits to reg, registered over HTTP from remote (host:port).
func (l RegistryLimits) admit(reg Registration, remote string) error {
	if l.DP > 0 && reg.DPRank >= l.DP {
		return fmt.Errorf("dp_rank=%d: this engine has %d data-parallel ranks", reg.DPRank, l.DP)
	}
	if l.TP > 0 && reg.TPRank >= l.TP {
		return fmt.Errorf("tp_rank=%d: this engine has %d tensor-parallel ranks", reg.TPRank, l.TP)
	}
	if l.PP > 0 && reg.PPRank >= l.PP {
		return fmt.Errorf("pp_rank=%d: this engine has %d pipeline-parallel ranks", reg.PPRank, l.PP)
	}
	if !l.SameHost {
		return nil
	}
	from, _, err := net.SplitHostPort(remote)
	if err != nil {
		return fmt.Errorf("registration from %q: %w", remote, err)
	}
	u, err := url.Parse(reg.Addr)
	if err != nil || u.Hostname() == "" {
		return fmt.Errorf("addr %q: want tcp://host:port", reg.Addr)
	}
	if a, b := net.ParseIP(u.Hostname()), net.ParseIP(from); a == nil || b == nil || !a.Equal(b) {
		return fmt.Errorf("addr %s is not on %s, where the registration came from: a worker registers its own transfer engine", reg.Addr, from)
	}
	return nil
}

// Register adds a worker with vLLM's rules: re-registering the same address is a no-op; a new
// address for a registered (dp, tp, pp), or another engine id for a dp rank, is refused.
func (r *Registry) Register(reg Registration) error {
	if reg.EngineID == "" || reg.Addr == "" {
		return fmt.Errorf("engine_id and addr are required")
	}
	if reg.DPRank < 0 || reg.TPRank < 0 || reg.PPRank < 0 {
		return fmt.Errorf("ranks must not be negative")
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	dp, tp, pp := strconv.Itoa(reg.DPRank), strconv.Itoa(reg.TPRank), strconv.Itoa(reg.PPRank)
	e, ok := r.topo[dp]
	if !ok {
		e = Engine{EngineID: reg.EngineID, WorkerAddr: map[string]map[string]string{}}
	}
	if e.EngineID != reg.EngineID {
		return fmt.Errorf("Engine ID mismatch for dp_rank=%s: %s is registered, %s asked", dp, e.EngineID, reg.EngineID)
	}
	if e.WorkerAddr[tp] == nil {
		e.WorkerAddr[tp] = map[string]string{}
	}
	if old, ok := e.WorkerAddr[tp][pp]; ok && old != reg.Addr {
		return fmt.Errorf("dp_rank=%s tp_rank=%s pp_rank=%s is already registered at %s, but still want to register at %s", dp, tp, pp, old, reg.Addr)
	}
	e.WorkerAddr[tp][pp] = reg.Addr
	r.topo[dp] = e
	return nil
}

// Snapshot returns a deep copy of the topology.
func (r *Registry) Snapshot() Topology {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make(Topology, len(r.topo))
	for dp, e := range r.topo {
		c := Engine{EngineID: e.EngineID, WorkerAddr: make(map[string]map[string]string, len(e.WorkerAddr))}
		for tp, pps := range e.WorkerAddr {
			c.WorkerAddr[tp] = maps.Clone(pps)
		}
		out[dp] = c
	}
	return out
}

// Handler serves POST /register and GET /query.
func (r *Registry) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /register", func(w http.ResponseWriter, req *http.Request) {
		var reg Registration
		if err := json.NewDecoder(io.LimitReader(req.Body, 1<<20)).Decode(&reg); err != nil {
			http.Error(w, "bad registration: "+err.Error(), http.StatusBadRequest)
			return
		}
		if err := r.Limits.admit(reg, req.RemoteAddr); err != nil {
			http.Error(w, err.Error(), http.StatusForbidden)
			return
		}
		if err := r.Register(reg); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		writeJSON(w, map[string]string{"status": "ok"})
	})
	mux.HandleFunc("GET /query", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, r.Snapshot())
	})
	return mux
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(v)
}

// Client queries bootstrap servers. Concurrent queries of one address share a request, and
// answers are cached until Invalidate (after a connection failure or an unknown engine id)
// or, when MaxAge is set, until they are that old.
type Client struct {
	HTTP    *http.Client
	Timeout time.Duration // per query; llm-d uses 5 s
	// MaxAge, if set, is how long an answer is used (a router cannot tell when a producer
	// restarted under a new engine id); 0 keeps answers until Invalidate.
	MaxAge time.Duration
	// RefreshAfter, if set, is the age after which an answer is still used but asked again in
	// the background, so a busy client sees a producer's new engine id within about that long
	// while asking at most once per RefreshAfter.
	RefreshAfter time.Duration
	// Admit, if set, narrows each answer fetched from addr before it is cached and used: the
	// entries the caller trusts (a registry takes any registration from anyone who reaches it).
	Admit func(addr string, t Topology) Topology
	// Clock dates answers; tests inject a fake one.
	Clock clock.PassiveClock
	group singleflight.Group
	mu    sync.Mutex
	cache map[string]cached
}

type cached struct {
	topo  Topology
	at    time.Time // when it was answered
	tried time.Time // when it was last asked again in the background
}

// NewClient returns a Client with a 5 s query timeout.
func NewClient() *Client {
	// A registry is asked at the address its engine registered, never elsewhere.
	hc := &http.Client{CheckRedirect: bounded.NoRedirect}
	return &Client{HTTP: hc, Timeout: 5 * time.Second, Clock: clock.RealClock{}, cache: map[string]cached{}}
}

// Query returns the topology served at addr (http://host:port), from the cache if present.
func (c *Client) Query(ctx context.Context, addr string) (Topology, error) {
	c.mu.Lock()
	e, ok := c.cache[addr]
	c.mu.Unlock()
	if ok && (c.MaxAge <= 0 || c.Clock.Since(e.at) < c.MaxAge) {
		if c.RefreshAfter > 0 && c.Clock.Since(e.at) >= c.RefreshAfter && c.startRefresh(addr) {
			go func() {
				_, _, _ = c.group.Do(addr, func() (any, error) { return c.fetchAndCache(context.WithoutCancel(ctx), addr) })
			}()
		}
		return e.topo, nil
	}
	v, err, _ := c.group.Do(addr, func() (any, error) { return c.fetchAndCache(ctx, addr) })
	if err != nil {
		return nil, err
	}
	return v.(Topology), nil
}

// startRefresh reports whether addr's answer should be asked again now: at most once per
// RefreshAfter, so a registry that does not answer is not asked on every query.
func (c *Client) startRefresh(addr string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.cache[addr]
	if !ok || c.Clock.Since(e.tried) < c.RefreshAfter {
		return false
	}
	e.tried = c.Clock.Now()
	c.cache[addr] = e
	return true
}

func (c *Client) fetchAndCache(ctx context.Context, addr string) (Topology, error) {
	t, err := c.fetch(ctx, addr)
	if err != nil {
		return nil, err
	}
	if c.Admit != nil {
		t = c.Admit(addr, t)
	}
	if len(t) > 0 { // an empty registry is not worth remembering: workers are still coming
		c.mu.Lock()
		c.cache[addr] = cached{topo: t, at: c.Clock.Now()}
		c.mu.Unlock()
	}
	return t, nil
}

// Invalidate forgets addr's cached topology.
func (c *Client) Invalidate(addr string) {
	c.mu.Lock()
	delete(c.cache, addr)
	c.mu.Unlock()
}

func (c *Client) fetch(ctx context.Context, addr string) (Topology, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, addr+"/query", nil)
	if err != nil {
		return nil, fmt.Errorf("query bootstrap %s: %w", addr, err)
	}
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return nil, fmt.Errorf("query bootstrap %s: %w", addr, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("query bootstrap %s: %s: %s", addr, resp.Status, bounded.Snippet(resp.Body))
	}
	b, err := bounded.ReadAll(resp.Body, MaxTopologyBytes)
	if err != nil {
		return nil, fmt.Errorf("query bootstrap %s: read: %w", addr, err)
	}
	var t Topology
	if err := json.Unmarshal(b, &t); err != nil {
		return nil, fmt.Errorf("query bootstrap %s: decode: %w", addr, err)
	}
	return t, nil
}

// MaxTopologyBytes bounds a registry's answer: a topology of every DP, TP and PP rank of an
// engine is a few kilobytes.
const MaxTopologyBytes = 1 << 20

// Register posts reg to the bootstrap server at addr, retrying with backoff as vLLM workers do.
func Register(ctx context.Context, hc *http.Client, addr string, reg Registration, attempts int) error {
	body, err := json.Marshal(reg)
	if err != nil {
		return err
	}
	backoff := 100 * time.Millisecond
	var last error
	for i := 0; i < max(attempts, 1); i++ {
		if i > 0 {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(backoff):
			}
			backoff = min(backoff*2, 10*time.Second)
		}
		last = registerOnce(ctx, hc, addr, body)
		if last == nil {
			return nil
		}
	}
	return fmt.Errorf("register with bootstrap %s: %w", addr, last)
}

func registerOnce(ctx context.Context, hc *http.Client, addr string, body []byte) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, addr+"/register", bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := hc.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%d: %s", resp.StatusCode, bounded.Snippet(resp.Body))
	}
	return nil
}
