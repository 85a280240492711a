package controllers

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/go-logr/logr/funcr"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/yaml"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/pdctl"
)

// pdctl render replays a reconcile: given the PDCluster and what the reconcile logged it took of
// the cluster (the "planned" line's serving), it prints exactly the objects that reconcile
// applied, here in the middle of a KV-revision rollout (an older revision in router.json, the
// new revision's Deployments at the rollout's step); without --serving it prints a different
// router.json and replica counts, so the serving is what makes the replay.
func TestPdctlRenderReplaysAReconcile(t *testing.T) {
	p := pdc() // 1 prefill, 2 decode
	p.Spec.Rollout.MaxSurge = ptr.To(intstr.FromInt32(1))
	p.Spec.Rollout.MaxUnavailable = ptr.To(intstr.FromInt32(0))
	f, _, _ := startKVRollout(t, p)

	var serving string
	logger := funcr.NewJSON(func(obj string) {
		var line map[string]any
		if err := json.Unmarshal([]byte(obj), &line); err == nil && line["msg"] == "planned" {
			serving, _ = line["serving"].(string)
		}
	}, funcr.Options{Verbosity: 1})
	ctx := log.IntoContext(context.Background(), logger)
	if _, err := f.r.Reconcile(ctx, ctrl.Request{NamespacedName: client.ObjectKeyFromObject(p)}); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(serving, `"old"`) || !strings.Contains(serving, `"step"`) {
		t.Fatalf("the reconcile logged serving %q, want an older revision and a step", serving)
	}

	dir := t.TempDir()
	var current v1alpha1.PDCluster
	if err := f.c.Get(ctx, client.ObjectKeyFromObject(p), &current); err != nil {
		t.Fatal(err)
	}
	current.ManagedFields, current.ResourceVersion = nil, ""
	current.APIVersion, current.Kind = v1alpha1.GroupVersion.String(), "PDCluster"
	manifest, err := yaml.Marshal(&current)
	if err != nil {
		t.Fatal(err)
	}
	write := func(name string, b []byte) string {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, b, 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	pdcFile, servingFile := write("pdc.yaml", manifest), write("serving.json", []byte(serving))
	renderList := func(args ...string) []unstructured.Unstructured {
		t.Helper()
		var out, errb bytes.Buffer
		if code := pdctl.Execute(append([]string{"render", "-f", pdcFile, "-o", "json"}, args...), strings.NewReader(""), &out, &errb); code != 0 {
			t.Fatalf("pdctl render %v: exit %d: %s", args, code, errb.String())
		}
		var list unstructured.UnstructuredList
		if err := list.UnmarshalJSON(out.Bytes()); err != nil {
			t.Fatal(err)
		}
		return list.Items
	}

	// Every object pdctl prints is in the cluster as this reconcile applied it.
	differs := func(items []unstructured.Unstructured) []string {
		var out []string
		for _, u := range items {
			obj, err := f.c.Scheme().New(u.GroupVersionKind())
			if err != nil {
				t.Fatal(err)
			}
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, obj); err != nil {
				t.Fatal(err)
			}
			want := obj.(client.Object)
			have := want.DeepCopyObject().(client.Object)
			if err := f.c.Get(ctx, client.ObjectKeyFromObject(want), have); err != nil {
				out = append(out, u.GetKind()+" "+u.GetName()+": "+err.Error())
				continue
			}
			want.SetOwnerReferences(have.GetOwnerReferences()) // set by the reconciler, not render
			if !upToDate(want, have) {
				out = append(out, u.GetKind()+" "+u.GetName())
			}
		}
		return out
	}
	if d := differs(renderList("--serving", servingFile)); len(d) > 0 {
		t.Errorf("pdctl render --serving printed objects the reconcile did not apply: %v", d)
	}
	if d := differs(renderList()); len(d) == 0 {
		t.Error("pdctl render without --serving printed what the reconcile applied mid-rollout too: the test shows nothing")
	}
}
