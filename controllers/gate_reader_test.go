package controllers

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/go-logr/logr"
	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"

	"pdcluster.dev/pdcluster-operator/connector/localapi"
	"pdcluster.dev/pdcluster-operator/connector/sidecar"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
)

// fakeGates answers ReadGate from a table by pod name; a missing pod is an error.
type fakeGates map[string]vllm.State

func (f fakeGates) ReadGate(_ context.Context, pod *corev1.Pod) (vllm.State, error) {
	st, ok := f[pod.Name]
	if !ok {
		return vllm.State{}, errors.New("connection refused")
	}
	return st, nil
}

func loaded(gated, passed, failed int64) vllm.State {
	return vllm.State{Loaded: true, Report: &vllm.Report{Connector: "GatedMooncakeConnector",
		Counts: vllm.Counts{Gated: gated, Passed: passed, Failed: failed}}}
}

// The reader's side of GET /gate, against a server that answers as the sidecar does.
func TestHTTPGateReader(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != vllm.StatePath {
			http.NotFound(w, r)
			return
		}
		_ = json.NewEncoder(w).Encode(loaded(2, 3, 0))
	}))
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")
	h := NewHTTPGateReader()
	h.Addr = func(*corev1.Pod) string { return host }
	st, err := h.ReadGate(context.Background(), &corev1.Pod{})
	if err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff(loaded(2, 3, 0), st); d != "" {
		t.Errorf("state (-want +got):\n%s", d)
	}
	if _, err := NewHTTPGateReader().ReadGate(context.Background(), &corev1.Pod{}); err == nil || !strings.Contains(err.Error(), "no IP") {
		t.Errorf("pod without IP: err = %v", err)
	}
	h.Addr = func(*corev1.Pod) string { return host + "/nope" } // a sidecar without /gate
	if _, err := h.ReadGate(context.Background(), &corev1.Pod{}); err == nil {
		t.Error("a 404 was read as a state")
	}
}

// The operator reads each pod at the pod's own IP and nowhere else: a pod that answers with a
// redirect (to the API server, a cloud metadata address, another tenant) is not followed, and
// an answer past the bound is refused, not decoded from its first 64 KiB; so are its headers
// past theirs (issue 56).
func TestHTTPGateReaderFollowsNoRedirectAndBoundsTheAnswer(t *testing.T) {
	var followed int
	elsewhere := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		followed++
		_ = json.NewEncoder(w).Encode(loaded(0, 1, 0))
	}))
	defer elsewhere.Close()
	mux := http.NewServeMux()
	mux.Handle("/redirect"+vllm.StatePath, http.RedirectHandler(elsewhere.URL+vllm.StatePath, http.StatusFound))
	mux.HandleFunc("/huge"+vllm.StatePath, func(w http.ResponseWriter, _ *http.Request) {
		// Valid JSON whose first 64 KiB decode: a truncating reader would take it.
		_, _ = w.Write([]byte(`{"loaded":true}` + strings.Repeat(" ", 1<<20)))
	})
	mux.HandleFunc("/huge-headers"+vllm.StatePath, func(w http.ResponseWriter, _ *http.Request) {
		// A megabyte of headers before a valid answer: Go's client takes 10 MiB of them.
		for i := range 64 {
			w.Header().Set(fmt.Sprintf("X-Pad-%d", i), strings.Repeat("x", 16<<10))
		}
		_ = json.NewEncoder(w).Encode(loaded(0, 1, 0))
	})
	pod := httptest.NewServer(mux)
	defer pod.Close()
	h := NewHTTPGateReader()
	for _, path := range []string{"/redirect", "/huge", "/huge-headers"} {
		h.Addr = func(*corev1.Pod) string { return strings.TrimPrefix(pod.URL, "http://") + path }
		if st, err := h.ReadGate(context.Background(), &corev1.Pod{}); err == nil {
			t.Errorf("%s: read %+v, want an error", path, st)
		}
	}
	if followed != 0 {
		t.Errorf("the redirect was followed %d times", followed)
	}
}

// Both sides of the seam: the real connector sidecar takes the plugin's heartbeat on its local
// API, and the operator's reader gets it from the sidecar's public port.
func TestHTTPGateReaderReadsTheSidecar(t *testing.T) {
	sc, err := sidecar.New(sidecar.Config{Log: logr.Discard()})
	if err != nil {
		t.Fatal(err)
	}
	local := httptest.NewServer(sc.LocalHandler(prometheus.NewRegistry()))
	defer local.Close()
	public := httptest.NewServer(sc.PublicHandler(prometheus.NewRegistry()))
	defer public.Close()

	report, _ := json.Marshal(loaded(6, 8, 0).Report)
	resp, err := http.Post(local.URL+localapi.PathGate, "application/json", bytes.NewReader(report))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNoContent {
		t.Fatalf("heartbeat: %s", resp.Status)
	}
	h := NewHTTPGateReader()
	h.Addr = func(*corev1.Pod) string { return strings.TrimPrefix(public.URL, "http://") }
	st, err := h.ReadGate(context.Background(), &corev1.Pod{})
	if err != nil {
		t.Fatal(err)
	}
	if !st.Loaded || st.Report == nil || st.Report.Counts.Gated != 6 || st.Report.Counts.Passed != 8 {
		t.Errorf("state %+v, want the heartbeat's counts, loaded", st)
	}
}
