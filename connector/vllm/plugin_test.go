package vllm

import (
	"strings"
	"testing"
)

func TestFilesCarryTheGatedClasses(t *testing.T) {
	files := Files()
	for name, want := range map[string]string{
		"__init__.py": "pdgate",
		"mooncake.py": MooncakeClass + " = ",
		"nixl.py":     NixlClass + " = ",
		"gate.py":     "def filter_output",
	} {
		if !strings.Contains(files[name], want) {
			t.Errorf("%s does not contain %q", name, want)
		}
	}
	if len(Hash()) != 16 || Hash() != Hash() {
		t.Errorf("Hash() = %q, want a stable 16-hex-digit hash", Hash())
	}
}
