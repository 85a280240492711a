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
func (p *Producer) acceptPeers(ctx context.Context, l net.Listener) {
	for {
		conn, err := l.Accept()
		if err != nil {
			if ctx.Err() == nil && !errors.Is(err, net.ErrClosed) {
				p.cfg.Log.Error(err, "accept peer")
			}
			return
		}
		host, _, _ := net.SplitHostPort(conn.RemoteAddr().String())
		if !p.peers.take(host) {
			p.metrics.peerConnsRefused.Inc()
			p.cfg.Log.V(1).Info("refused a data connection: too many from one peer", "remote", host, "max", maxConnsPerPeer)
			_ = conn.Close()
			continue
		}
		p.metrics.peerConns.Inc()
		go func() {
			defer p.peers.release(host)
			p.servePeer(ctx, conn)
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
func (p *Producer) servePeer(ctx context.Context, conn net.Conn) {
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
			p.cfg.Log.V(1).Info("bad pull from peer", "remote", conn.RemoteAddr(), "err", err, "kind", kind)
			return
		}
		_ = conn.SetReadDeadline(time.Time{})
		if !p.servePull(ctx, conn, w, payload) {
			return
		}
	}
}

// servePull answers one pull: waits for prefill if needed, writes the blocks, sends the
// result. It returns whether the connection can carry another pull.
func (p *Producer) servePull(ctx context.Context, conn net.Conn, w *bufio.Writer, payload []byte) bool {
	var pf pullFrame
	if err := json.Unmarshal(payload, &pf); err != nil {
		return writeJSONFrame(w, frameKindResult, resultFrame{Code: "error", Error: "decode pull: " + err.Error()}) == nil
	}
	if pf.Engine != p.cfg.EngineID {
		return writeJSONFrame(w, frameKindResult, resultFrame{Code: "engine_mismatch", Error: fmt.Sprintf("this producer is %s, not %s", p.cfg.EngineID, pf.Engine)}) == nil
	}
	if pf.Format != "" && p.cfg.KVFormat != "" && pf.Format != p.cfg.KVFormat {
		// Engines of two KV revisions paired: the bytes would read as KV and decode would
		// continue from another model's (or layout's) cache. Refused, and said loudly.
		p.metrics.formatMismatches.Inc()
		p.cfg.Log.Error(nil, "KV format mismatch: refused a pull across KV formats", "producer", p.cfg.KVFormat, "consumer", pf.Format, "request", pf.Request)
		return writeJSONFrame(w, frameKindResult, resultFrame{Code: "error", Error: fmt.Sprintf("KV format mismatch: this producer's KV is format %s, the consumer reads format %s (engines of different KV revisions paired)", p.cfg.KVFormat, pf.Format)}) == nil
	}
	if pf.Blocks.HasLocal() && pf.BlockSize != p.cfg.KV.BlockBytes() {
		return writeJSONFrame(w, frameKindResult, resultFrame{Code: "error", Error: fmt.Sprintf("block size mismatch: producer %d bytes, consumer %d", p.cfg.KV.BlockBytes(), pf.BlockSize)}) == nil
	}
	// The fan-in is the decode pool's tensor parallelism, which this producer was told
	// (Config.Consumers): a pull that claims more consumer ranks would pin the transfer's
	// blocks until they all came, and one with a rank past them pulls another rank's share.
	if fanIn := max(pf.Consumers, 1); fanIn > p.cfg.Consumers || pf.Consumer < 0 || int(pf.Consumer) >= fanIn {
		return writeJSONFrame(w, frameKindResult, resultFrame{Code: "error", Error: fmt.Sprintf("consumer rank %d of %d: this producer serves %d consumer ranks", pf.Consumer, pf.Consumers, p.cfg.Consumers)}) == nil
	}
	req := kvtransfer.PullRequest{Transfer: pf.Transfer, Consumer: pf.Consumer, Consumers: max(pf.Consumers, 1), Blocks: pf.Blocks}
	p.metrics.pullsServed.Inc()
	d, ok := p.decide(ctx, req)
	if !ok {
		return false // the agent is stopping; the Producer's state goes with it
	}
	if d.Action == kvtransfer.ActionReject && errors.Is(d.Err, kvtransfer.ErrUnknownTransfer) {
		// Early: the decode engine's pull came before the prefill request reached this engine
		// (the concurrent flow). Wait for it here rather than send the consumer away to ask
		// again after a back-off.
		if d, ok = p.decideEarly(ctx, req, d); !ok {
			return false
		}
	}
	return p.execute(conn, w, d, pf.ChecksumTrailer) == nil
}

// decide asks the Producer about req, parking it until the prefill finishes if it must wait.
// It returns false when the agent stops first.
func (p *Producer) decide(ctx context.Context, req kvtransfer.PullRequest) (kvtransfer.Decision, bool) {
	k := waiterKey{req.Transfer, req.Consumer}
	ch := make(chan kvtransfer.Decision, 1)
	// Park before deciding, so a Ready racing with this pull finds the channel.
	p.mu.Lock()
	_, busy := p.waiters[k]
	if !busy {
		p.waiters[k] = ch
	}
	p.mu.Unlock()
	if busy {
		return kvtransfer.Decision{Pull: req, Action: kvtransfer.ActionReject, Err: kvtransfer.ErrDuplicatePull}, true
	}
	d := p.core.Pull(req)
	if d.Action != kvtransfer.ActionWait {
		p.mu.Lock()
		delete(p.waiters, k)
		p.mu.Unlock()
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
func (p *Producer) decideEarly(ctx context.Context, req kvtransfer.PullRequest, unknown kvtransfer.Decision) (kvtransfer.Decision, bool) {
	p.mu.Lock()
	ch, ok := p.early[req.Transfer]
	if !ok && len(p.early) < maxEarlyPulls {
		ch = make(chan struct{})
		p.early[req.Transfer] = ch
		ok = true
	}
	p.mu.Unlock()
	if !ok {
		return unknown, true
	}
	// Registered first, then asked again: an Expect between the first decision and the
	// registration is seen now; one after it closes ch.
	d, alive := p.decide(ctx, req)
	if !alive || d.Action != kvtransfer.ActionReject || !errors.Is(d.Err, kvtransfer.ErrUnknownTransfer) {
		return d, alive
	}
	p.metrics.earlyPulls.Inc()
	t := time.NewTimer(earlyPullWait)
	defer t.Stop()
	select {
	case <-ch:
	case <-t.C:
		p.mu.Lock()
		if p.early[req.Transfer] == ch {
			delete(p.early, req.Transfer)
		}
		p.mu.Unlock()
		return unknown, true
	case <-ctx.Done():
		return unknown, false
	}
	return p.decide(ctx, req)
}

// wakeEarly lets the early pulls of transfer decide again: its request reached the engine.
func (p *Producer) wakeEarly(transfer kvtransfer.TransferID) {
	p.mu.Lock()
	ch, ok := p.early[transfer]
	delete(p.early, transfer)
	p.mu.Unlock()
	if ok {
		close(ch)
	}
}

// execute carries out a send or reject decision on the consumer's connection.
func (p *Producer) execute(conn net.Conn, w *bufio.Writer, d kvtransfer.Decision, trailer bool) error {
	switch d.Action {
	case kvtransfer.ActionReject:
		return writeJSONFrame(w, frameKindResult, resultFrame{Code: codeOf(d.Err), Error: d.Err.Error()})
	case kvtransfer.ActionSend:
		err := p.send(conn, w, d.Copies, trailer)
		if err == nil {
			err = writeJSONFrame(w, frameKindResult, resultFrame{OK: true})
		}
		if err != nil {
			p.cfg.Log.Info("send to consumer failed", "transfer", d.Pull.Transfer, "consumer", d.Pull.Consumer, "err", err.Error())
		}
		// Served either way: a consumer whose send failed will not pull again (it fails its pull).
		p.core.SendDone(d.Pull.Transfer, d.Pull.Consumer, d.Pull.Consumers, err)
		_ = conn.SetWriteDeadline(time.Time{})
		return err
	}
	return nil
}

// send writes each block straight from the KV mapping (no staging copy).
func (p *Producer) send(conn net.Conn, w *bufio.Writer, copies []kvtransfer.BlockCopy, trailer bool) error {
	_ = conn.SetWriteDeadline(time.Now().Add(p.cfg.SendTimeout))
	for _, c := range copies {
		data, err := p.cfg.KV.Block(int64(c.Src))
		if err != nil {
			return fmt.Errorf("read block %d: %w", c.Src, err)
		}
		if p.cfg.SendDelay > 0 {
			if err := w.Flush(); err != nil {
				return err
			}
			time.Sleep(p.cfg.SendDelay)
		}
		if err := writeBlockFrame(w, conn, c.Group, c.Dst, data, trailer); err != nil {
			return err
		}
		p.metrics.bytesSent.Add(float64(len(data)))
	}
	return nil
}
