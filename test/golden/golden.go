// Package golden compares what a test produced with the file that holds what it should be,
// and rewrites that file when the test runs with -update.
package golden

import (
	"flag"
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-cmp/cmp"
)

var update = flag.Bool("update", false, "rewrite the golden files")

// Equal fails t unless the file at path holds got; with -update it writes got there first.
// regenerate is the command that rewrites the file, which the failure names.
func Equal(t testing.TB, path string, got []byte, regenerate string) {
	t.Helper()
	if *update {
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (%s writes it)", err, regenerate)
	}
	if d := cmp.Diff(string(want), string(got)); d != "" {
		t.Errorf("%s is stale (%s rewrites it) (-want +got):\n%s", path, regenerate, d)
	}
}
