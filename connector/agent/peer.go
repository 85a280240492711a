package agent

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"time"

	"pdcluster.dev/pdcluster-operator/connector"
)

// acceptPeers serves consumer connections until the listener closes.
func (a *Agent) acceptPeers(ctx context.Context, l net.Listener) {
	for {
		conn, err := l.Accept()
		if err != nil {
			if ctx.Err() == nil && !errors.Is(err, net.ErrClosed) {
				a.cfg.Log.Error(err, "accept peer")
			}
			return
		}
		go a.servePeer(ctx, conn)
	}
}

// servePeer answers one pull: waits for prefill if needed, writes the blocks, sends the result.
func (a *Agent) servePeer(ctx context.Context, conn net.Conn) {
	defer conn.Close()
	r, w := bufio.NewReader(conn), bufio.NewWriterSize(conn, 256<<10)
	_ = conn.SetReadDeadline(time.Now().Add(30 * time.Second))
	kind, payload, err := readFrame(r, nil)
	if err != nil || kind != frameKindPull {
		a.cfg.Log.V(1).Info("bad pull from peer", "remote", conn.RemoteAddr(), "err", err, "kind", kind)
		return
	}
	var pf pullFrame
	if err := json.Unmarshal(payload, &pf); err != nil {
		_ = writeJSONFrame(w, frameKindResult, resultFrame{Code: "error", Error: "decode pull: " + err.Error()})
		return
	}
	_ = conn.SetReadDeadline(time.Time{})
	if pf.Engine != a.cfg.EngineID {
		_ = writeJSONFrame(w, frameKindResult, resultFrame{Code: "engine_mismatch", Error: fmt.Sprintf("this producer is %s, not %s", a.cfg.EngineID, pf.Engine)})
		return
	}
	if pf.Blocks.HasLocal() && pf.BlockSize != a.cfg.KV.BlockBytes() {
		_ = writeJSONFrame(w, frameKindResult, resultFrame{Code: "error", Error: fmt.Sprintf("block size mismatch: producer %d bytes, consumer %d", a.cfg.KV.BlockBytes(), pf.BlockSize)})
		return
	}
	req := connector.PullRequest{Transfer: pf.Transfer, Consumer: pf.Consumer, Consumers: max(pf.Consumers, 1), Blocks: pf.Blocks}
	a.metrics.pullsServed.Inc()
	k := waiterKey{req.Transfer, req.Consumer}
	ch := make(chan connector.Decision, 1)
	// Park before deciding, so a Ready racing with this pull finds the channel.
	a.mu.Lock()
	_, busy := a.waiters[k]
	if !busy {
		a.waiters[k] = ch
	}
	a.mu.Unlock()
	if busy {
		_ = writeJSONFrame(w, frameKindResult, resultFrame{Code: "duplicate_pull", Error: connector.ErrDuplicatePull.Error()})
		return
	}
	d := a.producer.Pull(req)
	if d.Action != connector.ActionWait {
		a.mu.Lock()
		delete(a.waiters, k)
		a.mu.Unlock()
	} else {
		select {
		case d = <-ch:
		case <-ctx.Done():
			// The agent is stopping; the Producer's state goes with it.
			return
		}
	}
	a.execute(conn, w, d, pf.ChecksumTrailer)
}

// execute carries out a send or reject decision on the consumer's connection.
func (a *Agent) execute(conn net.Conn, w *bufio.Writer, d connector.Decision, trailer bool) {
	switch d.Action {
	case connector.ActionReject:
		_ = writeJSONFrame(w, frameKindResult, resultFrame{Code: codeOf(d.Err), Error: d.Err.Error()})
	case connector.ActionSend:
		err := a.send(conn, w, d.Copies, trailer)
		if err == nil {
			err = writeJSONFrame(w, frameKindResult, resultFrame{OK: true})
		}
		if err != nil {
			a.cfg.Log.Info("send to consumer failed", "transfer", d.Pull.Transfer, "consumer", d.Pull.Consumer, "err", err.Error())
		}
		// Served either way: a consumer whose send failed will not pull again (it fails its pull).
		a.producer.SendDone(d.Pull.Transfer, d.Pull.Consumer, d.Pull.Consumers, err)
	}
}

// send writes each block straight from the KV mapping (no staging copy).
func (a *Agent) send(conn net.Conn, w *bufio.Writer, copies []connector.BlockCopy, trailer bool) error {
	_ = conn.SetWriteDeadline(time.Now().Add(a.cfg.PullTimeoutOr(time.Minute)))
	for _, c := range copies {
		data, err := a.cfg.KV.Block(int64(c.Src))
		if err != nil {
			return fmt.Errorf("read block %d: %w", c.Src, err)
		}
		if a.cfg.SendDelay > 0 {
			if err := w.Flush(); err != nil {
				return err
			}
			time.Sleep(a.cfg.SendDelay)
		}
		if err := writeBlockFrame(w, conn, c.Group, c.Dst, data, trailer); err != nil {
			return err
		}
		a.metrics.bytesSent.Add(float64(len(data)))
	}
	return nil
}

// PullTimeoutOr is the pull timeout, or def when unset.
func (c Config) PullTimeoutOr(def time.Duration) time.Duration {
	if c.PullTimeout > 0 {
		return c.PullTimeout
	}
	return def
}
