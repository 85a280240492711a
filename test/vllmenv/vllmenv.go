// Package vllmenv names the installed vLLM releases that tests run Python against, as make test
// sets them.
package vllmenv

import (
	"os"
	"strings"
	"testing"
)

// PythonsEnv names each tested vLLM release's interpreter:
// "0.30.0=/path/bin/python 0.32.0=/path/bin/python ..." (hack/vllm-venv.sh --tested VERSION).
const PythonsEnv = "PDCLUSTER_VLLM_PYTHONS"

// Python is one release's interpreter.
type Python struct{ Version, Path string }

// Pythons reads PythonsEnv, failing t when it is unset or malformed: tests on vLLM never skip
// for want of it.
func Pythons(t testing.TB) []Python {
	t.Helper()
	env := os.Getenv(PythonsEnv)
	if env == "" {
		t.Fatalf("%s is not set: run make test, or set it to \"0.33.0=$(hack/vllm-venv.sh --tested 0.33.0)\" (one VERSION=python per release)", PythonsEnv)
	}
	var out []Python
	for _, pair := range strings.Fields(env) {
		version, python, ok := strings.Cut(pair, "=")
		if !ok || python == "" {
			t.Fatalf("%s: %q is not VERSION=python", PythonsEnv, pair)
		}
		out = append(out, Python{version, python})
	}
	return out
}
