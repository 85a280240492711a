// Package cmd holds one main package per shipped binary; this test checks what each links.
package cmd

import (
	"os/exec"
	"strings"
	"testing"
)

const module = "pdcluster.dev/pdcluster-operator"

// deps lists the packages of this module that pkg links, as `go list -deps` sees them.
func deps(t *testing.T, pkg string) []string {
	t.Helper()
	out, err := exec.Command("go", "list", "-deps", "-f", "{{.ImportPath}}", module+"/"+pkg).CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps %s: %v\n%s", pkg, err, out)
	}
	var own []string
	for _, p := range strings.Fields(string(out)) {
		if rest, ok := strings.CutPrefix(p, module+"/"); ok {
			own = append(own, rest)
		}
	}
	return own
}

// Simulators and test helpers live under test/ and never ship; the operator's binaries (the
// manager and pdctl) carry no data-plane code either: they render the router's config, they do
// not run the router or the connector.
func TestShippedBinariesLinkOnlyWhatTheyShip(t *testing.T) {
	cases := []struct {
		binary    string
		forbidden []string // packages, each with the packages under it
	}{
		{"cmd/manager", []string{"test", "connector", "internal/router", "internal/pdctl"}},
		{"cmd/pdctl", []string{"test", "connector", "internal/router", "controllers"}},
		{"cmd/connector", []string{"test", "internal", "controllers", "connector/bootstrap"}},
		{"cmd/router", []string{"test", "internal/render", "internal/validation", "controllers", "connector/sidecar"}},
	}
	for _, tc := range cases {
		t.Run(tc.binary, func(t *testing.T) {
			linked := deps(t, tc.binary)
			if len(linked) < 2 {
				t.Fatalf("go list -deps %s found %v: the module's own packages are missing", tc.binary, linked)
			}
			for _, p := range linked {
				if p == "connector/vllm" {
					continue // the gate plugin's Python files, embedded: render ships them
				}
				for _, f := range tc.forbidden {
					// internal/router forbids internal/router/..., not internal/routerconfig.
					if p == f || strings.HasPrefix(p, f+"/") {
						t.Errorf("%s links %s (forbidden: %s)", tc.binary, p, f)
					}
				}
			}
		})
	}
}
