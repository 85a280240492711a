package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"pdcluster.dev/pdcluster-operator/internal/bootstrap"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer/agentapi"
)

// startPull begins meta's pull: it resolves the producer workers through the bootstrap
// registry and starts one task per worker. A pull whose producers cannot be found still
// begins, with no task, so it ends at once as failed and is reported like any failure.
func (c *Consumer) startPull(ctx context.Context, meta kvtransfer.PullMeta) error {
	workers, err := c.resolve(ctx, meta)
	if err != nil {
		c.cfg.Log.Info("pull has no producer", "request", meta.Request, "transfer", meta.Transfer, "err", err.Error())
		workers = nil
	}
	ranks := slices.Sorted(maps.Keys(workers))
	if err := c.core.Begin(meta, ranks); err != nil {
		return err
	}
	c.metrics.pullsStarted(meta)
	deadline, _ := c.core.Deadline(meta.Request)
	for _, r := range ranks {
		go c.runTask(meta, r, workers[r], deadline)
	}
	return nil
}

// resolve maps meta's remote engine to its workers' data addresses, by producer rank
// (tp rank × pp size + pp rank). A cached topology without the engine is refreshed once: the
// producer may have restarted under a new id.
func (c *Consumer) resolve(ctx context.Context, meta kvtransfer.PullMeta) (map[kvtransfer.ProducerRank]string, error) {
	if meta.RemoteBootstrap == "" || meta.RemoteEngine == "" {
		return nil, errors.New("pull lacks remote_bootstrap_addr or remote_engine_id")
	}
	var eng bootstrap.Engine
	for attempt := 0; ; attempt++ {
		topo, err := c.boot.Query(ctx, meta.RemoteBootstrap)
		if err != nil {
			return nil, err
		}
		var ok bool
		if _, eng, ok = topo.Find(meta.RemoteEngine); ok {
			break
		}
		c.boot.Invalidate(meta.RemoteBootstrap)
		if attempt > 0 {
			return nil, fmt.Errorf("%w: %s at %s", ErrEngineMismatch, meta.RemoteEngine, meta.RemoteBootstrap)
		}
	}
	ppSize := 0
	for _, pps := range eng.WorkerAddr {
		ppSize = max(ppSize, len(pps))
	}
	out := map[kvtransfer.ProducerRank]string{}
	for tpS, pps := range eng.WorkerAddr {
		for ppS, addr := range pps {
			tp, err1 := strconv.Atoi(tpS)
			pp, err2 := strconv.Atoi(ppS)
			if err1 != nil || err2 != nil {
				return nil, fmt.Errorf("bad worker rank %s/%s in bootstrap answer", tpS, ppS)
			}
			out[kvtransfer.ProducerRank(tp*ppSize+pp)] = strings.TrimPrefix(addr, "tcp://")
		}
	}
	return out, nil
}

// runTask pulls from one producer worker and ends the task exactly once.
func (c *Consumer) runTask(meta kvtransfer.PullMeta, rank kvtransfer.ProducerRank, addr string, deadline time.Time) {
	err := c.pullFrom(meta, rank, addr, deadline)
	// In the concurrent flow the pull can reach the producer before the prefill request does:
	// the producer keeps no placeholder for a transfer it never heard of (bounded state), so
	// the consumer asks again for a short grace period.
	grace := time.Now().Add(c.cfg.UnknownTransferGrace)
	for backoff := 5 * time.Millisecond; errors.Is(err, kvtransfer.ErrUnknownTransfer) && time.Now().Add(backoff).Before(grace) && time.Now().Add(backoff).Before(deadline); backoff = min(backoff*2, 250*time.Millisecond) {
		time.Sleep(backoff)
		err = c.pullFrom(meta, rank, addr, deadline)
	}
	if err != nil && (errors.Is(err, ErrEngineMismatch) || errors.Is(err, kvtransfer.ErrPeerGone)) {
		c.boot.Invalidate(meta.RemoteBootstrap) // the producer restarted or moved
	}
	c.core.TaskDone(meta.Request, meta.Transfer, rank, err)
	if c.cfg.UngatedCompletions && err == nil && !meta.NotifiesScheduler() && c.core.PendingTasks(meta.Request) == 0 {
		// The seed bug, on purpose: a drained notify-only pull reported as finished receiving.
		c.events.push(&agentapi.Completion{Request: meta.Request}, nil)
	}
}

func (c *Consumer) pullFrom(meta kvtransfer.PullMeta, rank kvtransfer.ProducerRank, addr string, deadline time.Time) error {
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	pf := pullFrame{
		Transfer: meta.Transfer, Request: meta.Request, Engine: meta.RemoteEngine,
		Consumer: c.cfg.Rank, Consumers: c.cfg.Consumers, Blocks: meta.LocalBlock, BlockSize: c.cfg.KV.BlockBytes(),
		ChecksumTrailer: true, Format: c.cfg.KVFormat,
	}
	conn, err := c.conns.get(ctx, &c.dialer, addr)
	var clean bool
	for {
		if err != nil {
			return fmt.Errorf("%w: dial %s: %v", kvtransfer.ErrPeerGone, addr, err)
		}
		clean, err = c.pullOn(conn, meta, rank, addr, deadline, pf)
		if err == nil || !conn.reused || !errors.Is(err, errStaleConn) {
			break
		}
		// A kept connection the producer had closed (idle, or a producer of the previous
		// version, which serves one pull per connection): it took nothing, so ask on a new one
		// (a dialed connection is not reused: this happens once).
		_ = conn.Close()
		conn, err = c.conns.dial(ctx, &c.dialer, addr)
	}
	if clean {
		c.conns.put(addr, conn)
	} else {
		_ = conn.Close()
	}
	if errors.Is(err, errStaleConn) {
		err = fmt.Errorf("%w: %s closed the connection: %v", kvtransfer.ErrPeerGone, addr, err)
	}
	return err
}

// errStaleConn marks a connection that failed before the producer answered anything.
var errStaleConn = errors.New("connection closed before any answer")

// pullOn runs one pull on conn. clean is true when it ended with the producer's result frame
// read, so conn can carry another pull.
func (c *Consumer) pullOn(conn *peerConn, meta kvtransfer.PullMeta, rank kvtransfer.ProducerRank, addr string, deadline time.Time, pf pullFrame) (clean bool, err error) {
	_ = conn.SetDeadline(deadline)
	r, w := conn.r, conn.w
	if err := writeJSONFrame(w, frameKindPull, pf); err != nil {
		return false, fmt.Errorf("%w: send pull: %v", errStaleConn, err)
	}
	answered := false
	want := map[kvtransfer.BlockID]bool{}
	for _, id := range meta.LocalBlock.Flatten() {
		want[id] = true
	}
	written := 0
	var first time.Time // the first block's arrival: the transfer, not the wait for prefill
	peerErr := func(err error) error {
		if ne, ok := errors.AsType[net.Error](err); ok && ne.Timeout() {
			return fmt.Errorf("%w: waiting for producer %s", kvtransfer.ErrTimeout, addr)
		}
		return fmt.Errorf("%w: %s: %v", kvtransfer.ErrPeerGone, addr, err)
	}
	for {
		kind, n, err := readFrameHeader(r)
		if err != nil {
			if !answered && (errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET)) {
				return false, fmt.Errorf("%w: %v", errStaleConn, err)
			}
			return false, peerErr(err)
		}
		answered = true
		switch kind {
		case frameKindBlock, frameKindBlockTrailer:
			f, err := readBlockHeader(r, kind, n)
			if err != nil {
				return false, peerErr(err)
			}
			if first.IsZero() {
				first = time.Now()
			}
			if !want[f.dst] {
				return false, fmt.Errorf("producer wrote block %d, which the pull did not ask for", f.dst)
			}
			if f.size != c.cfg.KV.BlockBytes() {
				return false, fmt.Errorf("producer sent block %d of %d bytes, want %d", f.dst, f.size, c.cfg.KV.BlockBytes())
			}
			block, err := c.cfg.KV.Block(int64(f.dst))
			if err != nil {
				return false, fmt.Errorf("write block %d: %w", f.dst, err)
			}
			// The bytes go from the socket straight into the destination block, only while the
			// task is pending. A block that fails its checksum has landed, but the task fails, so
			// the pull reports its blocks invalid (or reports nothing, having none).
			var readErr error
			accepted, err := c.core.WriteIfAccepted(meta.Request, meta.Transfer, rank, func() (err error) {
				readErr, err = readBlockData(r, f, block)
				return err
			})
			if readErr != nil {
				return false, peerErr(readErr)
			}
			if err != nil {
				return false, err
			}
			if !accepted {
				return false, nil // the task already ended (timeout); TaskDone will be ignored
			}
			delete(want, f.dst)
			written++
			c.metrics.bytesReceived.Add(float64(len(block)))
		case frameKindResult:
			payload, err := readPayload(r, n, nil, maxResultFrame)
			if err != nil {
				return false, peerErr(err)
			}
			var res resultFrame
			if err := json.Unmarshal(payload, &res); err != nil {
				return false, fmt.Errorf("decode result: %w", err)
			}
			if err := errorOf(res); err != nil {
				return true, err
			}
			if len(want) > 0 {
				return true, fmt.Errorf("producer finished after %d blocks, %d missing", written, len(want))
			}
			if written > 0 && c.cfg.OnTransfer != nil {
				c.cfg.OnTransfer(time.Since(first), written*c.cfg.KV.BlockBytes())
			}
			return true, nil
		default:
			return false, fmt.Errorf("unexpected frame %q from producer", kind)
		}
	}
}
