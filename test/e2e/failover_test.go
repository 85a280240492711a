package e2e

import (
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
)

// patchReal merge-patches the real node's sample and waits until it settled.
func (r realNode) patchReal(t *testing.T, spec string) {
	t.Helper()
	p := &v1alpha1.PDCluster{ObjectMeta: metav1.ObjectMeta{Namespace: sampleNS, Name: realName}}
	if err := r.c.Patch(r.ctx, p, client.RawPatch(types.MergePatchType, []byte(`{"spec":`+spec+`}`))); err != nil {
		t.Fatal(err)
	}
	r.eventually("the sample settled after "+spec, r.settled)
}

// killOutcome counts the requests of a load loop around a forced delete of a prefill pod.
type killOutcome struct{ ok, inFlight, late int }

// killPrefillUnderLoad runs four clients in bounded loops through the router's Service,
// force-deletes one of the two prefill pods two seconds in (the engine is killed, no drain),
// and classifies each failed request by whether it was sent before the pod was gone.
func (r realNode) killPrefillUnderLoad(t *testing.T) killOutcome {
	t.Helper()
	pod := r.pods(v1alpha1.RolePrefill)[0]
	victim, health := pod.Name, "http://"+pod.Status.PodIP+":8000/health"
	var (
		mu      sync.Mutex
		out     killOutcome
		killed  time.Time
		wg      sync.WaitGroup
		stop    = time.Now().Add(20 * time.Second)
		killAt  = time.Now().Add(2 * time.Second)
		reasons = map[string]int{}
	)
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(stop) {
				sent := time.Now()
				code, n, err := r.complete(words(80), 4)
				mu.Lock()
				switch {
				case err == nil && code == 200 && n == 4:
					out.ok++
				case killed.IsZero() || sent.Before(killed):
					out.inFlight++
					reasons[fmt.Sprintf("in flight: %d %v", code, err)]++
				default:
					out.late++
					reasons[fmt.Sprintf("after the kill: %d %v", code, err)]++
				}
				mu.Unlock()
			}
		}()
	}
	time.Sleep(time.Until(killAt))
	r.run("delete", "pod", "-n", sampleNS, victim, "--grace-period=0", "--force", "--wait=false")
	// The pod is gone from the API at once; its engine only when the kubelet has killed it:
	// requests sent until then may be in flight on it. Past that, its address answers no more.
	hc := &http.Client{Timeout: time.Second}
	r.eventually("the killed pod's engine stopped answering", func() error {
		resp, err := hc.Get(health)
		if err != nil {
			return nil
		}
		resp.Body.Close()
		return fmt.Errorf("%s still answers %s", victim, resp.Status)
	})
	mu.Lock()
	killed = time.Now()
	mu.Unlock()
	wg.Wait()
	var why []string
	for k, n := range reasons {
		why = append(why, fmt.Sprintf("%dx %s", n, k))
	}
	t.Logf("%d ok, %d failed in flight at the kill, %d failed after it; %s", out.ok, out.inFlight, out.late, strings.Join(why, "; "))
	return out
}

// prefillKilledUnderLoad is the measurement of the router issue, made a test: with two prefill
// replicas, a forced delete of one under load fails no request sent after it (the router
// retries on the other pod and ejects the dead one at once); with onPrefillFailure Fail the
// same kill fails more, so the test can fail.
func (r realNode) prefillKilledUnderLoad(t *testing.T) {
	r.patchReal(t, `{"prefill":{"replicas":2}}`)
	defer r.patchReal(t, `{"prefill":{"replicas":1},"router":{"failurePolicy":{"onPrefillFailure":"Retry"}}}`)
	retry := r.killPrefillUnderLoad(t)
	if retry.late > 0 {
		t.Errorf("onPrefillFailure Retry: %d requests sent after the kill failed", retry.late)
	}
	if retry.ok == 0 {
		t.Fatal("no request succeeded")
	}
	r.eventually("a second prefill pod again", r.settled)
	r.patchReal(t, `{"router":{"failurePolicy":{"onPrefillFailure":"Fail"}}}`)
	fail := r.killPrefillUnderLoad(t)
	if fail.inFlight+fail.late <= retry.inFlight+retry.late {
		t.Errorf("onPrefillFailure Fail failed %d requests, Retry %d: the kill never reached the router's failure path", fail.inFlight+fail.late, retry.inFlight+retry.late)
	}
}
