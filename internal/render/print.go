package render

import (
	"encoding/json"
	"fmt"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utiljson "k8s.io/apimachinery/pkg/util/json"
	"sigs.k8s.io/yaml"
)

// ToUnstructured converts a rendered object to the map that is printed or applied, without
// the zero-valued fields (creationTimestamp: null, status: {}) that typed structs carry.
// Through JSON rather than runtime.DefaultUnstructuredConverter: the same map, but the
// converter's reflection over the pod types costs a one-shot pdctl 10 ms on first use, and
// encoding/json 1. Numbers come back as int64 where they are integers, as the converter gives.
func ToUnstructured(obj Object) (map[string]any, error) {
	b, err := json.Marshal(obj)
	if err != nil {
		return nil, fmt.Errorf("convert %T %s: %w", obj, obj.GetName(), err)
	}
	var m map[string]any
	if err := utiljson.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("convert %T %s: %w", obj, obj.GetName(), err)
	}
	unstructured.RemoveNestedField(m, "metadata", "creationTimestamp")
	for _, template := range [][]string{{"template"}, {"leaderWorkerTemplate", "leaderTemplate"}, {"leaderWorkerTemplate", "workerTemplate"}} {
		unstructured.RemoveNestedField(m, append(append([]string{"spec"}, template...), "metadata", "creationTimestamp")...)
	}
	if status, ok := m["status"].(map[string]any); ok && len(status) == 0 {
		delete(m, "status")
	}
	return m, nil
}

// YAML prints objects as a multi-document YAML stream.
func YAML(objs []Object) ([]byte, error) {
	var out []byte
	for i, obj := range objs {
		m, err := ToUnstructured(obj)
		if err != nil {
			return nil, err
		}
		b, err := yaml.Marshal(m)
		if err != nil {
			return nil, fmt.Errorf("encode %s: %w", obj.GetName(), err)
		}
		if i > 0 {
			out = append(out, "---\n"...)
		}
		out = append(out, b...)
	}
	return out, nil
}

// JSONList prints objects as one indented v1 List.
func JSONList(objs []Object) ([]byte, error) {
	items := make([]any, 0, len(objs))
	for _, obj := range objs {
		m, err := ToUnstructured(obj)
		if err != nil {
			return nil, err
		}
		items = append(items, m)
	}
	b, err := json.MarshalIndent(map[string]any{"apiVersion": "v1", "kind": "List", "items": items}, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("encode list: %w", err)
	}
	return append(b, '\n'), nil
}
