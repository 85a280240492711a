package kvfile

import (
	"bytes"
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"pdcluster.dev/pdcluster-operator/test/asuser"
)

func TestOpenSharesBlocksAndRejectsOtherLayouts(t *testing.T) {
	path := filepath.Join(t.TempDir(), "kv")
	a, err := Open(path, 4, 32)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := Open(path, 4, 32) // the agent opens what the engine created
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	data := bytes.Repeat([]byte{9}, 32)
	if err := a.Write(2, data); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 32)
	if err := b.Read(2, got); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read through the other handle: %v %v", got, err)
	}
	if err := a.Read(4, got); !errors.Is(err, ErrOutOfRange) {
		t.Errorf("read past the end: %v", err)
	}
	if err := a.Write(0, data[:5]); err == nil {
		t.Error("short write accepted")
	}
	if _, err := Open(path, 8, 32); err == nil || !strings.Contains(err.Error(), "want 256") {
		t.Errorf("other layout: %v", err)
	}
	if Checksum(data) == Checksum(got[:31]) {
		t.Error("checksum ignores length")
	}
}

// Blocks stay readable and writable after Close: a transfer still running when the agent stops
// must not fault.
func TestBlocksOutliveClose(t *testing.T) {
	kv, err := Open(filepath.Join(t.TempDir(), "kv"), 4, 64)
	if err != nil {
		t.Fatal(err)
	}
	b, err := kv.Block(2)
	if err != nil {
		t.Fatal(err)
	}
	if err := kv.Close(); err != nil {
		t.Fatal(err)
	}
	b[0] = 7 // would fault on an unmapped block
	if b[0] != 7 {
		t.Fatal("block not writable after Close")
	}
	if err := kv.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// The engine and the agent run as different users (the agent's image as 65532, an engine image
// usually as root with every capability dropped, so without CAP_DAC_OVERRIDE): the file one of
// them creates on the pod's shared volume must open read-write for the other.
func TestOpenByTheOtherContainersUser(t *testing.T) {
	dir := asuser.SharedDir(t)
	path := filepath.Join(dir, "kv")
	var created *File
	if err := asuser.Do(t, 65532, func() (err error) { created, err = Open(path, 4, 32); return err }); err != nil {
		t.Fatalf("create as the agent's user: %v", err)
	}
	defer created.Close()
	var opened *File
	if err := asuser.Do(t, asuser.Nobody, func() (err error) { opened, err = Open(path, 4, 32); return err }); err != nil {
		t.Fatalf("open as the engine's user: %v", err)
	}
	defer opened.Close()
	data := bytes.Repeat([]byte{7}, 32)
	if err := opened.Write(1, data); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 32)
	if err := created.Read(1, got); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("the creator reads %v, %v; want the other user's write", got, err)
	}
}
