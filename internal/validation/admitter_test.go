package validation

import (
	"context"
	"sort"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// widgetCRD is a CRD of its own, so these tests check the Admitter's steps (prune, default,
// schema, list types, CEL) apart from the PDCluster schema.
const widgetCRD = `
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.example.dev
spec:
  group: example.dev
  names: {kind: Widget, plural: widgets}
  scope: Namespaced
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          apiVersion: {type: string}
          kind: {type: string}
          metadata: {type: object}
          spec:
            type: object
            x-kubernetes-validations:
            - rule: "self.min <= self.max"
              message: "min must not exceed max"
            properties:
              size: {type: integer, default: 3, minimum: 1}
              min: {type: integer, default: 0}
              max: {type: integer, default: 10}
              mode: {type: string, enum: [fast, slow]}
              tags:
                type: array
                x-kubernetes-list-type: set
                items: {type: string}
`

func newWidgetAdmitter(t *testing.T) *Admitter {
	t.Helper()
	a, err := NewAdmitter([]byte(widgetCRD), "v1")
	if err != nil {
		t.Fatal(err)
	}
	return a
}

func TestNewAdmitterErrors(t *testing.T) {
	cases := []struct{ name, crd, version, want string }{
		{"unknown version", widgetCRD, "v2", "has no version v2"},
		{"not a CRD", "kind: [", "v1", "decode CRD"},
		{"no schema", strings.SplitN(widgetCRD, "    schema:", 2)[0], "v1", "has no schema"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := NewAdmitter([]byte(tc.crd), tc.version); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("err = %v, want %q", err, tc.want)
			}
		})
	}
}

func TestAdmitterPrunesDefaultsAndValidates(t *testing.T) {
	cases := []struct {
		name       string
		spec       map[string]any
		wantSpec   map[string]any
		wantPruned []string
		wantErrs   []string
		objName    string // metadata.name, when not "w"
	}{
		{
			name:     "defaults fill unset fields",
			spec:     map[string]any{},
			wantSpec: map[string]any{"size": int64(3), "min": int64(0), "max": int64(10)},
		},
		{
			name:       "unknown fields are pruned and reported",
			spec:       map[string]any{"size": int64(2), "colour": "red"},
			wantSpec:   map[string]any{"size": int64(2), "min": int64(0), "max": int64(10)},
			wantPruned: []string{"spec.colour"},
		},
		{
			name: "schema errors name the field; an unsupported value blocks CEL, with a note",
			spec: map[string]any{"size": int64(0), "mode": "medium"},
			wantErrs: []string{"<nil>: Invalid value: null: some validation rules were not checked",
				"spec.mode: Unsupported value", "spec.size: Invalid value"},
		},
		{
			name:     "list-type set rejects duplicates",
			spec:     map[string]any{"tags": []any{"a", "a"}},
			wantErrs: []string{"spec.tags[1]: Duplicate value"},
		},
		{
			name:     "CEL rule runs on a schema-valid object, defaults included",
			spec:     map[string]any{"min": int64(11)},
			wantErrs: []string{"spec: Invalid value: min must not exceed max"},
		},
		{
			// As in the API server: a minimum violated does not keep the rules from running.
			name:     "CEL still runs after a non-blocking schema error",
			spec:     map[string]any{"min": int64(11), "size": int64(0)},
			wantErrs: []string{"spec.size: Invalid value", "spec: Invalid value: min must not exceed max"},
		},
		{
			name:     "a wrong type blocks CEL",
			spec:     map[string]any{"min": "eleven"},
			wantErrs: []string{"<nil>: Invalid value: null: some validation rules were not checked", "spec.min: Invalid value"},
		},
		{
			name:     "the name is checked as the API server checks it",
			spec:     map[string]any{},
			objName:  "Widget_1",
			wantErrs: []string{"metadata.name: Invalid value: \"Widget_1\": a lowercase RFC 1123 subdomain"},
		},
	}
	a := newWidgetAdmitter(t)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			name := "w"
			if tc.objName != "" {
				name = tc.objName
			}
			obj := map[string]any{"apiVersion": "example.dev/v1", "kind": "Widget", "metadata": map[string]any{"name": name}, "spec": tc.spec}
			pruned, errs := a.Admit(context.Background(), obj)
			if d := cmp.Diff(tc.wantPruned, pruned); d != "" {
				t.Errorf("pruned (-want +got):\n%s", d)
			}
			// The schema validator's order of errors is not stable: compare them sorted.
			sort.Slice(errs, func(i, j int) bool { return errs[i].Error() < errs[j].Error() })
			if len(errs) != len(tc.wantErrs) {
				t.Fatalf("errors %v, want %d like %q", errs, len(tc.wantErrs), tc.wantErrs)
			}
			for i, want := range tc.wantErrs {
				if !strings.Contains(errs[i].Error(), want) {
					t.Errorf("error %d = %q, want it to contain %q", i, errs[i].Error(), want)
				}
			}
			if tc.wantSpec != nil {
				if d := cmp.Diff(tc.wantSpec, obj["spec"]); d != "" {
					t.Errorf("spec after admission (-want +got):\n%s", d)
				}
			}
		})
	}
}
