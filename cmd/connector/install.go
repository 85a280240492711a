package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// installMain is `connector install DEST`: it copies this executable to DEST, for the init
// container of a pod whose replica spans pods. The engine container runs the engine's image,
// which has no connector: it runs `connector launch` from the volume both mount.
func installMain(args []string, stderr io.Writer) int {
	if len(args) != 1 || args[0] == "" || args[0][0] == '-' {
		fmt.Fprintln(stderr, "usage: connector install DEST (the path to copy this executable to)")
		return 2
	}
	self, err := os.Executable()
	if err == nil {
		err = install(self, args[0])
	}
	if err != nil {
		fmt.Fprintln(stderr, "connector install:", err)
		return 1
	}
	return 0
}

// install copies the executable src to dest (mode 0755) through a temporary file in dest's
// directory, so that dest is either absent or whole.
func install(src, dest string) (err error) {
	in, err := os.Open(src)
	if err != nil {
		return fmt.Errorf("open %s: %w", src, err)
	}
	defer in.Close()
	tmp, err := os.CreateTemp(filepath.Dir(dest), ".install-*")
	if err != nil {
		return fmt.Errorf("install to %s: %w", dest, err)
	}
	defer func() {
		if err != nil {
			_ = os.Remove(tmp.Name())
		}
	}()
	if _, err := io.Copy(tmp, in); err != nil {
		return errors.Join(fmt.Errorf("copy %s to %s: %w", src, dest, err), tmp.Close())
	}
	if err := tmp.Chmod(0o755); err != nil {
		return errors.Join(fmt.Errorf("chmod %s: %w", tmp.Name(), err), tmp.Close())
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("write %s: %w", tmp.Name(), err)
	}
	if err := os.Rename(tmp.Name(), dest); err != nil {
		return fmt.Errorf("install to %s: %w", dest, err)
	}
	return nil
}
