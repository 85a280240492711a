package e2e

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
)

// underLoad runs four clients in loops of the same completion through the router until during
// returns, and gives record each request's outcome (one call at a time): when it was sent, the
// status, the tokens answered, the error.
func (r realNode) underLoad(during func(), record func(sent time.Time, code, tokens int, err error)) {
	var (
		mu   sync.Mutex
		wg   sync.WaitGroup
		stop = make(chan struct{})
	)
	for range 4 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				sent := time.Now()
				code, n, err := r.complete(words(80), 4)
				mu.Lock()
				record(sent, code, n, err)
				mu.Unlock()
			}
		})
	}
	during()
	close(stop)
	wg.Wait()
}

// loadDuring is underLoad counting the requests that succeeded and saying why the others
// failed.
func (r realNode) loadDuring(during func()) (ok int, failed []string) {
	r.underLoad(during, func(sent time.Time, code, n int, err error) {
		if err == nil && code == http.StatusOK && n == 4 {
			ok++
		} else {
			failed = append(failed, fmt.Sprintf("%s %d %v", sent.Format(time.TimeOnly), code, err))
		}
	})
	return ok, failed
}

// podCounter reads the counter series (its name and labels as exposed) from the engine's
// /metrics at podIP.
func podCounter(podIP, series string) (string, error) {
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Get("http://" + net.JoinHostPort(podIP, fmt.Sprint(vllm.APIPort)) + "/metrics")
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(series) + ` ([0-9.e+]+)$`).FindSubmatch(b)
	if m == nil {
		return "", fmt.Errorf("no %s in %s's metrics", series, podIP)
	}
	return string(m[1]), nil
}

// pairedRevisions counts the KV revisions of the PDCluster ns/cluster that have engine
// Deployments in both pools now.
func (e *env) pairedRevisions(ns, cluster string) int {
	var deps appsv1.DeploymentList
	if err := e.c.List(e.ctx, &deps, client.InNamespace(ns), client.MatchingLabels{v1alpha1.LabelCluster: cluster}); err != nil {
		return 0
	}
	pools := map[string]map[string]bool{}
	for _, d := range deps.Items {
		rev := d.Spec.Template.Labels[v1alpha1.LabelKVRevision]
		if pools[rev] == nil {
			pools[rev] = map[string]bool{}
		}
		pools[rev][d.Labels[v1alpha1.LabelRole]] = true
	}
	n := 0
	for _, p := range pools {
		if p[string(v1alpha1.RolePrefill)] && p[string(v1alpha1.RoleDecode)] {
			n++
		}
	}
	return n
}

// rollsOutKVRevision is the revision-paired rollout: a change of the KV format of both
// pools (vLLM's --kv-cache-dtype: a new KV revision, which the stand-in's KV format follows)
// under load from a bounded client loop. The new revision comes up beside the old one with
// Deployments of its own, the router sends each request to one revision's pair, and the
// rollout ends with the old revision gone: 0 failed requests, 0 pulls across formats.
func (r realNode) rollsOutKVRevision(t *testing.T) {
	before := r.pdc().Status.CurrentRevision
	var sawBoth bool // both revisions' Deployments at once, in both pools
	ok, failed := r.loadDuring(func() {
		time.Sleep(2 * time.Second)
		r.patchSpec(t, `{"engine":{"args":["--kv-cache-dtype=fp8"]}}`)
		r.eventually("the new KV revision rolled out", func() error {
			p := r.pdc()
			sawBoth = sawBoth || r.pairedRevisions(sampleNS, realName) == 2
			if p.Status.UpdateRevision == before || p.Status.CurrentRevision != p.Status.UpdateRevision || len(p.Status.Revisions) != 1 {
				return fmt.Errorf("revisions %+v, update %s, current %s", p.Status.Revisions, p.Status.UpdateRevision, p.Status.CurrentRevision)
			}
			return r.settled()
		})
		time.Sleep(2 * time.Second)
	})
	t.Logf("KV-revision rollout under load: %d ok, %d failed %v", ok, len(failed), failed)
	if len(failed) > 0 || ok == 0 {
		t.Errorf("KV-revision rollout under load: %d requests failed (%d ok)", len(failed), ok)
	}
	if !sawBoth {
		t.Error("the two revisions never had Deployments in both pools at once: the rollout did not run them side by side")
	}
	update := r.pdc().Status.UpdateRevision
	var deps appsv1.DeploymentList
	if err := r.c.List(r.ctx, &deps, client.InNamespace(sampleNS), client.MatchingLabels{v1alpha1.LabelCluster: realName}); err != nil {
		t.Fatal(err)
	}
	var engines []string
	for _, d := range deps.Items {
		if d.Labels[v1alpha1.LabelRole] != string(v1alpha1.RoleRouter) {
			engines = append(engines, d.Name)
			if !strings.HasSuffix(d.Name, "-"+update) {
				t.Errorf("engine Deployment %s after the rollout: want the new revision's %s only", d.Name, update)
			}
		}
	}
	if len(engines) != 2 {
		t.Errorf("engine Deployments %v after the rollout, want one per pool", engines)
	}
	// A cross-revision pull fails on both sides: the producer refuses it (the new prefill, for
	// an old decode's pull) and the consumer counts it failed (the new decode, for its pull
	// from an old prefill). The new revision's pods saw every such pull of the rollout.
	for role, series := range map[v1alpha1.Role]string{
		v1alpha1.RolePrefill: "vllm_sim_kv_format_mismatches_total", v1alpha1.RoleDecode: "pdcluster_connector_failed_pulls_total",
	} {
		for _, pod := range r.pods(role) {
			n, err := podCounter(pod.Status.PodIP, series)
			if err != nil {
				t.Error(err)
			} else if n != "0" {
				t.Errorf("%s pod %s: %s %s, want 0 (pulls across KV revisions)", role, pod.Name, series, n)
			}
		}
	}
	r.patchReal(t, `{"engine":{"args":null}}`)
}

// patchSpec merges spec into the real sample's spec without waiting.
func (r realNode) patchSpec(t *testing.T, spec string) {
	t.Helper()
	p := &v1alpha1.PDCluster{}
	p.Namespace, p.Name = sampleNS, realName
	if err := r.c.Patch(r.ctx, p, client.RawPatch("application/merge-patch+json", []byte(`{"spec":`+spec+`}`))); err != nil {
		t.Error(err)
	}
}
