package integration

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	lwsv1 "sigs.k8s.io/lws/api/leaderworkerset/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

// groupSetEnv is a second API server that serves LeaderWorkerSet (its CRD from the
// sigs.k8s.io/lws module this one builds with), started by the first test that asks: the
// suite's own serves none (TestMultiNodeWithoutLeaderWorkerSet).
var groupSetEnv struct {
	once sync.Once
	env  *envtest.Environment
	cfg  *rest.Config
	err  error
}

// lwsCRD is the LeaderWorkerSet CRD of the sigs.k8s.io/lws module in go.mod.
func lwsCRD() (string, error) {
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "sigs.k8s.io/lws").Output()
	if err != nil {
		return "", fmt.Errorf("find the sigs.k8s.io/lws module: %w", err)
	}
	return filepath.Join(strings.TrimSpace(string(out)), "config", "crd", "bases", "leaderworkerset.x-k8s.io_leaderworkersets.yaml"), nil
}

func groupSetConfig(t *testing.T) *rest.Config {
	t.Helper()
	groupSetEnv.once.Do(func() {
		crd, err := lwsCRD()
		if err != nil {
			groupSetEnv.err = err
			return
		}
		env := &envtest.Environment{
			CRDDirectoryPaths: []string{
				filepath.Join("..", "..", "config", "crd", "bases", "serving.pdcluster.dev_pdclusters.yaml"),
				filepath.Join("..", "..", "config", "crd", "bases", "serving.pdcluster.dev_poolscales.yaml"),
				crd,
			},
			ErrorIfCRDPathMissing: true,
		}
		groupSetEnv.env = env
		groupSetEnv.cfg, groupSetEnv.err = env.Start()
	})
	if groupSetEnv.err != nil {
		t.Fatalf("start an API server with LeaderWorkerSet: %v", groupSetEnv.err)
	}
	return groupSetEnv.cfg
}

func stopGroupSetEnv() {
	if groupSetEnv.env != nil {
		if err := groupSetEnv.env.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "stop envtest (LeaderWorkerSet):", err)
		}
	}
}

func (f *fixture) setGroupSetStatus(name string, ready int32) {
	f.t.Helper()
	var l lwsv1.LeaderWorkerSet
	f.get(&l, name)
	l.Status = lwsv1.LeaderWorkerSetStatus{ObservedGeneration: l.Generation, Replicas: *l.Spec.Replicas, ReadyReplicas: ready, UpdatedReplicas: *l.Spec.Replicas}
	if err := f.c.Status().Update(f.ctx, &l); err != nil {
		f.t.Fatalf("set status of %s: %v", name, err)
	}
}

// A pool whose replicas span pods, where the cluster serves LeaderWorkerSet: the operator
// applies its LeaderWorkerSet (controlled by the PDCluster, as the API server stores it), counts
// its groups in the pool's status, puts it back when changed or deleted, and deletes it when
// the pool returns to one pod per replica.
func TestLeaderWorkerSetPool(t *testing.T) {
	f := newFixtureOn(t, groupSetConfig(t))
	p := wrappers.MakePDCluster(f.ns, "mn").Replicas(2, 1).Obj()
	p.Spec.Prefill.Parallelism = v1alpha1.Parallelism{Data: ptr.To[int32](16), Nodes: ptr.To[int32](2), Expert: true}
	if err := f.c.Create(f.ctx, p); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Gone, and its metrics with it: the operator's metrics are the process's, and
		// TestManagerWatchesRepairScaleAndStatus reads them whole.
		if err := f.c.Delete(f.ctx, p); err != nil {
			t.Error(err)
		}
		f.reconcile("mn")
	})
	f.reconcile("mn")

	var lws lwsv1.LeaderWorkerSet
	f.get(&lws, "mn-prefill-lws")
	var got v1alpha1.PDCluster
	f.get(&got, "mn")
	if !metav1.IsControlledBy(&lws, &got) {
		t.Errorf("LeaderWorkerSet owners %v: want the PDCluster as controller", lws.OwnerReferences)
	}
	if *lws.Spec.Replicas != 2 || *lws.Spec.LeaderWorkerTemplate.Size != 2 || lws.Spec.StartupPolicy != lwsv1.LeaderCreatedStartupPolicy {
		t.Errorf("LeaderWorkerSet spec %+v: want 2 groups of 2 pods, LeaderCreated", lws.Spec)
	}
	var dep appsv1.Deployment
	if err := f.c.Get(f.ctx, client.ObjectKey{Namespace: f.ns, Name: "mn-prefill"}, &dep); !apierrors.IsNotFound(err) {
		t.Errorf("prefill Deployment: %v, want none beside the LeaderWorkerSet", err)
	}
	var svc corev1.Service
	f.get(&svc, "mn-prefill")
	f.get(&dep, "mn-decode")

	// No group ready yet; then the LeaderWorkerSet controller reports both.
	if c := condition(&got, v1alpha1.ConditionPrefillReady); c.Status != metav1.ConditionFalse {
		t.Errorf("PrefillReady %+v before any group is ready", c)
	}
	f.setGroupSetStatus("mn-prefill-lws", 1)
	f.reconcile("mn")
	f.get(&got, "mn")
	if got.Status.Prefill.Ready != "1/2" || condition(&got, v1alpha1.ConditionPrefillReady).Reason != v1alpha1.ReasonReplicasNotReady {
		t.Errorf("prefill status %+v, %+v: want 1/2 groups ready", got.Status.Prefill, condition(&got, v1alpha1.ConditionPrefillReady))
	}
	f.setGroupSetStatus("mn-prefill-lws", 2)
	f.reconcile("mn")
	f.get(&got, "mn")
	if got.Status.Prefill.Ready != "2/2" || condition(&got, v1alpha1.ConditionPrefillReady).Status != metav1.ConditionTrue {
		t.Errorf("prefill status %+v, %+v: want 2/2 groups ready", got.Status.Prefill, condition(&got, v1alpha1.ConditionPrefillReady))
	}
	if got.Status.Revisions[0].Prefill.Desired != 4 {
		t.Errorf("revision status %+v: want 4 prefill pods asked (2 groups of 2)", got.Status.Revisions)
	}

	// The LeaderWorkerSet as stored compares equal to the rendered one: a resync writes nothing.
	writes.Store(0)
	f.reconcile("mn")
	if n := writes.Load(); n != 0 {
		t.Errorf("resync made %d writes, want 0", n)
	}

	// Changed, then deleted: put back.
	f.get(&lws, "mn-prefill-lws")
	lws.Spec.LeaderWorkerTemplate.Size = ptr.To[int32](3)
	if err := f.c.Update(f.ctx, &lws); err != nil {
		t.Fatal(err)
	}
	f.reconcile("mn")
	f.get(&lws, "mn-prefill-lws")
	if *lws.Spec.LeaderWorkerTemplate.Size != 2 {
		t.Errorf("size %d: not put back", *lws.Spec.LeaderWorkerTemplate.Size)
	}
	if err := f.c.Delete(f.ctx, &lws); err != nil {
		t.Fatal(err)
	}
	f.reconcile("mn")
	f.get(&lws, "mn-prefill-lws")

	// One pod per replica again: a Deployment, and the LeaderWorkerSet goes.
	f.get(&got, "mn")
	got.Spec.Prefill.Parallelism.Nodes = ptr.To[int32](1)
	if err := f.c.Update(f.ctx, &got); err != nil {
		t.Fatal(err)
	}
	f.reconcile("mn")
	f.get(&dep, "mn-prefill")
	if err := f.c.Get(f.ctx, client.ObjectKey{Namespace: f.ns, Name: "mn-prefill-lws"}, &lws); !apierrors.IsNotFound(err) {
		t.Errorf("LeaderWorkerSet after nodes 1: %v, want deleted", err)
	}
}
