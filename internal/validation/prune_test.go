package validation

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	utiljson "k8s.io/apimachinery/pkg/util/json"
	"sigs.k8s.io/yaml"
)

// The validators built for the part of the schema an object reaches give the verdict of the
// validators for the whole schema, error for error, on every valid and invalid manifest the
// tests know (the integration parity test then compares pdctl with a real API server).
func TestPrunedSchemaAdmitsAsTheWholeSchema(t *testing.T) {
	docs := map[string]string{}
	for _, tc := range invalidSpecs {
		docs[tc.name] = tc.doc
	}
	files, err := filepath.Glob("../render/testdata/*.yaml")
	if err != nil {
		t.Fatal(err)
	}
	files = append(files, "../../config/samples/serving_v1alpha1_pdcluster.yaml", "../../config/samples/local-node.yaml", "../../config/samples/local-node-multinode.yaml")
	for _, f := range files {
		if strings.HasSuffix(f, ".golden.yaml") {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		docs[f] = string(b)
	}
	a := loader(t).admitter
	full, err := a.full()
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	checked := 0
	for name, doc := range docs {
		js, err := yaml.YAMLToJSON([]byte(doc))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		var obj, whole map[string]any
		if utiljson.Unmarshal(js, &obj) != nil || utiljson.Unmarshal(js, &whole) != nil || obj["kind"] != "PDCluster" {
			continue // decoding errors are the loader's, before any schema
		}
		gotPruned, gotErrs := a.Admit(ctx, obj)
		wantPruned, wantErrs := a.admit(ctx, full, whole)
		if diff := cmp.Diff(wantPruned, gotPruned); diff != "" {
			t.Errorf("%s: pruned fields (-whole schema +reached part):\n%s", name, diff)
		}
		if diff := cmp.Diff(wantErrs.ToAggregate(), gotErrs.ToAggregate()); diff != "" {
			t.Errorf("%s: errors (-whole schema +reached part):\n%s", name, diff)
		}
		if diff := cmp.Diff(whole, obj); diff != "" {
			t.Errorf("%s: defaulted object (-whole schema +reached part):\n%s", name, diff)
		}
		checked++
	}
	if checked < 25 {
		t.Fatalf("checked %d manifests, want at least 25", checked)
	}
}

// A rule of a kept node keeps the fields it names, even absent ones, so it compiles; a node
// the object does not reach loses its rules.
func TestSchemaForKeepsWhatRulesName(t *testing.T) {
	a := loader(t).admitter
	obj := map[string]any{"spec": map[string]any{"kvTransfer": map[string]any{"protocol": "tcp"}}}
	s, err := schemaFor(a.schema, obj)
	if err != nil {
		t.Fatal(err)
	}
	whole, err := a.schema.Build(0)
	if err != nil {
		t.Fatal(err)
	}
	kv := s.Properties["spec"].Properties["kvTransfer"]
	if len(kv.XValidations) == 0 {
		t.Fatal("the kvTransfer rules were dropped, with kvTransfer set")
	}
	if _, ok := kv.Properties["rdmaDevices"]; !ok {
		t.Error("rdmaDevices, named by a kvTransfer rule, was pruned")
	}
	if _, ok := s.Properties["spec"].Properties["engine"]; ok {
		if n := len(s.Properties["spec"].Properties["engine"].XValidations); n != 0 {
			t.Errorf("engine is absent but kept %d rules", n)
		}
	}
	if len(s.Properties["spec"].Properties) >= len(whole.Properties["spec"].Properties) {
		t.Errorf("spec kept %d of %d properties, want fewer", len(s.Properties["spec"].Properties), len(whole.Properties["spec"].Properties))
	}
}
