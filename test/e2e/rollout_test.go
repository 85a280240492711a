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

// loadDuring runs four clients in loops through the router until during returns, and returns
// how many requests succeeded and why the others failed.
func (r realNode) loadDuring(during func()) (ok int, failed []string) {
	var (
		mu   sync.Mutex
		wg   sync.WaitGroup
		stop = make(chan struct{})
	)
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				code, n, err := r.complete(words(80), 4)
				mu.Lock()
				if err == nil && code == http.StatusOK && n == 4 {
					ok++
				} else {
					failed = append(failed, fmt.Sprintf("%s %d %v", time.Now().Format(time.TimeOnly), code, err))
				}
				mu.Unlock()
			}
		}()
	}
	during()
	close(stop)
	wg.Wait()
	return ok, failed
}

var mismatches = regexp.MustCompile(`(?m)^vllm_sim_kv_format_mismatches_total ([0-9.e+]+)$`)

// formatMismatches is the stand-in engine's count of pulls refused across KV formats.
func formatMismatches(podIP string) (string, error) {
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Get("http://" + net.JoinHostPort(podIP, fmt.Sprint(vllm.APIPort)) + "/metrics")
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	m := mismatches.FindSubmatch(b)
	if m == nil {
		return "", fmt.Errorf("no vllm_sim_kv_format_mismatches_total in %s's metrics", podIP)
	}
	return string(m[1]), nil
}

// rollsOutKVRevision is the revision-paired rollout: a change of the KV format of both
// pools (vLLM's --kv-cache-dtype: a new KV revision, which the stand-in's KV format follows)
// under load from a bounded client loop. The new revision comes up beside the old one with
// Deployments of its own, the router sends each request to one revision's pair, and the
// rollout ends with the old revision gone: 0 failed requests, 0 pulls across formats.
func (r realNode) rollsOutKVRevision(t *testing.T) {
	before := r.pdc().Status.CurrentRevision
	var sawBoth bool
	ok, failed := r.loadDuring(func() {
		time.Sleep(2 * time.Second)
		r.patchSpec(t, `{"engine":{"args":["--kv-cache-dtype=fp8"]}}`)
		r.eventually("the new KV revision rolled out", func() error {
			p := r.pdc()
			serving := 0
			for _, rev := range p.Status.Revisions {
				if rev.TrafficPercent > 0 {
					serving++
				}
			}
			sawBoth = sawBoth || serving == 2
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
		t.Error("status.revisions never showed both revisions taking traffic: the rollout did not run them side by side")
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
	for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode} {
		for _, pod := range r.pods(role) {
			n, err := formatMismatches(pod.Status.PodIP)
			if err != nil {
				t.Error(err)
			} else if n != "0" {
				t.Errorf("%s pod %s refused %s pulls across KV formats", role, pod.Name, n)
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
