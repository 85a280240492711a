// Package routerconfig is the format of router.json: the operator renders it into the router's
// ConfigMap and cmd/router reads it. It is a leaf package so that the operator's binaries do not
// link the router itself.
package routerconfig

import (
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"time"
)

// FileName is router.json's key in the router's ConfigMap and its name in the mount.
const FileName = "router.json"

// Flow is how a request crosses the two pools; the KV connector decides it.
type Flow string

const (
	// FlowMooncake sends both legs at once with a shared transfer_id; the decode engine's
	// connector finds the producer through the prefill pod's bootstrap server.
	FlowMooncake Flow = "mooncake"
	// FlowNIXL sends the prefill leg first and passes its kv_transfer_params to decode.
	FlowNIXL Flow = "nixl"
)

// Validate reports whether f is a known flow.
func (f Flow) Validate() error {
	switch f {
	case FlowMooncake, FlowNIXL:
		return nil
	}
	return fmt.Errorf("flow must be %s or %s, got %q", FlowMooncake, FlowNIXL, f)
}

// Balance is how the router picks an engine in each pool.
type Balance string

const (
	// BalanceLeastInFlight picks the engine with the fewest requests in flight from this
	// router, taking turns among equals: a slow or busy engine gets fewer requests.
	BalanceLeastInFlight Balance = "least-in-flight"
	// BalanceRoundRobin takes turns, whatever the engines' load.
	BalanceRoundRobin Balance = "round-robin"
)

// Validate reports whether b is a known balance; empty means the default, least-in-flight.
func (b Balance) Validate() error {
	switch b {
	case "", BalanceLeastInFlight, BalanceRoundRobin:
		return nil
	}
	return fmt.Errorf("balance must be %s or %s, got %q", BalanceLeastInFlight, BalanceRoundRobin, b)
}

// File is router.json. The pools are headless Services: their DNS names resolve to the ready
// pods, and each prefill pod runs its own bootstrap server, so the router resolves them itself
// instead of going through a Service VIP.
type File struct {
	Flow          Flow   `json:"flow"`
	PrefillHost   string `json:"prefillHost"`
	DecodeHost    string `json:"decodeHost"`
	EnginePort    int32  `json:"enginePort"`
	BootstrapPort int32  `json:"bootstrapPort,omitempty"`
	// PrefillDataParallel is how many data-parallel ranks each prefill pod runs (0: 1): the
	// router trusts only those ranks of a pod's bootstrap registry, which takes any
	// registration from anyone who reaches it.
	PrefillDataParallel int32 `json:"prefillDataParallel,omitempty"`
	// Balance picks engines; empty: least-in-flight.
	Balance Balance `json:"balance,omitempty"`
	// FailurePolicy is what the router does when a leg fails; nil: DefaultFailurePolicy.
	FailurePolicy *FailurePolicy `json:"failurePolicy,omitempty"`
	// Canary makes the router send a canary request through the P/D path at an interval
	// (spec.kvTransfer.verification.mode Canary); nil: none.
	Canary *Canary `json:"canary,omitempty"`
	// Revisions are the pools by KV revision, each a pair of headless Services: a request's
	// prefill and decode come from one revision. Empty: PrefillHost and DecodeHost, as one.
	Revisions []RevisionHosts `json:"revisions,omitempty"`
	// Pairing keeps a request's prefill and decode in one topology domain
	// (spec.scheduling.pairing); nil: any pair.
	Pairing *Pairing `json:"pairing,omitempty"`
	// Domains are PrefillHost's and DecodeHost's engines by domain (with Pairing).
	Domains []DomainHosts `json:"domains,omitempty"`
	// Routing weighs what the engines hold of a request's prompt (spec.router.routing); nil:
	// Balance alone picks.
	Routing *Routing `json:"routing,omitempty"`
}

// RoutingStrategy is how the router weighs what engines hold.
type RoutingStrategy string

const (
	// RoutingLeastInFlight: Balance alone picks, whatever the engines hold.
	RoutingLeastInFlight RoutingStrategy = "LeastInFlight"
	// RoutingPrefixAware: the engine that was sent the longest prefix of the prompt, within
	// a load bound.
	RoutingPrefixAware RoutingStrategy = "PrefixAware"
	// RoutingKVEvents: the engine whose own KV cache events say it holds the longest start of
	// the prompt's token ids, within the same load bound; PrefixAware's estimate where the
	// prompt is text or an engine's events cannot be trusted.
	RoutingKVEvents RoutingStrategy = "KVEvents"
)

// Routing is router.json's routing.
type Routing struct {
	Strategy RoutingStrategy `json:"strategy"`
	// ChunkBytes, MaxChunks and ChunksPerEngine size PrefixAware's index (0: the router's
	// defaults): bytes of prompt per chunk, chunks per prompt, chunks remembered per engine.
	ChunkBytes      int32 `json:"chunkBytes,omitempty"`
	MaxChunks       int32 `json:"maxChunks,omitempty"`
	ChunksPerEngine int32 `json:"chunksPerEngine,omitempty"`
	// LoadSlack is how many more requests in flight than the least loaded engine an engine
	// may have and still be picked for what it holds.
	LoadSlack int32 `json:"loadSlack"`
	// KVEvents is where the engines publish their KV cache events (KVEvents only).
	KVEvents *KVEventsEndpoints `json:"kvEvents,omitempty"`
}

// KVEventsEndpoints are the ports of each engine's --kv-events-config: data-parallel rank r
// publishes on Port+r and replays on ReplayPort+r (vLLM offsets both by the rank).
type KVEventsEndpoints struct {
	Port       int32  `json:"port"`
	ReplayPort int32  `json:"replayPort"`
	Topic      string `json:"topic"`
	// BlocksPerEngine bounds each engine's index (0: the router's default).
	BlocksPerEngine int32 `json:"blocksPerEngine,omitempty"`
}

// DefaultBlocksPerEngine bounds each engine's entries in KVEvents' index when
// blocksPerEngine is unset: 262144 blocks of 16 tokens is 4M tokens, more than one GPU's KV
// cache holds for the models served on one.
const DefaultBlocksPerEngine = 262144

// KVIndexBlockBytes is what one block of KVEvents' index costs the router, at most: 54 to 90
// bytes of live heap measured (kvevents' TestBlockBytes holds it under this), 149 of a router's
// resident memory under churn (issue 56).
const KVIndexBlockBytes = 160

// KVIndexBlocks is how many blocks each pool's KVEvents index may hold over all its engines
// with a router memory limit of memoryLimit bytes: 3/16 of it each (3/8 for both pools, beside
// the body budget's quarter, and the rest the Go runtime's and the connections'); 0, no bound
// but blocksPerEngine's, without a limit. The operator refuses a blocksPerEngine one engine
// cannot fit in.
func KVIndexBlocks(memoryLimit int64) int64 {
	if memoryLimit <= 0 {
		return 0
	}
	return memoryLimit / 16 * 3 / KVIndexBlockBytes
}

// Validate reports a routing the router cannot run.
func (r Routing) Validate(b Balance) error {
	switch r.Strategy {
	case RoutingLeastInFlight:
		return nil
	case RoutingPrefixAware:
		if r.KVEvents != nil {
			return fmt.Errorf("routing.kvEvents is for strategy %s only, not %s", RoutingKVEvents, r.Strategy)
		}
	case RoutingKVEvents:
		e := r.KVEvents
		if e == nil || e.Port <= 0 || e.ReplayPort <= 0 || e.Port == e.ReplayPort || e.BlocksPerEngine < 0 {
			return fmt.Errorf("routing.strategy %s needs routing.kvEvents with two different ports and blocksPerEngine not negative, got %+v", r.Strategy, e)
		}
	default:
		return fmt.Errorf("routing.strategy must be %s, %s or %s, got %q", RoutingLeastInFlight, RoutingPrefixAware, RoutingKVEvents, r.Strategy)
	}
	if b == BalanceRoundRobin {
		return fmt.Errorf("routing.strategy %s bounds each engine's load by its requests in flight: it needs balance %s, not %s", r.Strategy, BalanceLeastInFlight, b)
	}
	if r.ChunkBytes < 0 || r.MaxChunks < 0 || r.ChunksPerEngine < 0 || r.LoadSlack < 0 {
		return fmt.Errorf("routing: chunkBytes, maxChunks, chunksPerEngine and loadSlack must not be negative, got %+v", r)
	}
	return nil
}

// RevisionHosts are one KV revision's headless Services.
type RevisionHosts struct {
	Revision    string `json:"revision"`
	PrefillHost string `json:"prefillHost"`
	DecodeHost  string `json:"decodeHost"`
	// PrefillDataParallel is the revision's data-parallel ranks per prefill pod (0: 1), as
	// File's.
	PrefillDataParallel int32 `json:"prefillDataParallel,omitempty"`
	// Domains are the revision's engines by domain (with Pairing).
	Domains []DomainHosts `json:"domains,omitempty"`
}

// DomainHosts are the headless Services of one topology domain's engines of both pools.
type DomainHosts struct {
	Domain      string `json:"domain"`
	PrefillHost string `json:"prefillHost"`
	DecodeHost  string `json:"decodeHost"`
}

// AllDomains are the domains' Services of every revision (or of the one set).
func (f File) AllDomains() []DomainHosts {
	all := slices.Clone(f.Domains)
	for _, r := range f.Revisions {
		all = append(all, r.Domains...)
	}
	return all
}

// PairingMode is how strictly a pair is kept in one domain.
type PairingMode string

const (
	// PairingPreferred pairs within the prefill engine's domain when it has a decode engine
	// the request may use, and across domains otherwise.
	PairingPreferred PairingMode = "Preferred"
	// PairingRequired pairs only within a domain.
	PairingRequired PairingMode = "Required"
)

// Pairing is router.json's pairing.
type Pairing struct {
	Mode PairingMode `json:"mode"`
}

// Canary is router.json's canary: a never-cached prompt of PromptWords words, max_tokens 1,
// for Model, every IntervalSeconds.
type Canary struct {
	IntervalSeconds int32  `json:"intervalSeconds"`
	Model           string `json:"model"`
	PromptWords     int32  `json:"promptWords"`
}

// CanaryPath is GET /canary on the router's metrics port: its newest canary, for the operator.
const CanaryPath = "/canary"

// PairsPath is GET /pairs on the router's metrics port: its pair counts by locality since it started
// (with pairing), for the operator.
const PairsPath = "/pairs"

// PairCounts is the answer to GET /pairs.
type PairCounts struct {
	SameDomain  int64 `json:"sameDomain"`
	CrossDomain int64 `json:"crossDomain"`
}

// RoutingPath is GET /routing on the router's metrics port: what its routing strategy found the picked
// engines holding of the prompts since it started (PrefixAware, KVEvents), for the operator.
const RoutingPath = "/routing"

// RoutingCounts is the answer to GET /routing, by pool.
type RoutingCounts struct {
	Prefill PoolRoutingCounts `json:"prefill"`
	Decode  PoolRoutingCounts `json:"decode"`
}

// PoolRoutingCounts are one pool's prompt units routed and those the picked engine held: full
// KV blocks by the engines' own events (KVEvents, token-id prompts), and prompt chunks the
// router had sent the engine (PrefixAware, and KVEvents' estimate).
type PoolRoutingCounts struct {
	PromptBlocks int64 `json:"promptBlocks"`
	HeldBlocks   int64 `json:"heldBlocks"`
	PromptChunks int64 `json:"promptChunks"`
	HeldChunks   int64 `json:"heldChunks"`
	// IndexBlocks are the KV blocks the pool's engines' events say they hold, in the router's
	// index; EventsLagMilliseconds the longest an engine's latest event batch took to reach
	// the router (KVEvents).
	IndexBlocks           int64 `json:"indexBlocks,omitempty"`
	EventsLagMilliseconds int64 `json:"eventsLagMilliseconds,omitempty"`
}

// MaxEventsLag bounds a KV events lag: the lag is taken from the timestamp the engine writes in
// its batch, so one dated further back (1970, say) or in the future says nothing of how late
// it came; the router keeps the last plausible lag and the operator refuses a larger one.
const MaxEventsLag = time.Hour

// CanaryOutcome is a canary's result: CanaryExternal, CanaryRecomputed or CanaryFailed (the
// words of the PDCluster's status.kvTransfer.lastCanary.result).
type CanaryOutcome string

const (
	CanaryExternal   CanaryOutcome = "External"
	CanaryRecomputed CanaryOutcome = "Recomputed"
	CanaryFailed     CanaryOutcome = "Failed"
)

// CanaryResult is the answer to GET /canary: the router's newest canary.
type CanaryResult struct {
	Time   time.Time     `json:"time"`
	Result CanaryOutcome `json:"result"`
	// PromptTokens is the canary's prompt length (decode's usage.prompt_tokens);
	// ExternalTokens how many prompt tokens the decode engine that answered counted as
	// received from prefill while it did (its vllm:prompt_tokens_by_source_total).
	PromptTokens   int64  `json:"promptTokens,omitempty"`
	ExternalTokens int64  `json:"externalTokens,omitempty"`
	Decode         string `json:"decode,omitempty"`
	Message        string `json:"message,omitempty"`
}

// OnPrefillFailure is what the router does once a request's prefill cannot be served.
type OnPrefillFailure string

const (
	// PrefillFailureRetry retries on another prefill endpoint within the budgets, then fails.
	PrefillFailureRetry OnPrefillFailure = "Retry"
	// PrefillFailureFail fails the request at the first prefill failure.
	PrefillFailureFail OnPrefillFailure = "Fail"
	// PrefillFailureDecodeOnly retries as Retry does, then sends the request to decode alone,
	// which computes the prompt itself.
	PrefillFailureDecodeOnly OnPrefillFailure = "DecodeOnly"
)

// FailurePolicy is router.json's failurePolicy (spec.router.failurePolicy): every field is
// written, so a zero means zero.
type FailurePolicy struct {
	// Retries bounds the retries of one request, over both legs.
	Retries int32 `json:"retries"`
	// RetryBudgetPercent bounds the router's retries to this share of its requests over the
	// last 10 seconds (0: no retries), so a sick pool cannot multiply its load.
	RetryBudgetPercent int32 `json:"retryBudgetPercent"`
	// EjectSeconds is how long an endpoint that failed is left out (sooner if its health
	// check answers).
	EjectSeconds int32 `json:"ejectSeconds"`
	// ConsecutiveFailures is how many failures in a row eject an endpoint (one that refuses
	// connections: the first); 0 (a router.json written before the field): the default, 3.
	ConsecutiveFailures int32 `json:"consecutiveFailures,omitempty"`
	// FirstTokenTimeoutSeconds fails a request whose first byte has not come from decode in
	// this long, cancelling both legs; 0: no limit.
	FirstTokenTimeoutSeconds int32 `json:"firstTokenTimeoutSeconds,omitempty"`
	// StreamFirstTokenTimeoutSeconds is a streaming request's first-byte budget when
	// FirstTokenTimeoutSeconds is 0 (the operator derives it from the model length); 0: none.
	StreamFirstTokenTimeoutSeconds int32 `json:"streamFirstTokenTimeoutSeconds,omitempty"`
	// OnPrefillFailure is what happens once prefill cannot be served.
	OnPrefillFailure OnPrefillFailure `json:"onPrefillFailure"`
}

// DefaultConsecutiveFailures is failurePolicy.consecutiveFailures' default: one 503 or broken
// answer is not an outage.
const DefaultConsecutiveFailures = 3

// DefaultStreamFirstTokenTimeoutSeconds is a streaming request's first-byte budget when the
// engines' model length is not known (no --max-model-len among their arguments).
const DefaultStreamFirstTokenTimeoutSeconds = 300

// DefaultFailurePolicy is spec.router.failurePolicy's defaults (render's test holds the two
// equal): every request that can be saved is.
func DefaultFailurePolicy() FailurePolicy {
	return FailurePolicy{Retries: 2, RetryBudgetPercent: 20, EjectSeconds: 10, ConsecutiveFailures: DefaultConsecutiveFailures,
		StreamFirstTokenTimeoutSeconds: DefaultStreamFirstTokenTimeoutSeconds, OnPrefillFailure: PrefillFailureRetry}
}

// Validate reports a policy the router cannot apply.
func (p FailurePolicy) Validate() error {
	switch {
	case p.Retries < 0:
		return fmt.Errorf("failurePolicy.retries must not be negative, got %d", p.Retries)
	case p.RetryBudgetPercent < 0 || p.RetryBudgetPercent > 100:
		return fmt.Errorf("failurePolicy.retryBudgetPercent must be 0 to 100, got %d", p.RetryBudgetPercent)
	case p.EjectSeconds < 1:
		return fmt.Errorf("failurePolicy.ejectSeconds must be at least 1, got %d", p.EjectSeconds)
	case p.ConsecutiveFailures < 0:
		return fmt.Errorf("failurePolicy.consecutiveFailures must not be negative, got %d", p.ConsecutiveFailures)
	case p.StreamFirstTokenTimeoutSeconds < 0:
		return fmt.Errorf("failurePolicy.streamFirstTokenTimeoutSeconds must not be negative, got %d", p.StreamFirstTokenTimeoutSeconds)
	case p.FirstTokenTimeoutSeconds < 0:
		return fmt.Errorf("failurePolicy.firstTokenTimeoutSeconds must not be negative, got %d", p.FirstTokenTimeoutSeconds)
	}
	switch p.OnPrefillFailure {
	case PrefillFailureRetry, PrefillFailureFail, PrefillFailureDecodeOnly:
		return nil
	}
	return fmt.Errorf("failurePolicy.onPrefillFailure must be %s, %s or %s, got %q", PrefillFailureRetry, PrefillFailureFail, PrefillFailureDecodeOnly, p.OnPrefillFailure)
}

// Failure is f's failure policy, DefaultFailurePolicy when it has none.
func (f File) Failure() FailurePolicy {
	if f.FailurePolicy == nil {
		return DefaultFailurePolicy()
	}
	return *f.FailurePolicy
}

// Validate checks that f names a flow and the pools, and the bootstrap port the Mooncake flow needs.
func (f File) Validate() error {
	if err := f.Flow.Validate(); err != nil {
		return err
	}
	if err := f.Balance.Validate(); err != nil {
		return err
	}
	if r := f.Routing; r != nil {
		if err := r.Validate(f.Balance); err != nil {
			return err
		}
	}
	if err := f.Failure().Validate(); err != nil {
		return err
	}
	if f.PrefillDataParallel < 0 {
		return fmt.Errorf("prefillDataParallel must not be negative, got %d", f.PrefillDataParallel)
	}
	for _, r := range f.Revisions {
		if r.Revision == "" || r.PrefillHost == "" || r.DecodeHost == "" {
			return fmt.Errorf("each of revisions needs revision, prefillHost and decodeHost, got %+v", r)
		}
		if r.PrefillDataParallel < 0 {
			return fmt.Errorf("revision %s: prefillDataParallel must not be negative, got %d", r.Revision, r.PrefillDataParallel)
		}
	}
	if p := f.Pairing; p != nil && p.Mode != PairingPreferred && p.Mode != PairingRequired {
		return fmt.Errorf("pairing.mode must be %s or %s, got %q", PairingPreferred, PairingRequired, p.Mode)
	}
	for _, d := range f.AllDomains() {
		if d.Domain == "" || d.PrefillHost == "" || d.DecodeHost == "" {
			return fmt.Errorf("each of domains needs domain, prefillHost and decodeHost, got %+v", d)
		}
	}
	if c := f.Canary; c != nil && (c.IntervalSeconds < 1 || c.Model == "" || c.PromptWords < 1) {
		return fmt.Errorf("canary needs intervalSeconds, model and promptWords, got %+v", *c)
	}
	if !f.HasPools() {
		// Pools given elsewhere (the sandbox's loopback engines, by flag): all or none here.
		if f.PrefillHost != "" || f.DecodeHost != "" || f.EnginePort != 0 || f.BootstrapPort != 0 {
			return fmt.Errorf("prefillHost, decodeHost and enginePort go together: set all or none")
		}
		return nil
	}
	if f.Flow == FlowMooncake && f.BootstrapPort <= 0 {
		return fmt.Errorf("the %s flow needs bootstrapPort", FlowMooncake)
	}
	return nil
}

// HasPools reports whether f names the pools (the operator's router.json always does).
func (f File) HasPools() bool { return f.PrefillHost != "" && f.DecodeHost != "" && f.EnginePort > 0 }

// Load reads and validates router.json.
func Load(path string) (File, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return File{}, fmt.Errorf("read router config: %w", err)
	}
	var f File
	if err := json.Unmarshal(b, &f); err != nil {
		return File{}, fmt.Errorf("decode router config %s: %w", path, err)
	}
	if err := f.Validate(); err != nil {
		return File{}, fmt.Errorf("router config %s: %w", path, err)
	}
	return f, nil
}
