package agent

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"

	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer/kvfile"
)

// The peer protocol between a consumer agent and a producer agent, one TCP connection per
// (pull, producer worker): the consumer sends a pullFrame; the producer answers with zero or
// more block frames and one result frame. A frame is a type byte, a big-endian uint32 length,
// and the payload.
const (
	frameKindPull   byte = 'P'
	frameKindBlock  byte = 'B'
	frameKindResult byte = 'R'
	// frameKindBlockTrailer is a block whose checksum follows its bytes: the producer sums
	// each chunk while it is in cache, right before the kernel copies it to the socket, instead
	// of reading the whole block from memory once more first. Sent only to consumers that say
	// they read it (pullFrame.ChecksumTrailer), so agents of both versions pull from each other
	// during a rollout.
	frameKindBlockTrailer byte = 'T'
)

// chunkBytes is how much of a block is summed and copied at a time: small enough to stay in
// cache between the checksum and the copy.
const chunkBytes = 128 << 10

// maxFrame bounds a frame so a corrupt length cannot make a peer allocate without limit. A
// block frame's bytes go straight into the destination block (its size must be the block's);
// the JSON frames have bounds of their own, and their buffers grow as bytes arrive, so a
// header that claims a large frame costs nothing until the bytes come.
const (
	maxFrame       = 64 << 20
	maxPullFrame   = 4 << 20  // thousands of block ids per KV group
	maxResultFrame = 64 << 10 // an error message
)

// pullFrame is Mooncake's MooncakeXferMetadata reduced to one request: which transfer, which
// consumer rank out of how many, and the destination blocks per KV group.
type pullFrame struct {
	Transfer  kvtransfer.TransferID   `json:"transfer_id"`
	Request   kvtransfer.RequestID    `json:"request_id"`
	Engine    string                  `json:"remote_engine_id"`
	Consumer  kvtransfer.ConsumerRank `json:"consumer_rank"`
	Consumers int                     `json:"consumers"`
	Blocks    kvtransfer.BlockIDs     `json:"blocks"`
	BlockSize int                     `json:"block_bytes"`
	// ChecksumTrailer: the consumer reads frameKindBlockTrailer frames.
	ChecksumTrailer bool `json:"checksum_trailer,omitempty"`
	// Format is the consumer's KV format (Config.KVFormat).
	Format string `json:"kv_format,omitempty"`
}

// resultFrame ends a pull: OK, or the producer's error with a code the consumer maps back.
type resultFrame struct {
	OK    bool   `json:"ok"`
	Code  string `json:"code,omitempty"`
	Error string `json:"error,omitempty"`
}

// blockHeader precedes a block's bytes: group, destination block, CRC-32C of the data (the
// checksum comes after the bytes instead in a frameKindBlockTrailer frame).
const (
	blockHeader        = 4 + 8 + 4
	blockTrailerHeader = 4 + 8
	blockTrailer       = 4
)

var errCodes = map[string]error{
	"unknown_transfer": kvtransfer.ErrUnknownTransfer,
	"released":         kvtransfer.ErrReleased,
	"aborted":          kvtransfer.ErrAborted,
	"duplicate_pull":   kvtransfer.ErrDuplicatePull,
	"block_mismatch":   kvtransfer.ErrBlockMismatch,
	"group_mismatch":   kvtransfer.ErrGroupMismatch,
	"timeout":          kvtransfer.ErrTimeout,
	"engine_mismatch":  ErrEngineMismatch,
}

// ErrEngineMismatch: the pull named an engine id the producer does not have (it restarted).
var ErrEngineMismatch = errors.New("remote engine id not found")

// ErrChecksum: a block arrived with a CRC that does not match its bytes.
var ErrChecksum = errors.New("block checksum mismatch")

func codeOf(err error) string {
	for code, e := range errCodes {
		if errors.Is(err, e) {
			return code
		}
	}
	return "error"
}

func errorOf(r resultFrame) error {
	if r.OK {
		return nil
	}
	if e, ok := errCodes[r.Code]; ok {
		return fmt.Errorf("producer: %w (%s)", e, r.Error)
	}
	return fmt.Errorf("producer: %s", r.Error)
}

func writeFrame(w *bufio.Writer, kind byte, payload []byte) error {
	var hdr [5]byte
	hdr[0] = kind
	binary.BigEndian.PutUint32(hdr[1:], uint32(len(payload)))
	if _, err := w.Write(hdr[:]); err != nil {
		return err
	}
	_, err := w.Write(payload)
	return err
}

func writeJSONFrame(w *bufio.Writer, kind byte, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	if err := writeFrame(w, kind, b); err != nil {
		return err
	}
	return w.Flush()
}

// writeBlockFrame sends one block with its checksum, in a frameKindBlockTrailer frame when
// trailer is set. A block smaller than w's buffer goes through it (the caller flushes); a
// larger one is written straight from data (the KV mapping) with one writev per chunk, the
// header with the first, so it is copied once, by the kernel. In a trailer frame each chunk is
// summed right after the kernel copied it, so it is read from cache (summing the mapping before
// sending cost more than the copy), and a block the engine changed while it was sent fails the
// consumer's check, as it should; a header frame, for consumers of the previous version, needs
// the sum first.
func writeBlockFrame(w *bufio.Writer, conn io.Writer, group int, dst kvtransfer.BlockID, data []byte, trailer bool) error {
	var hdr [5 + blockHeader]byte
	head := hdr[:]
	hdr[0] = frameKindBlock
	binary.BigEndian.PutUint32(hdr[1:], uint32(blockHeader+len(data)))
	if trailer {
		head = hdr[:5+blockTrailerHeader]
		hdr[0] = frameKindBlockTrailer
		binary.BigEndian.PutUint32(hdr[1:], uint32(blockTrailerHeader+len(data)+blockTrailer))
	}
	binary.BigEndian.PutUint32(hdr[5:], uint32(group))
	binary.BigEndian.PutUint64(hdr[9:], uint64(dst))
	if !trailer {
		binary.BigEndian.PutUint32(hdr[17:], kvfile.Checksum(data))
	}
	var sum uint32
	if len(data) < w.Size() {
		_, _ = w.Write(head)
		if _, err := w.Write(data); err != nil {
			return err
		}
		if trailer {
			sum = kvfile.Checksum(data)
		}
	} else {
		if err := w.Flush(); err != nil {
			return err
		}
		var parts [2][]byte
		for off := 0; off < len(data); off += chunkBytes {
			chunk := data[off:min(off+chunkBytes, len(data))]
			bufs := net.Buffers(parts[:0])
			if off == 0 {
				bufs = append(bufs, head)
			}
			bufs = append(bufs, chunk)
			if _, err := bufs.WriteTo(conn); err != nil {
				return err
			}
			if trailer {
				sum = kvfile.UpdateChecksum(sum, chunk)
			}
		}
	}
	if !trailer {
		return nil
	}
	var tr [blockTrailer]byte
	binary.BigEndian.PutUint32(tr[:], sum)
	_, err := w.Write(tr[:]) // goes out with the next frame's bytes
	return err
}

// readFrameHeader reads a frame's kind and payload length.
func readFrameHeader(r *bufio.Reader) (byte, uint32, error) {
	var hdr [5]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return 0, 0, err
	}
	n := binary.BigEndian.Uint32(hdr[1:])
	if n > maxFrame {
		return 0, 0, fmt.Errorf("frame of %d bytes exceeds %d", n, maxFrame)
	}
	return hdr[0], n, nil
}

// readPayload reads a frame's payload of n bytes (at most limit) into buf, grown as the bytes
// arrive rather than by what the header claims.
func readPayload(r *bufio.Reader, n uint32, buf []byte, limit int) ([]byte, error) {
	if int(n) > limit {
		return nil, fmt.Errorf("frame of %d bytes exceeds %d", n, limit)
	}
	buf = buf[:0]
	for len(buf) < int(n) {
		if len(buf) == cap(buf) {
			buf = slices.Grow(buf, min(int(n)-len(buf), max(cap(buf), 4<<10)))
		}
		m, err := r.Read(buf[len(buf):min(int(n), cap(buf))])
		buf = buf[:len(buf)+m]
		if err != nil && len(buf) < int(n) {
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			return nil, err
		}
	}
	return buf, nil
}

// readFrame reads one frame of at most limit bytes into buf (grown as its bytes arrive) and
// returns its kind and payload.
func readFrame(r *bufio.Reader, buf []byte, limit int) (byte, []byte, error) {
	kind, n, err := readFrameHeader(r)
	if err != nil {
		return 0, nil, err
	}
	p, err := readPayload(r, n, buf, limit)
	return kind, p, err
}

// blockFrame is a block frame's header; its size bytes of data follow on the wire, then its
// checksum when trailer is set.
type blockFrame struct {
	group   int
	dst     kvtransfer.BlockID
	sum     uint32
	size    int
	trailer bool
}

// readBlockHeader reads the header of a block frame (either kind) of n payload bytes, leaving
// its data unread, so the caller can read it straight into the destination block.
func readBlockHeader(r *bufio.Reader, kind byte, n uint32) (blockFrame, error) {
	head, tail := blockHeader, 0
	if kind == frameKindBlockTrailer {
		head, tail = blockTrailerHeader, blockTrailer
	}
	if n < uint32(head+tail) {
		return blockFrame{}, fmt.Errorf("block frame of %d bytes is too short", n)
	}
	var p [blockHeader]byte
	if _, err := io.ReadFull(r, p[:head]); err != nil {
		return blockFrame{}, err
	}
	f := blockFrame{
		group:   int(binary.BigEndian.Uint32(p[:])),
		dst:     kvtransfer.BlockID(binary.BigEndian.Uint64(p[4:])),
		size:    int(n) - head - tail,
		trailer: tail > 0,
	}
	if !f.trailer {
		f.sum = binary.BigEndian.Uint32(p[12:])
	}
	return f, nil
}

// readBlockData reads the frame's data into into (size bytes), a chunk at a time, summing
// each chunk while it is in cache, then checks the checksum. A read error is returned as is;
// a checksum mismatch as ErrChecksum.
func readBlockData(r *bufio.Reader, f blockFrame, into []byte) (readErr, err error) {
	var sum uint32
	for off := 0; off < len(into); off += chunkBytes {
		chunk := into[off:min(off+chunkBytes, len(into))]
		if _, err := io.ReadFull(r, chunk); err != nil {
			return err, nil
		}
		sum = kvfile.UpdateChecksum(sum, chunk)
	}
	want := f.sum
	if f.trailer {
		var tr [blockTrailer]byte
		if _, err := io.ReadFull(r, tr[:]); err != nil {
			return err, nil
		}
		want = binary.BigEndian.Uint32(tr[:])
	}
	if sum != want {
		return nil, fmt.Errorf("%w: block %d of group %d", ErrChecksum, f.dst, f.group)
	}
	return nil, nil
}
