// Package kvfile is the KV-cache memory an engine shares with its connector agent: a file of
// fixed-size blocks (on the pod's shared volume) that the engine fills and the agent reads from
// or writes into, as Mooncake's transfer engine does with registered GPU memory.
package kvfile

import (
	"errors"
	"fmt"
	"hash/crc32"
	"io/fs"
	"os"
	"syscall"
)

// File is an open KV-cache file, mapped into memory (shared with every other process that
// maps or writes it): the data plane sends a block straight from the mapping and receives
// into it, one copy each way, as RDMA reads registered memory in place. Reads and writes of
// distinct blocks are safe concurrently.
type File struct {
	f          *os.File
	mem        []byte
	blocks     int
	blockBytes int
}

// Open opens (creating and sizing it if needed) the KV file at path with blocks blocks of
// blockBytes bytes each. An existing file of another size is an error, not silently resized:
// it means the engine and the agent disagree on the layout.
func Open(path string, blocks, blockBytes int) (*File, error) {
	if blocks <= 0 || blockBytes <= 0 {
		return nil, fmt.Errorf("kvfile: blocks and block bytes must be positive, got %d and %d", blocks, blockBytes)
	}
	f, err := create(path)
	if err != nil {
		return nil, fmt.Errorf("kvfile: %w", err)
	}
	want := int64(blocks) * int64(blockBytes)
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("kvfile: %w", err)
	}
	switch st.Size() {
	case want:
	case 0:
		if err := f.Truncate(want); err != nil {
			f.Close()
			return nil, fmt.Errorf("kvfile: size %s: %w", path, err)
		}
	default:
		f.Close()
		return nil, fmt.Errorf("kvfile: %s has %d bytes, want %d (%d blocks of %d)", path, st.Size(), want, blocks, blockBytes)
	}
	mem, err := syscall.Mmap(int(f.Fd()), 0, int(want), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("kvfile: map %s: %w", path, err)
	}
	return &File{f: f, mem: mem, blocks: blocks, blockBytes: blockBytes}, nil
}

// ErrOutOfRange is returned for a block id outside the file.
var ErrOutOfRange = errors.New("block id out of range")

// BlockBytes is the size of one block.
func (k *File) BlockBytes() int { return k.blockBytes }

// Blocks is the number of blocks.
func (k *File) Blocks() int { return k.blocks }

func (k *File) offset(id int64) (int64, error) {
	if id < 0 || id >= int64(k.blocks) {
		return 0, fmt.Errorf("%w: %d of %d", ErrOutOfRange, id, k.blocks)
	}
	return id * int64(k.blockBytes), nil
}

// Block is block id itself, in the mapping: writes to it are the block's new contents. It is
// valid until Close.
func (k *File) Block(id int64) ([]byte, error) {
	off, err := k.offset(id)
	if err != nil {
		return nil, err
	}
	return k.mem[off : off+int64(k.blockBytes) : off+int64(k.blockBytes)], nil
}

// Read copies block id into buf, which must be BlockBytes long.
func (k *File) Read(id int64, buf []byte) error {
	b, err := k.Block(id)
	if err != nil {
		return err
	}
	if len(buf) != k.blockBytes {
		return fmt.Errorf("kvfile: read buffer of %d bytes, want %d", len(buf), k.blockBytes)
	}
	copy(buf, b)
	return nil
}

// Write stores data, BlockBytes long, as block id.
func (k *File) Write(id int64, data []byte) error {
	b, err := k.Block(id)
	if err != nil {
		return err
	}
	if len(data) != k.blockBytes {
		return fmt.Errorf("kvfile: write of %d bytes, want %d", len(data), k.blockBytes)
	}
	copy(b, data)
	return nil
}

// Close closes the file. The mapping stays until the process exits: a transfer still running
// when its agent stops (a pull's goroutine, a checksum over a block) must fail on its socket,
// not fault on memory unmapped under it.
func (k *File) Close() error {
	if k.f == nil {
		return nil
	}
	err := k.f.Close()
	k.f = nil
	return err
}

// Checksum is the CRC-32C every block carries on the wire.
func Checksum(data []byte) uint32 { return crc32.Checksum(data, castagnoli) }

// UpdateChecksum extends sum, the Checksum of the bytes before data, with data.
func UpdateChecksum(sum uint32, data []byte) uint32 { return crc32.Update(sum, castagnoli, data) }

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// create opens path read-write, creating it readable and writable by every user: the engine and
// the agent are containers of one pod that run as different users (an engine as root with
// every capability dropped cannot open another user's 0600 file), and the file lives on the
// pod's own volume, which no other pod mounts.
func create(path string) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o666)
	if errors.Is(err, fs.ErrExist) {
		return os.OpenFile(path, os.O_RDWR, 0)
	}
	if err != nil {
		return nil, err
	}
	// The umask took group and other write away.
	if err := f.Chmod(0o666); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}
