package main

import (
	"bytes"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// `connector install DEST` copies the running binary whole and executable; the copy runs.
func TestInstallCopiesItself(t *testing.T) {
	dest := filepath.Join(t.TempDir(), "connector")
	var stderr bytes.Buffer
	if code := installMain([]string{dest}, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	want, _ := os.ReadFile(self)
	got, err := os.ReadFile(dest)
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("installed %d bytes (%v), want the %d of %s", len(got), err, len(want), self)
	}
	if fi, _ := os.Stat(dest); fi.Mode().Perm() != 0o755 {
		t.Errorf("mode %v, want 0755", fi.Mode().Perm())
	}
	// The copy is this test binary: it runs (and lists its tests).
	if out, err := exec.Command(dest, "-test.list", "TestInstallCopiesItself").Output(); err != nil || !strings.Contains(string(out), "TestInstallCopiesItself") {
		t.Errorf("the copy does not run: %v %q", err, out)
	}
	entries, _ := os.ReadDir(filepath.Dir(dest))
	if len(entries) != 1 {
		t.Errorf("left %d files beside the copy, want none", len(entries)-1)
	}
	for _, args := range [][]string{nil, {"a", "b"}, {"--to=x"}} {
		if code := installMain(args, io.Discard); code != 2 {
			t.Errorf("install %q exits %d, want 2", args, code)
		}
	}
	if code := installMain([]string{filepath.Join(t.TempDir(), "missing", "connector")}, io.Discard); code != 1 {
		t.Errorf("install into a missing directory exits %d, want 1", code)
	}
}
