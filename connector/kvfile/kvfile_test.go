package kvfile

import (
	"bytes"
	"errors"
	"path/filepath"
	"strings"
	"testing"
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
