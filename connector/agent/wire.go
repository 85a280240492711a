package agent

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"

	"pdcluster.dev/pdcluster-operator/connector"
	"pdcluster.dev/pdcluster-operator/connector/kvfile"
)

// The peer protocol between a consumer agent and a producer agent, one TCP connection per
// (pull, producer worker): the consumer sends a pullFrame; the producer answers with zero or
// more block frames and one result frame. A frame is a type byte, a big-endian uint32 length,
// and the payload.
const (
	frameKindPull   byte = 'P'
	frameKindBlock  byte = 'B'
	frameKindResult byte = 'R'
)

// maxFrame bounds a frame so a corrupt length cannot make a peer allocate without limit.
const maxFrame = 64 << 20

// pullFrame is Mooncake's MooncakeXferMetadata reduced to one request: which transfer, which
// consumer rank out of how many, and the destination blocks per KV group.
type pullFrame struct {
	Transfer  connector.TransferID   `json:"transfer_id"`
	Request   connector.RequestID    `json:"request_id"`
	Engine    string                 `json:"remote_engine_id"`
	Consumer  connector.ConsumerRank `json:"consumer_rank"`
	Consumers int                    `json:"consumers"`
	Blocks    connector.BlockIDs     `json:"blocks"`
	BlockSize int                    `json:"block_bytes"`
}

// resultFrame ends a pull: OK, or the producer's error with a code the consumer maps back.
type resultFrame struct {
	OK    bool   `json:"ok"`
	Code  string `json:"code,omitempty"`
	Error string `json:"error,omitempty"`
}

// blockHeader precedes a block's bytes: group, destination block, CRC-32C of the data.
const blockHeader = 4 + 8 + 4

var errCodes = map[string]error{
	"unknown_transfer": connector.ErrUnknownTransfer,
	"released":         connector.ErrReleased,
	"aborted":          connector.ErrAborted,
	"duplicate_pull":   connector.ErrDuplicatePull,
	"block_mismatch":   connector.ErrBlockMismatch,
	"group_mismatch":   connector.ErrGroupMismatch,
	"timeout":          connector.ErrTimeout,
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

// writeBlockFrame sends one block with its checksum; the caller flushes.
func writeBlockFrame(w *bufio.Writer, group int, dst connector.BlockID, data []byte) error {
	var hdr [5 + blockHeader]byte
	hdr[0] = frameKindBlock
	binary.BigEndian.PutUint32(hdr[1:], uint32(blockHeader+len(data)))
	binary.BigEndian.PutUint32(hdr[5:], uint32(group))
	binary.BigEndian.PutUint64(hdr[9:], uint64(dst))
	binary.BigEndian.PutUint32(hdr[17:], kvfile.Checksum(data))
	if _, err := w.Write(hdr[:]); err != nil {
		return err
	}
	_, err := w.Write(data)
	return err
}

// readFrame reads one frame into buf (grown as needed) and returns its kind and payload.
func readFrame(r *bufio.Reader, buf []byte) (byte, []byte, error) {
	var hdr [5]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return 0, nil, err
	}
	n := binary.BigEndian.Uint32(hdr[1:])
	if n > maxFrame {
		return 0, nil, fmt.Errorf("frame of %d bytes exceeds %d", n, maxFrame)
	}
	if cap(buf) < int(n) {
		buf = make([]byte, n)
	}
	buf = buf[:n]
	if _, err := io.ReadFull(r, buf); err != nil {
		return 0, nil, err
	}
	return hdr[0], buf, nil
}

// parseBlock splits a block frame's payload and verifies its checksum.
func parseBlock(p []byte) (group int, dst connector.BlockID, data []byte, err error) {
	if len(p) < blockHeader {
		return 0, 0, nil, fmt.Errorf("block frame of %d bytes is too short", len(p))
	}
	group = int(binary.BigEndian.Uint32(p))
	dst = connector.BlockID(binary.BigEndian.Uint64(p[4:]))
	sum := binary.BigEndian.Uint32(p[12:])
	data = p[blockHeader:]
	if kvfile.Checksum(data) != sum {
		return 0, 0, nil, fmt.Errorf("%w: block %d of group %d", ErrChecksum, dst, group)
	}
	return group, dst, data, nil
}
