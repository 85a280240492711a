// Package routerconfig is the format of router.json: the operator renders it into the router's
// ConfigMap and cmd/router reads it. It is a leaf package so that the operator's binaries do not
// link the router itself.
package routerconfig

import (
	"encoding/json"
	"fmt"
	"os"
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
	// Balance picks engines; empty: least-in-flight.
	Balance Balance `json:"balance,omitempty"`
}

// Validate checks that f names a flow and the pools, and the bootstrap port the Mooncake flow needs.
func (f File) Validate() error {
	if err := f.Flow.Validate(); err != nil {
		return err
	}
	if err := f.Balance.Validate(); err != nil {
		return err
	}
	if f.Flow == FlowMooncake && f.BootstrapPort <= 0 {
		return fmt.Errorf("the %s flow needs bootstrapPort", FlowMooncake)
	}
	if f.PrefillHost == "" || f.DecodeHost == "" || f.EnginePort <= 0 {
		return fmt.Errorf("prefillHost, decodeHost and enginePort are required")
	}
	return nil
}

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
