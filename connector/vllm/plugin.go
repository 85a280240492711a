// Package vllm carries pdgate, the completion gate as a vLLM KV-connector plugin (Python, in
// pdgate/), into the operator: render writes its files into a ConfigMap that every engine
// container mounts on its PYTHONPATH.
package vllm

import (
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"io/fs"
	"maps"
	"path"
	"slices"
	"sync"
)

//go:embed pdgate/*.py
var plugin embed.FS

// Package is the Python package name; MountDir/Package is where the files appear in an engine
// container, and MountDir goes on PYTHONPATH.
const (
	Package  = "pdgate"
	MountDir = "/opt/pdgate"
)

// The connector classes vLLM loads through kv_connector and kv_connector_module_path. They are
// named apart from vLLM's own: before vLLM's 2026-04 factory change a built-in name won over
// the module path, which would have loaded the stock, ungated class.
const (
	MooncakeClass  = "GatedMooncakeConnector"
	MooncakeModule = Package + ".mooncake"
	NixlClass      = "GatedNixlConnector"
	NixlModule     = Package + ".nixl"
)

// Files returns the plugin's files by name (no directories), as a ConfigMap's data. The map is
// the caller's to keep.
func Files() map[string]string { return maps.Clone(files()) }

// Hash is a short content hash of the files: a new plugin changes it and rolls the engines.
func Hash() string { return hash() }

// The files are embedded at build time and never change: read and hash them once, not on every
// render.
var (
	files = sync.OnceValue(func() map[string]string {
		entries, err := fs.ReadDir(plugin, Package)
		if err != nil {
			panic(err) // embedded at build time: cannot fail
		}
		out := make(map[string]string, len(entries))
		for _, e := range entries {
			b, err := plugin.ReadFile(path.Join(Package, e.Name()))
			if err != nil {
				panic(err)
			}
			out[e.Name()] = string(b)
		}
		return out
	})
	hash = sync.OnceValue(func() string {
		f := files()
		h := sha256.New()
		for _, n := range slices.Sorted(maps.Keys(f)) {
			h.Write([]byte(n))
			h.Write([]byte{0})
			h.Write([]byte(f[n]))
			h.Write([]byte{0})
		}
		return hex.EncodeToString(h.Sum(nil))[:16]
	})
)

// Report is what the plugin posts to its sidecar every few seconds (POST /v1/gate on the local
// API). Counts are totals since the engine started.
type Report struct {
	Connector     string `json:"connector"`
	VLLMVersion   string `json:"vllm_version"`
	PluginVersion string `json:"plugin_version"`
	Role          string `json:"role"`
	PID           int    `json:"pid"`
	// DPRank is the data-parallel rank of the engine whose scheduler reports: vLLM runs one
	// EngineCore, so one gate, per rank (0 from a plugin that does not say).
	DPRank int    `json:"dp_rank"`
	Counts Counts `json:"counts"`
	// HeldSends is how many requests' KV blocks a producer holds for pulls not made yet (a
	// consumer's are 0); nil from a plugin that does not count them.
	HeldSends *int64 `json:"held_sends,omitempty"`
}

// Counts is what the gate did: finished_recving reports suppressed (gated) and passed, failed
// pulls with local blocks seen, records dropped without a report, heartbeats the engine dropped.
type Counts struct {
	Gated        int64 `json:"gated"`
	Passed       int64 `json:"passed"`
	Failed       int64 `json:"failed"`
	Expired      int64 `json:"expired"`
	SendFailures int64 `json:"send_failures"`
}

// StatePath is GET /gate on the sidecar's public port: the gate as the sidecar last heard of
// it, for the operator.
const StatePath = "/gate"

// State is the answer to GET /gate.
type State struct {
	// Loaded is true while the plugin of every data-parallel rank on the pod heartbeats.
	Loaded bool `json:"loaded"`
	// Report is the ranks' last heartbeats summed (counts and held sends), with the lowest
	// rank's connector, versions and pid; nil before the first.
	Report *Report `json:"report,omitempty"`
	// Ranks is how many data-parallel ranks' gates Report sums.
	Ranks int `json:"ranks,omitempty"`
	// AgeSeconds is how old the oldest rank's heartbeat is.
	AgeSeconds float64 `json:"ageSeconds,omitempty"`
	// Engine is what the sidecar last scraped from its engine's /metrics; nil before the first
	// scrape or when the sidecar does not scrape.
	Engine *EngineStats `json:"engine,omitempty"`
}

// EngineStats are the engine's KV evidence, from its own /metrics: counters since the engine
// started, summed over its data-parallel ranks.
type EngineStats struct {
	// ExternalKVTokens, LocalComputeTokens and LocalCacheHitTokens are
	// vllm:prompt_tokens_by_source_total by source.
	ExternalKVTokens    float64 `json:"externalKVTokens"`
	LocalComputeTokens  float64 `json:"localComputeTokens"`
	LocalCacheHitTokens float64 `json:"localCacheHitTokens"`
	// FailedTransfers, FailedReceives and ExpiredRequests are the connector's counters
	// (vllm:mooncake_* or vllm:nixl_*), 0 when it exports none.
	FailedTransfers float64 `json:"failedTransfers,omitempty"`
	FailedReceives  float64 `json:"failedReceives,omitempty"`
	ExpiredRequests float64 `json:"expiredRequests,omitempty"`
	// HasPromptSources is whether the engine exports vllm:prompt_tokens_by_source_total at all.
	HasPromptSources bool `json:"hasPromptSources"`
	// TransferBytes and TransferSeconds are the connector's per-transfer histograms' sums
	// (vllm:<connector>_bytes_transferred, _xfer_time_seconds): their ratio is the rate the
	// engine moved KV at.
	TransferBytes   float64 `json:"transferBytes,omitempty"`
	TransferSeconds float64 `json:"transferSeconds,omitempty"`
	// AgeSeconds is how old the scrape is; Error says why the last scrape failed (the counts
	// are then from the one before, if any).
	AgeSeconds float64 `json:"ageSeconds"`
	Error      string  `json:"error,omitempty"`
}
