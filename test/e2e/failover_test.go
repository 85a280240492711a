package e2e

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

// enginePID is the process of the engine container whose pod has ip (its POD_IP).
func enginePID(t *testing.T, ip string) int {
	t.Helper()
	procs, _ := filepath.Glob("/proc/[0-9]*/environ")
	for _, p := range procs {
		env, err := os.ReadFile(p)
		if err != nil || !strings.Contains("\x00"+string(env)+"\x00", "\x00POD_IP="+ip+"\x00") {
			continue
		}
		cmd, _ := os.ReadFile(filepath.Join(filepath.Dir(p), "cmdline"))
		if args := strings.Split(string(cmd), "\x00"); filepath.Base(args[0]) != "vllm" {
			continue // the connector sidecar has POD_IP too
		}
		var pid int
		if _, err := fmt.Sscanf(filepath.Base(filepath.Dir(p)), "%d", &pid); err == nil {
			return pid
		}
	}
	t.Fatalf("no engine process with POD_IP=%s on this host", ip)
	return 0
}

// patchReal merge-patches the real node's sample and waits until it settled: the usual
// timeout, plus the longest grace period of its pods, since a pod the patch replaces may drain
// for all of it (KV that earlier tests left held for pulls that never come keeps vLLM waiting
// its --shutdown-timeout; settled waits for every pod being deleted to be gone).
func (r realNode) patchReal(t *testing.T, spec string) {
	t.Helper()
	var pods corev1.PodList
	if err := r.c.List(r.ctx, &pods, client.InNamespace(sampleNS), client.MatchingLabels{v1alpha1.LabelCluster: realName}); err != nil {
		t.Fatal(err)
	}
	var grace int64
	for _, pod := range pods.Items {
		grace = max(grace, ptr.Deref(pod.Spec.TerminationGracePeriodSeconds, 30))
	}
	p := &v1alpha1.PDCluster{ObjectMeta: metav1.ObjectMeta{Namespace: sampleNS, Name: realName}}
	if err := r.c.Patch(r.ctx, p, client.RawPatch(types.MergePatchType, []byte(`{"spec":`+spec+`}`))); err != nil {
		t.Fatal(err)
	}
	r.eventuallyWithin("the sample settled after "+spec, timeout+time.Duration(grace)*time.Second, r.settled)
}

// routerKnows is nil once every router pod knows n prefill engines (pdcluster_router_endpoints,
// on its metrics port): a pod that is ready is in a router's pool only after its next
// resolution of the Service.
func (r realNode) routerKnows(n int) func() error {
	return func() error {
		var pods corev1.PodList
		if err := r.c.List(r.ctx, &pods, client.InNamespace(sampleNS), client.MatchingLabels(render.Labels(realName, v1alpha1.RoleRouter))); err != nil {
			return err
		}
		running := 0
		for _, pod := range pods.Items {
			if pod.Status.PodIP == "" || pod.DeletionTimestamp != nil {
				continue
			}
			running++
			resp, err := (&http.Client{Timeout: 5 * time.Second}).Get("http://" + net.JoinHostPort(pod.Status.PodIP, strconv.Itoa(int(render.RouterMetricsPort))) + "/metrics")
			if err != nil {
				return err
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			want := fmt.Sprintf(`pdcluster_router_endpoints{pool="prefill"} %d`, n)
			if !strings.Contains(string(b), want+"\n") {
				return fmt.Errorf("router %s does not report %s yet", pod.Name, want)
			}
		}
		if running == 0 {
			return errors.New("no router pod runs")
		}
		return nil
	}
}

// killOutcome counts the requests of a load loop around a forced delete of a prefill pod.
type killOutcome struct{ ok, inFlight, late int }

// killPrefillUnderLoad runs four clients in loops through the router's Service for 20 s, kills
// the engine of one of the two prefill pods two seconds in (SIGKILL, no drain), force-deletes
// its pod, and classifies each failed request by whether it was sent before the kill.
func (r realNode) killPrefillUnderLoad(t *testing.T) killOutcome {
	t.Helper()
	r.eventually("the router knows both prefill pods", r.routerKnows(2))
	pod := r.pods(v1alpha1.RolePrefill)[0]
	victim := pod.Name
	var (
		out     killOutcome
		killed  atomic.Int64 // UnixNano of the kill, 0 before
		start   = time.Now()
		reasons = map[string]int{}
	)
	r.underLoad(func() {
		time.Sleep(time.Until(start.Add(2 * time.Second)))
		// A hard kill: the engine dies at once (SIGKILL, no drain), then the pod is
		// force-deleted. The router still lists it until its next resolution of the Service.
		if err := syscall.Kill(enginePID(t, pod.Status.PodIP), syscall.SIGKILL); err != nil {
			t.Error(err)
		}
		r.run("delete", "pod", "-n", sampleNS, victim, "--grace-period=0", "--force", "--wait=false")
		killed.Store(time.Now().UnixNano())
		time.Sleep(time.Until(start.Add(20 * time.Second)))
	}, func(sent time.Time, code, n int, err error) {
		switch at := killed.Load(); {
		case err == nil && code == 200 && n == 4:
			out.ok++
		case at == 0 || sent.UnixNano() < at:
			out.inFlight++
			reasons[fmt.Sprintf("in flight: %d %v", code, err)]++
		default:
			out.late++
			reasons[fmt.Sprintf("after the kill: %d %v", code, err)]++
		}
	})
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
