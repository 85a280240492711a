package render

import (
	"encoding/json"
	"fmt"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/yaml"
)

// ToUnstructured converts a rendered object to the map that is printed or applied, without
// the zero-valued fields (creationTimestamp: null, status: {}) that typed structs carry.
func ToUnstructured(obj Object) (map[string]any, error) {
	m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(obj)
	if err != nil {
		return nil, fmt.Errorf("convert %T %s: %w", obj, obj.GetName(), err)
	}
	unstructured.RemoveNestedField(m, "metadata", "creationTimestamp")
	unstructured.RemoveNestedField(m, "spec", "template", "metadata", "creationTimestamp")
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
