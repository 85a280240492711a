// Package asuser runs test code with the file permissions of another user, as a container of
// the same pod that runs under another uid (or as root with every capability dropped) opens the
// files and sockets on their shared volume.
package asuser

import (
	"fmt"
	"os"
	"runtime"
	"syscall"
	"testing"
)

// Nobody is a uid and gid no image of this project runs as.
const Nobody = 65534

// Do runs fn on an OS thread of its own whose filesystem uid and gid are uid: the kernel checks
// every open, connect and stat of fn against them, and drops that thread's filesystem
// capabilities (CAP_DAC_OVERRIDE among them), as for root in a container with drop: [ALL].
// The thread is discarded afterwards. It needs root; without it the test is skipped.
func Do(t *testing.T, uid int, fn func() error) error {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to take another user's file permissions")
	}
	done := make(chan error, 1)
	go func() {
		// Never unlocked: the goroutine's end takes the thread, and its credentials, with it.
		runtime.LockOSThread()
		// setfsuid and setfsgid return the previous id, never an error: asking again tells
		// whether the first call took.
		for _, call := range []uintptr{syscall.SYS_SETFSGID, syscall.SYS_SETFSUID} {
			_, _, _ = syscall.RawSyscall(call, uintptr(uid), 0, 0)
			if got, _, _ := syscall.RawSyscall(call, uintptr(uid), 0, 0); int(got) != uid {
				done <- fmt.Errorf("asuser: filesystem id %d, want %d", got, uid)
				return
			}
		}
		done <- fn()
	}()
	return <-done
}

// SharedDir is a new directory every user can write, as an emptyDir volume is (t.TempDir's is
// reachable by its owner only); it is removed when the test ends.
func SharedDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "shared-")
	if err == nil {
		err = os.Chmod(dir, 0o777)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	return dir
}
