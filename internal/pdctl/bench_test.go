package pdctl_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"
)

// BenchmarkStart runs the built pdctl as a user does, validate and render of the sample, and a
// Go program that only prints a line (reference: what starting any Go binary costs here). Each
// reports the median wall time of 20 runs.
func BenchmarkStart(b *testing.B) {
	dir := b.TempDir()
	build := exec.Command("go", "build", "-o", filepath.Join(dir, "pdctl"), "./cmd/pdctl")
	build.Dir = filepath.Join("..", "..")
	build.Stderr = os.Stderr
	if err := build.Run(); err != nil {
		b.Fatal(err)
	}
	hello := filepath.Join(dir, "hello.go")
	if err := os.WriteFile(hello, []byte("package main\n\nimport \"fmt\"\n\nfunc main() { fmt.Println(\"hello\") }\n"), 0o644); err != nil {
		b.Fatal(err)
	}
	build = exec.Command("go", "build", "-o", filepath.Join(dir, "hello"), hello)
	build.Dir = dir
	build.Env = append(os.Environ(), "GO111MODULE=off")
	build.Stderr = os.Stderr
	if err := build.Run(); err != nil {
		b.Fatal(err)
	}
	sample, err := filepath.Abs(filepath.Join("..", "..", "config", "samples", "serving_v1alpha1_pdcluster.yaml"))
	if err != nil {
		b.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"validate/project", []string{filepath.Join(dir, "pdctl"), "validate", "-f", sample}},
		{"render/project", []string{filepath.Join(dir, "pdctl"), "render", "-f", sample}},
		{"reference", []string{filepath.Join(dir, "hello")}},
	} {
		b.Run(tc.name, func(b *testing.B) {
			runs := make([]time.Duration, 20)
			for i := range runs {
				start := time.Now()
				if out, err := exec.Command(tc.args[0], tc.args[1:]...).CombinedOutput(); err != nil {
					b.Fatalf("%v: %v\n%s", tc.args, err, out)
				}
				runs[i] = time.Since(start)
			}
			slices.Sort(runs)
			b.ReportMetric(float64(runs[len(runs)/2].Microseconds())/1000, "ms")
		})
	}
}
