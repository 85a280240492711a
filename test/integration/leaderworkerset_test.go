package integration

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	schedulingv1beta1 "k8s.io/api/scheduling/v1beta1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	yamlutil "k8s.io/apimachinery/pkg/util/yaml"
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
		// Kubernetes' own gang scheduling: PodGroups and the pods' schedulingGroup.
		env.ControlPlane.GetAPIServer().Configure().
			Set("feature-gates", "GenericWorkload=true").
			Set("runtime-config", "scheduling.k8s.io/v1beta1=true")
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

// With spec.scheduling.gang Auto (the default) and PodGroups served, each replica across pods
// is one gang: a PodGroup of minCount its pods per group, controlled by the PDCluster, and the
// operator's admission policy (config/admission/gang-podgroups.yaml, run by the API server)
// puts each pod LeaderWorkerSet creates in its group's; gang None deletes them.
func TestGangPodGroups(t *testing.T) {
	f := newFixtureOn(t, groupSetConfig(t))
	applyYAML(t, f, filepath.Join("..", "..", "config", "admission", "gang-podgroups.yaml"))
	p := wrappers.MakePDCluster(f.ns, "gang").Replicas(2, 1).Obj()
	p.Spec.Prefill.Parallelism = v1alpha1.Parallelism{Tensor: ptr.To[int32](2), Nodes: ptr.To[int32](2)}
	if err := f.c.Create(f.ctx, p); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := f.c.Delete(f.ctx, p); err != nil {
			t.Error(err)
		}
		f.reconcile("gang")
	})
	f.reconcile("gang")
	var got v1alpha1.PDCluster
	f.get(&got, "gang")
	for _, name := range []string{"gang-prefill-lws-0", "gang-prefill-lws-1"} {
		var pg schedulingv1beta1.PodGroup
		f.get(&pg, name)
		if !metav1.IsControlledBy(&pg, &got) || pg.Spec.SchedulingPolicy.Gang == nil || pg.Spec.SchedulingPolicy.Gang.MinCount != 2 {
			t.Errorf("PodGroup %s: owners %v, policy %+v: want the PDCluster's gang of 2", name, pg.OwnerReferences, pg.Spec.SchedulingPolicy)
		}
	}
	if c := condition(&got, v1alpha1.ConditionGangScheduling); c.Status != metav1.ConditionTrue {
		t.Errorf("GangScheduling %+v", c)
	}

	// The pods as LeaderWorkerSet's StatefulSets create them: a leader (group 1: its ordinal)
	// and a worker of group 0.
	var lws lwsv1.LeaderWorkerSet
	f.get(&lws, "gang-prefill-lws")
	for _, tc := range []struct {
		name   string
		labels map[string]string
		want   string
	}{
		{"leader", map[string]string{"apps.kubernetes.io/pod-index": "1"}, "gang-prefill-lws-1"},
		{"worker", map[string]string{"apps.kubernetes.io/pod-index": "1", lwsv1.GroupIndexLabelKey: "0"}, "gang-prefill-lws-0"},
	} {
		labels := maps.Clone(lws.Spec.LeaderWorkerTemplate.WorkerTemplate.Labels)
		maps.Copy(labels, tc.labels)
		labels[lwsv1.SetNameLabelKey] = lws.Name
		deadline := time.Now().Add(20 * time.Second)
		for {
			pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: f.ns, GenerateName: tc.name + "-", Labels: labels},
				Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "x"}}}}
			if err := f.c.Create(f.ctx, pod); err != nil {
				t.Fatal(err)
			}
			name := ""
			if sg := pod.Spec.SchedulingGroup; sg != nil {
				name = ptr.Deref(sg.PodGroupName, "")
			}
			if name == tc.want {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s pod's schedulingGroup %q, want %s", tc.name, name, tc.want)
			}
			time.Sleep(500 * time.Millisecond) // the API server has not loaded the policy yet
		}
	}

	f.get(&got, "gang")
	got.Spec.Scheduling.Gang = v1alpha1.GangNone
	if err := f.c.Update(f.ctx, &got); err != nil {
		t.Fatal(err)
	}
	f.reconcile("gang")
	var pgs schedulingv1beta1.PodGroupList
	if err := f.c.List(f.ctx, &pgs, client.InNamespace(f.ns)); err != nil {
		t.Fatal(err)
	}
	for _, pg := range pgs.Items {
		if pg.DeletionTimestamp == nil {
			t.Errorf("PodGroup %s (finalizers %v) kept after gang None", pg.Name, pg.Finalizers)
		}
	}
	// Deleted, though kept by their finalizer while pods name them: not deleted again.
	writes.Store(0)
	f.reconcile("gang")
	if n := writes.Load(); n != 0 {
		t.Errorf("a reconcile with the PodGroups on their way out made %d writes, want 0", n)
	}
	f.get(&got, "gang")
	if c := condition(&got, v1alpha1.ConditionGangScheduling); c.Reason != v1alpha1.ReasonGangDisabled {
		t.Errorf("GangScheduling %+v after gang None", c)
	}
}

// applyYAML creates the objects of a YAML file (once per API server: an object already there
// is left as it is).
func applyYAML(t *testing.T, f *fixture, path string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	dec := yamlutil.NewYAMLOrJSONDecoder(bytes.NewReader(b), 4096)
	for {
		var u unstructured.Unstructured
		if err := dec.Decode(&u.Object); errors.Is(err, io.EOF) {
			return
		} else if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		if len(u.Object) == 0 {
			continue
		}
		if err := f.c.Create(f.ctx, &u); err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatalf("create %s %s: %v", u.GetKind(), u.GetName(), err)
		}
	}
}
