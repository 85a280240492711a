package realengine

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
)

// Completion is what a test asks of /v1/completions: the prompt as token ids (the engines
// start without a tokenizer), greedy, exactly MaxTokens tokens.
type Completion struct {
	Prompt    []int
	MaxTokens int
	// KVTransferParams, if set, are sent as the router sends them to one leg.
	KVTransferParams map[string]any
	// RequestID, if set, is sent as X-Request-Id.
	RequestID string
}

// Answer is an OpenAI completion answer as far as the tests read it.
type Answer struct {
	Status int
	Body   string
	// TokenIDs are the generated token ids (return_token_ids).
	TokenIDs []int
}

// Complete sends c to base's /v1/completions.
func Complete(ctx context.Context, base string, c Completion) (Answer, error) {
	req := map[string]any{
		"model": "tiny", "prompt": c.Prompt, "max_tokens": c.MaxTokens, "temperature": 0,
		"ignore_eos": true, "return_token_ids": true,
	}
	if c.KVTransferParams != nil {
		req[vllm.KVTransferParams] = c.KVTransferParams
	}
	body, err := json.Marshal(req)
	if err != nil {
		return Answer{}, err
	}
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", bytes.NewReader(body))
	if err != nil {
		return Answer{}, err
	}
	hreq.Header.Set("Content-Type", "application/json")
	if c.RequestID != "" {
		hreq.Header.Set("X-Request-Id", c.RequestID)
	}
	resp, err := http.DefaultClient.Do(hreq)
	if err != nil {
		return Answer{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return Answer{}, err
	}
	a := Answer{Status: resp.StatusCode, Body: string(b)}
	if resp.StatusCode == http.StatusOK {
		var out struct {
			Choices []struct {
				TokenIDs []int `json:"token_ids"`
			} `json:"choices"`
		}
		if err := json.Unmarshal(b, &out); err != nil || len(out.Choices) != 1 {
			return a, fmt.Errorf("completion answer %s: %v", b, err)
		}
		a.TokenIDs = out.Choices[0].TokenIDs
	}
	return a, nil
}

// Prompt is n token ids, different for each seed, inside the tiny model's vocabulary.
func Prompt(seed, n int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = 100 + (seed*7919+i*31)%31000
	}
	return out
}

// EngineStats reads an engine's /metrics as the sidecar does (vllm.ParseEngineMetrics).
func EngineStats(ctx context.Context, engine string) (vllm.EngineStats, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, engine+"/metrics", nil)
	if err != nil {
		return vllm.EngineStats{}, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return vllm.EngineStats{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return vllm.EngineStats{}, fmt.Errorf("%s/metrics: %s", engine, resp.Status)
	}
	return vllm.ParseEngineMetrics(resp.Body)
}

// Healthy says whether an engine's /health answers 200 now.
func Healthy(ctx context.Context, engine string) bool {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, engine+"/health", nil)
	if err != nil {
		return false
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// Gauge is an engine's gauge from its /metrics, summed over its series (data-parallel ranks).
func Gauge(ctx context.Context, engine, name string) (float64, error) {
	return Metric(ctx, engine, name)
}

// Metric is a counter's or gauge's value from base's /metrics, summed over the series that
// carry every label of labels (name, value pairs).
func Metric(ctx context.Context, base, name string, labels ...string) (float64, error) {
	engine := base
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, engine+"/metrics", nil)
	if err != nil {
		return 0, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(io.LimitReader(resp.Body, vllm.MaxEngineMetrics))
	if err != nil {
		return 0, fmt.Errorf("%s/metrics: %w", engine, err)
	}
	f, ok := families[name]
	if !ok {
		return 0, fmt.Errorf("%s/metrics has no %s", engine, name)
	}
	var sum float64
series:
	for _, m := range f.GetMetric() {
		for i := 0; i+1 < len(labels); i += 2 {
			if !slices.ContainsFunc(m.GetLabel(), func(l *dto.LabelPair) bool { return l.GetName() == labels[i] && l.GetValue() == labels[i+1] }) {
				continue series
			}
		}
		sum += m.GetGauge().GetValue() + m.GetCounter().GetValue()
	}
	return sum, nil
}
