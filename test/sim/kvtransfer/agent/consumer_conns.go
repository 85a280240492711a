package agent

import (
	"bufio"
	"context"
	"net"
	"sync"
	"time"
)

// Data connections to producers are kept between pulls: dialing one per pull (and accepting
// and closing it on the producer) was a third of a consumer agent's CPU under load.
const (
	// maxIdlePeerConns bounds the idle connections kept per producer address.
	maxIdlePeerConns = 32
	// peerConnMaxIdle is how long a consumer keeps an idle connection; the producer closes
	// its end after peerConnServeIdle, later, so a kept connection is rarely found closed.
	peerConnMaxIdle   = 60 * time.Second
	peerConnServeIdle = 120 * time.Second
)

// peerConn is a data connection to a producer with its buffers.
type peerConn struct {
	net.Conn
	r      *bufio.Reader
	w      *bufio.Writer
	reused bool      // taken from the pool: it may have been closed by the producer meanwhile
	idle   time.Time // when it was put back
}

// peerConns keeps idle data connections by producer address.
type peerConns struct {
	mu   sync.Mutex
	idle map[string][]*peerConn
}

// get returns an idle connection to addr, or dials one.
func (p *peerConns) get(ctx context.Context, d *net.Dialer, addr string) (*peerConn, error) {
	p.mu.Lock()
	for l := p.idle[addr]; len(l) > 0; l = p.idle[addr] {
		c := l[len(l)-1]
		p.idle[addr] = l[:len(l)-1]
		if len(l) == 1 {
			delete(p.idle, addr) // producers come and go: keep no key for one that left
		}
		if time.Since(c.idle) < peerConnMaxIdle {
			p.mu.Unlock()
			c.reused = true
			return c, nil
		}
		_ = c.Close()
	}
	p.mu.Unlock()
	return p.dial(ctx, d, addr)
}

func (p *peerConns) dial(ctx context.Context, d *net.Dialer, addr string) (*peerConn, error) {
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	// A small read buffer: block data is read past it, straight into the KV mapping.
	return &peerConn{Conn: conn, r: bufio.NewReaderSize(conn, 32<<10), w: bufio.NewWriter(conn)}, nil
}

// put keeps c, which ended a pull cleanly (its result frame read), for the next pull to addr.
func (p *peerConns) put(addr string, c *peerConn) {
	_ = c.SetDeadline(time.Time{})
	c.idle = time.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.idle == nil {
		p.idle = map[string][]*peerConn{}
	}
	if len(p.idle[addr]) >= maxIdlePeerConns {
		_ = c.Close()
		return
	}
	p.idle[addr] = append(p.idle[addr], c)
}

// closeAll closes every idle connection (the agent is stopping).
func (p *peerConns) closeAll() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, l := range p.idle {
		for _, c := range l {
			_ = c.Close()
		}
	}
	p.idle = nil
}
