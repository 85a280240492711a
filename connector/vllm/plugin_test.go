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
	if h := Hash(); len(h) != 16 || strings.Trim(h, "0123456789abcdef") != "" {
		t.Errorf("Hash() = %q, want 16 hex digits", h)
	}
}
