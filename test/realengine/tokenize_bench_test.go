//go:build realengine

package realengine

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"pdcluster.dev/pdcluster-operator/test/loadgen"
)

// BenchmarkTokenizeRealEngine (make bench, suite routing) is what KVEvents routing of text
// prompts would cost if the router asked an engine for the prompt's token ids first (vLLM's
// POST /tokenize, the only tokenizer that is the engine's own, chat template included): one
// vLLM engine of the newest CPU release with a real tokenizer (testdata/train_tokenizer.py),
// 1 client, a prompt of 1000 characters of text (about 500 tokens, reported as prompt-tokens),
// /tokenize (project) against a 1-token completion of the same prompt (reference), latency and
// the engine's CPU per request.
func BenchmarkTokenizeRealEngine(b *testing.B) {
	releases, err := Releases()
	if err != nil {
		b.Fatal(err)
	}
	rel := releases[len(releases)-1]
	dir := b.TempDir()
	cfg, err := os.ReadFile(filepath.Join("testdata", "tiny-llama", "config.json"))
	if err != nil {
		b.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "config.json"), cfg, 0o644); err != nil {
		b.Fatal(err)
	}
	if out, err := exec.Command(filepath.Join(rel.Bin, "python"), filepath.Join("testdata", "train_tokenizer.py"), dir).CombinedOutput(); err != nil {
		b.Fatalf("train a tokenizer: %v\n%s", err, out)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	shim, _ := filepath.Abs(filepath.Join("testdata", "shim"))
	env := append(os.Environ(), "VLLM_CPU_KVCACHE_SPACE=1", "VLLM_CPU_OMP_THREADS_BIND=nobind", "HF_HUB_OFFLINE=1",
		"PYTHONPATH="+shim, "PATH="+rel.Bin+":"+os.Getenv("PATH"))
	engine, err := start("tokenizing-engine", b.TempDir(), []string{filepath.Join(rel.Bin, "vllm"), "serve", dir, "--served-model-name", "tiny",
		"--load-format=dummy", "--enforce-eager", "--max-model-len=1024", "--max-num-seqs=4", "--host", "127.0.0.1", "--port", strconv.Itoa(port)}, env)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { engine.Stop(10 * time.Second) })
	url := "http://127.0.0.1:" + strconv.Itoa(port)
	if err := WaitOK(context.Background(), url+"/health", engine, startup); err != nil {
		b.Fatal(err)
	}
	pids := groupPIDs(b, engine.cmd.Process.Pid)
	rng := rand.New(rand.NewPCG(7, 7))
	var words []string
	for range 400 {
		n := 2 + rng.IntN(8)
		w := make([]byte, n)
		for i := range w {
			w[i] = byte('a' + rng.IntN(26))
		}
		words = append(words, string(w))
	}
	var text strings.Builder
	for text.Len() < 1000 {
		text.WriteString(words[rng.IntN(len(words))] + " ")
	}
	tokenize, _ := json.Marshal(map[string]any{"model": "tiny", "prompt": text.String()})
	complete, _ := json.Marshal(map[string]any{"model": "tiny", "prompt": text.String(), "max_tokens": 1, "ignore_eos": true})
	a, err := postJSON(url+"/tokenize", tokenize)
	if err != nil {
		b.Fatal(err)
	}
	var counted struct {
		Count int `json:"count"`
	}
	if err := json.Unmarshal(a, &counted); err != nil || counted.Count == 0 {
		b.Fatalf("/tokenize answered %s (%v)", a, err)
	}
	const warmup, duration = 2 * time.Second, 10 * time.Second
	b.Run("project", func(b *testing.B) {
		loadgen.RunAt(b, url+"/tokenize", 1, tokenize, warmup, duration, map[string][]int{"cpu-ms/req": pids})
		b.ReportMetric(float64(counted.Count), "prompt-tokens")
	})
	b.Run("reference", func(b *testing.B) {
		loadgen.RunAt(b, url+"/v1/completions", 1, complete, warmup, duration, map[string][]int{"cpu-ms/req": pids})
	})
}

func postJSON(url string, body []byte) ([]byte, error) {
	resp, err := http.Post(url, "application/json", bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("%s: %s", resp.Status, out)
	}
	return out, err
}

// groupPIDs are the processes of process group pgid (vLLM's API server and its engine core).
func groupPIDs(b *testing.B, pgid int) []int {
	b.Helper()
	entries, err := os.ReadDir("/proc")
	if err != nil {
		b.Fatal(err)
	}
	var out []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue
		}
		// pgrp is the third field after the command name's ')'.
		f := strings.Fields(string(raw[strings.LastIndexByte(string(raw), ')')+1:]))
		if len(f) > 2 && f[2] == strconv.Itoa(pgid) {
			out = append(out, pid)
		}
	}
	return out
}
