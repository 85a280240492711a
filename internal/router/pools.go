package router

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"slices"
	"strconv"
)

// FileConfig is router.json, which the operator renders into the router's ConfigMap. The pools
// are headless Services: their DNS names resolve to the ready pods, and each prefill pod hosts
// its own bootstrap registry, so the router resolves them itself instead of going through a
// Service VIP.
type FileConfig struct {
	// Flow is "concurrent" (Mooncake: both legs at once, shared transfer_id) or "sequential"
	// (NIXL: prefill first, its kv_transfer_params passed to decode).
	Flow          string `json:"flow"`
	Connector     string `json:"connector"`
	PrefillHost   string `json:"prefillHost"`
	DecodeHost    string `json:"decodeHost"`
	EnginePort    int32  `json:"enginePort"`
	BootstrapPort int32  `json:"bootstrapPort,omitempty"`
	Model         string `json:"model"`
}

// LoadFileConfig reads and checks router.json.
func LoadFileConfig(path string) (FileConfig, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return FileConfig{}, fmt.Errorf("read router config: %w", err)
	}
	var fc FileConfig
	if err := json.Unmarshal(b, &fc); err != nil {
		return FileConfig{}, fmt.Errorf("decode router config %s: %w", path, err)
	}
	if _, err := fc.Mode(); err != nil {
		return FileConfig{}, fmt.Errorf("router config %s: %w", path, err)
	}
	if fc.PrefillHost == "" || fc.DecodeHost == "" || fc.EnginePort <= 0 {
		return FileConfig{}, fmt.Errorf("router config %s: prefillHost, decodeHost and enginePort are required", path)
	}
	return fc, nil
}

// Mode is the router mode of the config's flow.
func (fc FileConfig) Mode() (Mode, error) {
	switch fc.Flow {
	case "concurrent":
		if fc.BootstrapPort <= 0 {
			return "", fmt.Errorf("the concurrent flow needs bootstrapPort")
		}
		return ModeMooncake, nil
	case "sequential":
		return ModeNIXL, nil
	}
	return "", fmt.Errorf("flow must be concurrent or sequential, got %q", fc.Flow)
}

// Pools are the engines requests are spread over.
type Pools struct {
	Prefill []Prefill
	Decode  []string
}

// Lookup resolves a host name to addresses (net.DefaultResolver.LookupHost in production).
type Lookup func(ctx context.Context, host string) ([]string, error)

// ResolvePools turns the config's headless Service names into one endpoint per ready pod,
// sorted so that round-robin order does not change between two resolutions.
func ResolvePools(ctx context.Context, fc FileConfig, lookup Lookup) (Pools, error) {
	urls := func(host string, port int32) ([]string, []string, error) {
		ips, err := lookup(ctx, host)
		if err != nil {
			return nil, nil, fmt.Errorf("resolve %s: %w", host, err)
		}
		slices.Sort(ips)
		var out []string
		for _, ip := range ips {
			out = append(out, "http://"+net.JoinHostPort(ip, strconv.Itoa(int(port))))
		}
		return out, ips, nil
	}
	var p Pools
	prefill, ips, err := urls(fc.PrefillHost, fc.EnginePort)
	if err != nil {
		return Pools{}, err
	}
	for i, u := range prefill {
		pf := Prefill{URL: u}
		if fc.BootstrapPort > 0 {
			pf.Bootstrap = "http://" + net.JoinHostPort(ips[i], strconv.Itoa(int(fc.BootstrapPort)))
		}
		p.Prefill = append(p.Prefill, pf)
	}
	if p.Decode, _, err = urls(fc.DecodeHost, fc.EnginePort); err != nil {
		return Pools{}, err
	}
	return p, nil
}
