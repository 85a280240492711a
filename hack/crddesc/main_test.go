package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"sigs.k8s.io/yaml"
)

func TestReflow(t *testing.T) {
	for _, tc := range []struct{ name, in, want string }{
		{"one line", "Replicas of the pool.", "Replicas of the pool."},
		{"a paragraph broken by the Go comment", "gateStartupGraceSeconds is how long\na connector stays ready.", "gateStartupGraceSeconds is how long a connector stays ready."},
		{"paragraphs stay apart", "First line\nof one.\n\nSecond\nparagraph.", "First line of one.\n\nSecond paragraph."},
		{"list items keep their lines", "Modes:\n- Passive: reads\n  metrics.\n- Canary: sends one.", "Modes:\n- Passive: reads\n  metrics.\n- Canary: sends one."},
		{"numbered items too", "Steps:\n1. render\n2. apply", "Steps:\n1. render\n2. apply"},
		{"indented enum values of core types", "Possible enum values:\n - `\"Always\"` means\n - `\"Never\"`", "Possible enum values:\n - `\"Always\"` means\n - `\"Never\"`"},
		{"trailing spaces dropped", "a \nb", "a b"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if d := cmp.Diff(tc.want, Reflow(tc.in)); d != "" {
				t.Errorf("Reflow(%q) (-want +got):\n%s", tc.in, d)
			}
		})
	}
}

// The CRD make manifests wrote is reflowed: no description breaks a line before a word that
// continues the sentence (what kubectl explain showed before).
func TestGeneratedCRDReadsAsParagraphs(t *testing.T) {
	paths, err := filepath.Glob("../../config/crd/bases/*.yaml")
	if err != nil || len(paths) == 0 {
		t.Fatalf("no CRDs: %v", err)
	}
	broken := regexp.MustCompile(`[a-z,]\n[a-z]`)
	for _, p := range paths {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		var doc map[string]any
		if err := yaml.Unmarshal(b, &doc); err != nil {
			t.Fatal(err)
		}
		n := 0
		var check func(v any)
		check = func(v any) {
			switch x := v.(type) {
			case map[string]any:
				for k, e := range x {
					if s, ok := e.(string); ok && k == "description" {
						n++
						if broken.MatchString(s) {
							t.Errorf("%s: a description breaks mid-sentence (run make manifests): %q", p, s)
						}
						continue
					}
					check(e)
				}
			case []any:
				for _, e := range x {
					check(e)
				}
			}
		}
		check(doc)
		// Every field has one: PDCluster's hundreds, PoolScale's handful (a walk that found
		// none would check nothing).
		if want := map[bool]int{true: 100, false: 8}[strings.Contains(p, "_pdclusters.")]; n < want {
			t.Errorf("%s: %d descriptions checked, want at least %d", p, n, want)
		}
	}
}
