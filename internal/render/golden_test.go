package render_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/internal/validation"

	"pdcluster.dev/pdcluster-operator/test/golden"
)

func load(t *testing.T, path string) *v1alpha1.PDCluster {
	t.Helper()
	l, err := validation.NewLoader()
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	docs, err := l.Read(context.Background(), f)
	if err != nil {
		t.Fatal(err)
	}
	return docs[0].PDCluster
}

// testInputs are the PDClusters of testdata (each beside its .golden.yaml).
func testInputs(t *testing.T) []string {
	t.Helper()
	all, err := filepath.Glob("testdata/*.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var inputs []string
	for _, in := range all {
		if !strings.HasSuffix(in, ".golden.yaml") {
			inputs = append(inputs, in)
		}
	}
	return inputs
}

// Golden files pin the whole rendered output; `make golden` rewrites them after a deliberate change.
func TestRenderGolden(t *testing.T) {
	for _, in := range testInputs(t) {
		t.Run(filepath.Base(in), func(t *testing.T) {
			objs, err := render.Render(load(t, in), render.DefaultOptions())
			if err != nil {
				t.Fatal(err)
			}
			got, err := render.YAML(objs)
			if err != nil {
				t.Fatal(err)
			}
			golden.Equal(t, strings.TrimSuffix(in, ".yaml")+".golden.yaml", got, "make golden")
		})
	}
}

func TestRenderIsDeterministic(t *testing.T) {
	pdc := load(t, "testdata/mooncake-rdma.yaml")
	first, err := render.Render(pdc, render.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	a, _ := render.YAML(first)
	for i := 0; i < 20; i++ {
		again, _ := render.Render(pdc, render.DefaultOptions())
		b, _ := render.YAML(again)
		if string(a) != string(b) {
			t.Fatalf("render %d differs from the first", i)
		}
	}
}
