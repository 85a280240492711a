package controllers

import (
	"context"
	"errors"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/utils/ptr"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
)

// A PDCluster whose replicas span pods is refused before anything is applied, with Ready
// False/MultiNodeUnavailable naming the field and what is missing: LeaderWorkerSet in the
// cluster, else this build's rendering of it. One pod per replica passes.
func TestMultiNodeAvailable(t *testing.T) {
	lws := schema.GroupVersionKind{Group: "leaderworkerset.x-k8s.io", Version: "v1", Kind: "LeaderWorkerSet"}
	for _, tc := range []struct {
		name           string
		prefill        *int32
		decode         *int32
		clusterHasLWS  bool
		wantReason     string
		wantInMessages []string
	}{
		{name: "nodes unset", clusterHasLWS: false},
		{name: "nodes 1", prefill: ptr.To[int32](1), decode: ptr.To[int32](1)},
		{name: "prefill across pods, no LeaderWorkerSet in the cluster", prefill: ptr.To[int32](2), wantReason: v1alpha1.ReasonMultiNodeUnavailable,
			wantInMessages: []string{"spec.prefill.parallelism.nodes is 2", "does not serve LeaderWorkerSet", "nothing is applied"}},
		{name: "both across pods, LeaderWorkerSet served", prefill: ptr.To[int32](2), decode: ptr.To[int32](4), clusterHasLWS: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mapper := meta.NewDefaultRESTMapper(nil)
			if tc.clusterHasLWS {
				mapper.Add(lws, meta.RESTScopeNamespace)
			}
			c := newFakeClient(t).WithRESTMapper(mapper).Build()
			r := &PDClusterReconciler{Client: c, Scheme: c.Scheme()}
			p := pdc()
			p.Spec.Prefill.Parallelism.Nodes, p.Spec.Decode.Parallelism.Nodes = tc.prefill, tc.decode
			s, err := r.observeSnapshot(context.Background(), p, start)
			if err != nil {
				t.Fatal(err)
			}
			_, err = prepare(p, s)
			if tc.wantReason == "" {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			var re *readyError
			if !errors.As(err, &re) || re.reason != tc.wantReason {
				t.Fatalf("err = %v, want a readyError with reason %s", err, tc.wantReason)
			}
			for _, want := range tc.wantInMessages {
				if !strings.Contains(re.message, want) {
					t.Errorf("message %q lacks %q", re.message, want)
				}
			}
		})
	}
}
