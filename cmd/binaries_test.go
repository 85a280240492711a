// Package cmd holds one main package per shipped binary; this test checks what each links.
package cmd

import (
	"os/exec"
	"strings"
	"testing"
)

const module = "pdcluster.dev/pdcluster-operator"

// deps lists the packages pkg links, as `go list -deps` sees them: this module's by their path
// inside it (api/v1alpha1), the others by their import path (k8s.io/api/core/v1).
func deps(t *testing.T, pkg string) (own, others []string) {
	t.Helper()
	out, err := exec.Command("go", "list", "-deps", "-f", "{{.ImportPath}}", module+"/"+pkg).CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps %s: %v\n%s", pkg, err, out)
	}
	for _, p := range strings.Fields(string(out)) {
		if rest, ok := strings.CutPrefix(p, module+"/"); ok {
			own = append(own, rest)
		} else {
			others = append(others, p)
		}
	}
	return own, others
}

// under reports whether package p is f or below it (internal/router is not internal/routerconfig).
func under(p, f string) bool { return p == f || strings.HasPrefix(p, f+"/") }

// Simulators and test helpers live under test/ and never ship; the operator's binaries (the
// manager and pdctl) carry no data-plane code either: they render the router's config, they do
// not run the router or the connector.
func TestShippedBinariesLinkOnlyWhatTheyShip(t *testing.T) {
	// The data plane (the sidecar, the router) links no Kubernetes API types: they speak vLLM's
	// words (connector/vllm), not the PDCluster's. (controller-runtime's zap logger, which both use,
	// links apimachinery's meta types, not the API.)
	noAPI := []string{"k8s.io/api", "sigs.k8s.io/controller-runtime/pkg/client"}
	cases := []struct {
		binary    string
		forbidden []string // packages of this module, each with the packages under it
		external  []string // other modules' packages, likewise
	}{
		{"cmd/manager", []string{"test", "connector", "internal/router", "internal/pdctl"}, nil},
		{"cmd/pdctl", []string{"test", "connector", "internal/router", "controllers"}, nil},
		{"cmd/connector", []string{"test", "internal", "controllers", "api"}, noAPI},
		{"cmd/router", []string{"test", "internal/render", "internal/validation", "controllers", "connector/sidecar", "api"}, noAPI},
	}
	for _, tc := range cases {
		t.Run(tc.binary, func(t *testing.T) {
			linked, others := deps(t, tc.binary)
			if len(linked) < 2 || len(others) < 10 {
				t.Fatalf("go list -deps %s found %v and %d others: packages are missing", tc.binary, linked, len(others))
			}
			for _, p := range linked {
				if p == "connector/vllm" {
					continue // vLLM's words and the gate plugin's Python files (render ships them)
				}
				for _, f := range tc.forbidden {
					if under(p, f) {
						t.Errorf("%s links %s (forbidden: %s)", tc.binary, p, f)
					}
				}
			}
			for _, p := range others {
				for _, f := range tc.external {
					if under(p, f) {
						t.Errorf("%s links %s (forbidden: %s)", tc.binary, p, f)
					}
				}
			}
		})
	}
}

// connector/ is what runs in the engine pods beside vLLM (the gate plugin, the sidecar, the
// launcher): it links nothing of internal/, which the operator and the router share, nor the
// operator's or the tests' packages.
func TestConnectorPackagesLinkNoneOfInternal(t *testing.T) {
	out, err := exec.Command("go", "list", module+"/connector/...").CombinedOutput()
	if err != nil {
		t.Fatalf("go list connector/...: %v\n%s", err, out)
	}
	pkgs := strings.Fields(string(out))
	if len(pkgs) < 4 {
		t.Fatalf("go list connector/... found %v: packages are missing", pkgs)
	}
	for _, pkg := range pkgs {
		linked, _ := deps(t, strings.TrimPrefix(pkg, module+"/"))
		for _, p := range linked {
			for _, f := range []string{"internal", "controllers", "test"} {
				if under(p, f) {
					t.Errorf("%s links %s (forbidden: %s)", pkg, p, f)
				}
			}
		}
	}
}
