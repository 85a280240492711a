package agent

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer"
)

// maxConnsPerPeer bounds the data connections one remote address holds open at once: a
// consumer keeps a few per producer worker and opens more only for pulls in flight, so a peer
// past it is refused rather than allowed to take every descriptor.
const maxConnsPerPeer = 256

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
		host, _, _ := net.SplitHostPort(conn.RemoteAddr().String())
		if !a.peers.take(host) {
			a.metrics.peerConnsRefused.Inc()
			a.cfg.Log.V(1).Info("refused a data connection: too many from one peer", "remote", host, "max", maxConnsPerPeer)
			_ = conn.Close()
			continue
		}
		a.metrics.peerConns.Inc()
		go func() {
			defer a.peers.release(host)
			a.servePeer(ctx, conn)
		}()
	}
}

// peerCounts counts open data connections per remote address.
type peerCounts struct {
	mu sync.Mutex
	n  map[string]int
}

func (p *peerCounts) take(host string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.n == nil {
		p.n = map[string]int{}
	}
	if p.n[host] >= maxConnsPerPeer {
		return false
	}
	p.n[host]++
	return true
}

func (p *peerCounts) release(host string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.n[host]--; p.n[host] <= 0 {
		delete(p.n, host)
	}
}

// servePeer answers the pulls a consumer sends on conn, one after the other, until it closes
// the connection or leaves it idle for peerConnServeIdle.
func (a *Agent) servePeer(ctx context.Context, conn net.Conn) {
	defer conn.Close()
	stop := context.AfterFunc(ctx, func() { _ = conn.Close() }) // a kept connection ends with the agent
	defer stop()
	r, w := bufio.NewReader(conn), bufio.NewWriterSize(conn, 32<<10) // large blocks bypass it (writev)
	for first := true; ctx.Err() == nil; first = false {
		idle := peerConnServeIdle
		if first {
			idle = 30 * time.Second
		}
		_ = conn.SetReadDeadline(time.Now().Add(idle))
		kind, payload, err := readFrame(r, nil, maxPullFrame)
		if err != nil || kind != frameKindPull {
			if !first && err != nil {
				return // the consumer closed a kept connection, or left it idle
			}
			a.cfg.Log.V(1).Info("bad pull from peer", "remote", conn.RemoteAddr(), "err", err, "kind", kind)
			return
		}
		_ = conn.SetReadDeadline(time.Time{})
		if !a.servePull(ctx, conn, w, payload) {
			return
		}
	}
}

// servePull answers one pull: waits for prefill if needed, writes the blocks, sends the
// result. It returns whether the connection can carry another pull.
func (a *Agent) servePull(ctx context.Context, conn net.Conn, w *bufio.Writer, payload []byte) bool {
	var pf pullFrame
	if err := json.Unmarshal(payload, &pf); err != nil {
		return writeJSONFrame(w, frameKindResult, resultFrame{Code: "error", Error: "decode pull: " + err.Error()}) == nil
	}
	if pf.Engine != a.cfg.EngineID {
		return writeJSONFrame(w, frameKindResult, resultFrame{Code: "engine_mismatch", Error: fmt.Sprintf("this producer is %s, not %s", a.cfg.EngineID, pf.Engine)}) == nil
	}
	if pf.Blocks.HasLocal() && pf.BlockSize != a.cfg.KV.BlockBytes() {
		return writeJSONFrame(w, frameKindResult, resultFrame{Code: "error", Error: fmt.Sprintf("block size mismatch: producer %d bytes, consumer %d", a.cfg.KV.BlockBytes(), pf.BlockSize)}) == nil
	}
	// The fan-in is the decode pool's tensor parallelism, which this producer was told
	// (Config.Consumers): a pull that claims more consumer ranks would pin the transfer's
	// blocks until they all came, and one with a rank past them pulls another rank's share.
	if fanIn := max(pf.Consumers, 1); fanIn > a.cfg.Consumers || pf.Consumer < 0 || int(pf.Consumer) >= fanIn {
		return writeJSONFrame(w, frameKindResult, resultFrame{Code: "error", Error: fmt.Sprintf("consumer rank %d of %d: this producer serves %d consumer ranks", pf.Consumer, pf.Consumers, a.cfg.Consumers)}) == nil
	}
	req := kvtransfer.PullRequest{Transfer: pf.Transfer, Consumer: pf.Consumer, Consumers: max(pf.Consumers, 1), Blocks: pf.Blocks}
	a.metrics.pullsServed.Inc()
	d, ok := a.decide(ctx, req)
	if !ok {
		return false // the agent is stopping; the Producer's state goes with it
	}
	if d.Action == kvtransfer.ActionReject && errors.Is(d.Err, kvtransfer.ErrUnknownTransfer) {
		// Early: the decode engine's pull came before the prefill request reached this engine
		// (the concurrent flow). Wait for it here rather than send the consumer away to ask
		// again after a back-off.
		if d, ok = a.decideEarly(ctx, req, d); !ok {
			return false
		}
	}
	return a.execute(conn, w, d, pf.ChecksumTrailer) == nil
}

// decide asks the Producer about req, parking it until the prefill finishes if it must wait.
// It returns false when the agent stops first.
func (a *Agent) decide(ctx context.Context, req kvtransfer.PullRequest) (kvtransfer.Decision, bool) {
	k := waiterKey{req.Transfer, req.Consumer}
	ch := make(chan kvtransfer.Decision, 1)
	// Park before deciding, so a Ready racing with this pull finds the channel.
	a.mu.Lock()
	_, busy := a.waiters[k]
	if !busy {
		a.waiters[k] = ch
	}
	a.mu.Unlock()
	if busy {
		return kvtransfer.Decision{Pull: req, Action: kvtransfer.ActionReject, Err: kvtransfer.ErrDuplicatePull}, true
	}
	d := a.producer.Pull(req)
	if d.Action != kvtransfer.ActionWait {
		a.mu.Lock()
		delete(a.waiters, k)
		a.mu.Unlock()
		return d, true
	}
	select {
	case d = <-ch:
		return d, true
	case <-ctx.Done():
		return d, false
	}
}

// Early pulls wait this long at most for their prefill request, and at most this many at once
// (beyond, they are answered ErrUnknownTransfer at once and the consumer asks again).
const (
	earlyPullWait = 2 * time.Second
	maxEarlyPulls = 4096
)

// decideEarly waits for the Expect or Ready of an early pull's transfer, then decides again.
// unknown is the first decision, returned if nothing comes.
func (a *Agent) decideEarly(ctx context.Context, req kvtransfer.PullRequest, unknown kvtransfer.Decision) (kvtransfer.Decision, bool) {
	a.mu.Lock()
	ch, ok := a.early[req.Transfer]
	if !ok && len(a.early) < maxEarlyPulls {
		ch = make(chan struct{})
		a.early[req.Transfer] = ch
		ok = true
	}
	a.mu.Unlock()
	if !ok {
		return unknown, true
	}
	// Registered first, then asked again: an Expect between the first decision and the
	// registration is seen now; one after it closes ch.
	d, alive := a.decide(ctx, req)
	if !alive || d.Action != kvtransfer.ActionReject || !errors.Is(d.Err, kvtransfer.ErrUnknownTransfer) {
		return d, alive
	}
	a.metrics.earlyPulls.Inc()
	t := time.NewTimer(earlyPullWait)
	defer t.Stop()
	select {
	case <-ch:
	case <-t.C:
		a.mu.Lock()
		if a.early[req.Transfer] == ch {
			delete(a.early, req.Transfer)
		}
		a.mu.Unlock()
		return unknown, true
	case <-ctx.Done():
		return unknown, false
	}
	return a.decide(ctx, req)
}

// wakeEarly lets the early pulls of transfer decide again: its request reached the engine.
func (a *Agent) wakeEarly(transfer kvtransfer.TransferID) {
	a.mu.Lock()
	ch, ok := a.early[transfer]
	delete(a.early, transfer)
	a.mu.Unlock()
	if ok {
		close(ch)
	}
}

// execute carries out a send or reject decision on the consumer's connection.
func (a *Agent) execute(conn net.Conn, w *bufio.Writer, d kvtransfer.Decision, trailer bool) error {
	switch d.Action {
	case kvtransfer.ActionReject:
		return writeJSONFrame(w, frameKindResult, resultFrame{Code: codeOf(d.Err), Error: d.Err.Error()})
	case kvtransfer.ActionSend:
		err := a.send(conn, w, d.Copies, trailer)
		if err == nil {
			err = writeJSONFrame(w, frameKindResult, resultFrame{OK: true})
		}
		if err != nil {
			a.cfg.Log.Info("send to consumer failed", "transfer", d.Pull.Transfer, "consumer", d.Pull.Consumer, "err", err.Error())
		}
		// Served either way: a consumer whose send failed will not pull again (it fails its pull).
		a.producer.SendDone(d.Pull.Transfer, d.Pull.Consumer, d.Pull.Consumers, err)
		_ = conn.SetWriteDeadline(time.Time{})
		return err
	}
	return nil
}

// send writes each block straight from the KV mapping (no staging copy).
func (a *Agent) send(conn net.Conn, w *bufio.Writer, copies []kvtransfer.BlockCopy, trailer bool) error {
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
