package render_test

import (
	"testing"

	"github.com/google/go-cmp/cmp"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"

	"pdcluster.dev/pdcluster-operator/internal/render"
)

// ToUnstructured goes through JSON for speed: it must give what apimachinery's converter
// gives (the map the reconciler applies), for every object of every test input.
func TestToUnstructuredMatchesTheConverter(t *testing.T) {
	for _, in := range testInputs(t) {
		objs, err := render.Render(load(t, in), render.DefaultOptions())
		if err != nil {
			t.Fatal(err)
		}
		for _, obj := range objs {
			got, err := render.ToUnstructured(obj)
			if err != nil {
				t.Fatal(err)
			}
			want, err := runtime.DefaultUnstructuredConverter.ToUnstructured(obj)
			if err != nil {
				t.Fatal(err)
			}
			unstructured.RemoveNestedField(want, "metadata", "creationTimestamp")
			unstructured.RemoveNestedField(want, "spec", "template", "metadata", "creationTimestamp")
			if status, ok := want["status"].(map[string]any); ok && len(status) == 0 {
				delete(want, "status")
			}
			if diff := cmp.Diff(want, got); diff != "" {
				t.Errorf("%s: %s %s (-converter +ToUnstructured):\n%s", in, obj.GetObjectKind().GroupVersionKind().Kind, obj.GetName(), diff)
			}
		}
	}
}
