package agent

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/bootstrap"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer"
)

// A header that claims a large frame costs what arrives, not what it claims: 10 bytes of a
// claimed 60 MiB allocate kilobytes, and the short frame is an error.
func TestFramePayloadGrowsAsBytesArrive(t *testing.T) {
	var wire bytes.Buffer
	hdr := [5]byte{frameKindPull}
	binary.BigEndian.PutUint32(hdr[1:], 60<<20)
	wire.Write(hdr[:])
	wire.WriteString("0123456789")
	r := bufio.NewReader(&wire)
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	_, _, err := readFrame(r, nil, maxFrame)
	runtime.ReadMemStats(&after)
	if err == nil || !strings.Contains(err.Error(), io.ErrUnexpectedEOF.Error()) {
		t.Errorf("err = %v, want an unexpected EOF", err)
	}
	if grew := after.TotalAlloc - before.TotalAlloc; grew > 1<<20 {
		t.Errorf("reading 10 bytes of a claimed 60 MiB frame allocated %d bytes", grew)
	}
	// Each kind has its own bound.
	cases := []struct {
		limit, size int
		ok          bool
	}{{maxPullFrame, maxPullFrame, true}, {maxPullFrame, maxPullFrame + 1, false}, {maxResultFrame, maxResultFrame + 1, false}}
	for _, tc := range cases {
		var w bytes.Buffer
		binary.BigEndian.PutUint32(hdr[1:], uint32(tc.size))
		w.Write(hdr[:])
		w.Write(make([]byte, tc.size))
		_, p, err := readFrame(bufio.NewReader(&w), nil, tc.limit)
		if (err == nil) != tc.ok || (tc.ok && len(p) != tc.size) {
			t.Errorf("frame of %d bytes under a limit of %d: %d bytes, err %v; want ok=%v", tc.size, tc.limit, len(p), err, tc.ok)
		}
	}
}

// A pull may not claim more consumer ranks than the producer serves (that would pin the
// transfer's blocks until the hold timeout), nor a rank past its fan-in.
func TestPullBeyondTheFanInIsRefused(t *testing.T) {
	p := newPair(t, nil) // one consumer rank
	src := fill(t, p.prodKV, 2, 'v')
	if err := p.prodLink.Ready(t.Context(), "victim", "p", kvtransfer.BlockIDs{{2}}); err != nil {
		t.Fatal(err)
	}
	for _, pf := range []pullFrame{
		{Consumer: 0, Consumers: 64},
		{Consumer: 1, Consumers: 1},
		{Consumer: -1, Consumers: 1},
	} {
		pf.Transfer, pf.Request, pf.Engine, pf.Blocks, pf.BlockSize = "victim", "thief", p.prod.EngineID(), kvtransfer.BlockIDs{{9}}, blockBytes
		conn, err := net.Dial("tcp", p.prod.cfg.DataAddr)
		if err != nil {
			t.Fatal(err)
		}
		w, r := bufio.NewWriter(conn), bufio.NewReader(conn)
		if err := writeJSONFrame(w, frameKindPull, pf); err != nil {
			t.Fatal(err)
		}
		_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
		kind, payload, err := readFrame(r, nil, maxResultFrame)
		conn.Close()
		if err != nil || kind != frameKindResult || !strings.Contains(string(payload), "consumer ranks") {
			t.Errorf("pull as rank %d of %d: frame %q %s (err %v), want a refusal and no block", pf.Consumer, pf.Consumers, kind, payload, err)
		}
	}
	// The real consumer still gets its blocks.
	p.pull(t, "d", "victim", kvtransfer.BlockIDs{{5}}, true)
	p.completions.Wait(t, 1, "the real consumer's completion")
	got := make([]byte, blockBytes)
	if err := p.consKV.Read(5, got); err != nil || !bytes.Equal(got, src) {
		t.Errorf("the real consumer's block: err %v, equal %v", err, bytes.Equal(got, src))
	}
}

// One peer may hold at most maxConnsPerPeer data connections; the next is closed at once and
// counted, and a closed one frees its place.
func TestDataConnectionsPerPeerAreBounded(t *testing.T) {
	p := newPair(t, nil)
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for range maxConnsPerPeer {
		c, err := net.Dial("tcp", p.prod.cfg.DataAddr)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	refused := func() bool {
		c, err := net.Dial("tcp", p.prod.cfg.DataAddr)
		if err != nil {
			return true
		}
		defer c.Close()
		_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
		_, err = c.Read(make([]byte, 1))
		return errors.Is(err, io.EOF) || (err != nil && !isTimeout(err))
	}
	deadline := time.Now().Add(5 * time.Second)
	for !refused() {
		if time.Now().After(deadline) {
			t.Fatalf("connection %d was kept", maxConnsPerPeer+1)
		}
	}
	if n := testutilCounter(t, p.prod.metrics.peerConnsRefused); n < 1 {
		t.Errorf("refused connections counted %v, want at least 1", n)
	}
	conns[0].Close()
	conns = conns[1:]
	deadline = time.Now().Add(5 * time.Second)
	for refused() {
		if time.Now().After(deadline) {
			t.Fatal("a closed connection did not free its place")
		}
	}
}

func isTimeout(err error) bool {
	ne, ok := errors.AsType[net.Error](err)
	return ok && ne.Timeout()
}

// The stand-in engine's bootstrap registry takes only its own ranks, dp as tp and pp: a
// stranger's data-parallel rank, even at the engine's own host, is refused (docs/security.md:
// only the engine's own ranks), and the engine's own worker is there.
func TestInProcessRegistryTakesOnlyTheEnginesRanks(t *testing.T) {
	p, err := StartInProcess(t.Context(), InProcessConfig{Role: vllm.KVProducer, Blocks: 4, BlockBytes: 64, DataListen: "127.0.0.1:0"}, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	reg, err := p.Registry(1, 2, 1)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(reg.Handler())
	defer srv.Close()
	for _, tc := range []struct {
		name string
		reg  bootstrap.Registration
		want bool
	}{
		{"a dp rank past the engine's", bootstrap.Registration{EngineID: "stranger", DPRank: 7, Addr: "tcp://127.0.0.1:9"}, false},
		{"a tp rank past the engine's", bootstrap.Registration{EngineID: p.Producer.Registration().EngineID, TPRank: 2, Addr: "tcp://127.0.0.1:9"}, false},
		{"the engine's own tp rank 1", bootstrap.Registration{EngineID: p.Producer.Registration().EngineID, TPRank: 1, Addr: "tcp://127.0.0.1:9"}, true},
	} {
		err := bootstrap.Register(t.Context(), srv.Client(), srv.URL, tc.reg, 1)
		if (err == nil) != tc.want {
			t.Errorf("%s: register = %v, want accepted %v", tc.name, err, tc.want)
		}
	}
	topo := reg.Snapshot()
	if _, ok := topo["7"]; ok || len(topo) != 1 {
		t.Errorf("registry = %+v, want the engine's dp rank 0 alone", topo)
	}
}
