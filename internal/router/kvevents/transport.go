package kvevents

import (
	"bufio"
	"context"
	"net"
	"strings"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
)

// bufferedScheme is zmq4's tcp transport with the subscriber's reads buffered: zmq4 reads each
// frame's flags, size and body with reads of their own, a system call or more each (several
// per batch), which was most of what following an engine cost the router (BenchmarkFollow).
const bufferedScheme = "pdcluster-tcp"

func init() {
	if err := zmq4.RegisterTransport(bufferedScheme, bufferedTCP{transport.New("tcp")}); err != nil {
		panic(err)
	}
}

type bufferedTCP struct{ transport.Transport }

func (t bufferedTCP) Dial(ctx context.Context, d transport.Dialer, addr string) (net.Conn, error) {
	c, err := t.Transport.Dial(ctx, d, addr)
	if err != nil {
		return nil, err
	}
	return &bufferedConn{Conn: c, r: bufio.NewReaderSize(c, 64<<10)}, nil
}

// bufferedConn reads through r; writes, deadlines and closing are the connection's.
type bufferedConn struct {
	net.Conn
	r *bufio.Reader
}

func (c *bufferedConn) Read(p []byte) (int, error) { return c.r.Read(p) }

// buffered is a tcp:// endpoint on the buffered transport; other endpoints as they are.
func buffered(endpoint string) string {
	if rest, ok := strings.CutPrefix(endpoint, "tcp://"); ok {
		return bufferedScheme + "://" + rest
	}
	return endpoint
}
