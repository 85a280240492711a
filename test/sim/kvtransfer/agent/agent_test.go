package agent

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"pdcluster.dev/pdcluster-operator/connector/localapi"
	"pdcluster.dev/pdcluster-operator/internal/bootstrap"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer/agentapi"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer/kvfile"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer/link"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

const blockBytes = 256

type pair struct {
	prod           *Producer
	cons           *Consumer
	prodKV, consKV *kvfile.File
	prodURL        string
	releases       *wrappers.Sink
	completions    *wrappers.Sink
	prodLink       *link.Link
	consLink       *link.Link
}

func openKV(t testing.TB, name string) *kvfile.File {
	return openKVSized(t, name, 64, blockBytes)
}

func openKVSized(t testing.TB, name string, blocks, size int) *kvfile.File {
	return openKVIn(t, t.TempDir(), name, blocks, size)
}

func openKVIn(t testing.TB, dir, name string, blocks, size int) *kvfile.File {
	kv, err := kvfile.Open(filepath.Join(dir, name), blocks, size)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { kv.Close() })
	return kv
}

// newPair runs a producer and a consumer half on loopback, each with its engine's Link, and
// the producer's bootstrap registry (which its engine serves in a pod).
func newPair(t testing.TB, mutate func(*ProducerConfig, *ConsumerConfig)) *pair {
	t.Helper()
	return newPairOn(t, mutate, false)
}

// newPairOn with unixSockets serves each half's local API on a Unix socket.
func newPairOn(t testing.TB, mutate func(*ProducerConfig, *ConsumerConfig), unixSockets bool) *pair {
	t.Helper()
	return newPairKV(t, mutate, unixSockets, openKV(t, "p.kv"), openKV(t, "c.kv"))
}

func newPairKV(t testing.TB, mutate func(*ProducerConfig, *ConsumerConfig), unixSockets bool, prodKV, consKV *kvfile.File) *pair {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	p := &pair{prodKV: prodKV, consKV: consKV, releases: wrappers.NewSink(), completions: wrappers.NewSink()}
	data, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	pc := ProducerConfig{Config: Config{KV: p.prodKV, ExpireEvery: 20 * time.Millisecond}, DataAddr: data.Addr().String(),
		HoldTimeout: 5 * time.Second, ReadyTimeout: 5 * time.Second, TombstoneTTL: 10 * time.Second, SendTimeout: 8 * time.Second}
	cc := ConsumerConfig{Config: Config{KV: p.consKV, ExpireEvery: 20 * time.Millisecond}, PullTimeout: 8 * time.Second, UnknownTransferGrace: 2 * time.Second}
	if mutate != nil {
		mutate(&pc, &cc)
	}
	if p.prod, err = NewProducer(pc); err != nil {
		t.Fatal(err)
	}
	if p.cons, err = NewConsumer(cc); err != nil {
		t.Fatal(err)
	}
	registry := bootstrap.NewRegistry()
	if err := registry.Register(p.prod.Registration()); err != nil {
		t.Fatal(err)
	}
	boot := httptest.NewServer(registry.Handler())
	p.prodURL = boot.URL
	ps := httptest.NewServer(p.prod.Handler(prometheus.NewRegistry()))
	cs := httptest.NewServer(p.cons.Handler(prometheus.NewRegistry()))
	prodAPI, consAPI := ps.URL, cs.URL
	if unixSockets {
		ps.Close()
		cs.Close()
		dir := t.TempDir()
		serve := func(h http.Handler, sock string) *httptest.Server {
			l, err := localapi.Listen("unix://" + filepath.Join(dir, sock))
			if err != nil {
				t.Fatal(err)
			}
			s := httptest.NewUnstartedServer(h)
			s.Listener = l
			s.Start()
			return s
		}
		ps = serve(p.prod.Handler(prometheus.NewRegistry()), "prod.sock")
		cs = serve(p.cons.Handler(prometheus.NewRegistry()), "cons.sock")
		prodAPI, consAPI = "unix://"+filepath.Join(dir, "prod.sock"), "unix://"+filepath.Join(dir, "cons.sock")
	}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); _ = p.prod.Serve(ctx, data) }()
	go func() { defer wg.Done(); _ = p.cons.Serve(ctx) }()
	// The data plane starts in the background; a pull before that finds no producer and fails.
	for deadline := time.Now().Add(5 * time.Second); !p.prod.ready.Load(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("producer half not ready after 5s")
		}
	}
	p.prodLink = link.New(prodAPI, nil, p.releases)
	p.consLink = link.New(consAPI, p.completions, nil)
	wg.Add(2)
	go func() { defer wg.Done(); p.prodLink.Run(ctx) }()
	go func() { defer wg.Done(); p.consLink.Run(ctx) }()
	t.Cleanup(func() { cancel(); ps.Close(); cs.Close(); boot.Close(); wg.Wait() })
	return p
}

func fill(t *testing.T, kv *kvfile.File, id int64, b byte) []byte {
	data := bytes.Repeat([]byte{b}, blockBytes)
	data[0] = byte(id)
	if err := kv.Write(id, data); err != nil {
		t.Fatal(err)
	}
	return data
}

func (p *pair) pull(t *testing.T, req, transfer string, blocks kvtransfer.BlockIDs, waiting bool) {
	t.Helper()
	err := p.consLink.Pull(context.Background(), agentapi.Pull{Request: kvtransfer.RequestID(req), Transfer: kvtransfer.TransferID(transfer),
		Blocks: blocks, WaitingForRemote: waiting, RemoteEngine: p.prod.EngineID(), RemoteBootstrap: p.prodURL})
	if err != nil {
		t.Fatal(err)
	}
}

// A full pull moves the producer's blocks byte for byte into the consumer's destination
// blocks, completes once, and releases the producer once; over TCP as in the sandbox, and over
// Unix sockets as in a pod.
func TestPullMovesBytesAndCompletesOnce(t *testing.T) {
	for _, unix := range []bool{false, true} {
		t.Run(map[bool]string{false: "tcp", true: "unix"}[unix], func(t *testing.T) {
			testPullMovesBytesAndCompletesOnce(t, newPairOn(t, nil, unix))
		})
	}
}

func testPullMovesBytesAndCompletesOnce(t *testing.T, p *pair) {
	ctx := context.Background()
	src := [][]byte{fill(t, p.prodKV, 3, 'a'), fill(t, p.prodKV, 4, 'b')}
	if err := p.prodLink.Expect(ctx, "x1", "p-1"); err != nil {
		t.Fatal(err)
	}
	p.pull(t, "d-1", "x1", kvtransfer.BlockIDs{{10, 11}}, true) // parks until prefill is ready
	if err := p.prodLink.Ready(ctx, "x1", "p-1", kvtransfer.BlockIDs{{3, 4}}); err != nil {
		t.Fatal(err)
	}
	p.completions.Wait(t, 1, "completion")
	p.releases.Wait(t, 1, "release")
	// Once: a second report of the pull, or of the release, made at once would be queued
	// before the sentinels' reports, so it has arrived when they have. One made later (by a
	// timer: the agents' expiry runs every 20 ms here) is given ten periods to come first.
	time.Sleep(10 * 20 * time.Millisecond)
	p.drainConsumer(t, 1)
	p.drainProducer(t, 1)
	if d := cmp.Diff([]reported{{"d-1", false}, {sentinelRequest, true}}, reportedOf(p.completions.Completions())); d != "" {
		t.Errorf("completions (-want +got):\n%s", d)
	}
	wantReleases := []kvtransfer.Release{
		{Request: "p-1", Transfer: "x1", Blocks: 2, Reason: kvtransfer.ReleaseServed},
		{Request: sentinelRequest, Transfer: sentinelTransfer, Blocks: 1, Reason: kvtransfer.ReleaseAborted},
	}
	if d := cmp.Diff(wantReleases, p.releases.Releases()); d != "" {
		t.Errorf("releases (-want +got):\n%s", d)
	}
	// The agents' own counts agree: one completion of d-1 (the sentinel's is the failure).
	if d := cmp.Diff(map[string]float64{"ok": 1, "failed": 1}, counts(p.cons.metrics.completions, "ok", "failed")); d != "" {
		t.Errorf("pdcluster_connector_completions_total (-want +got):\n%s", d)
	}
	if d := cmp.Diff(map[string]float64{"served": 1, "expired": 0, "aborted": 1}, counts(p.prod.metrics.releases, "served", "expired", "aborted")); d != "" {
		t.Errorf("pdcluster_connector_releases_total (-want +got):\n%s", d)
	}
	got := make([]byte, blockBytes)
	for i, dst := range []int64{10, 11} {
		_ = p.consKV.Read(dst, got)
		if !bytes.Equal(got, src[i]) {
			t.Errorf("consumer block %d does not hold producer block %d", dst, 3+i)
		}
	}
}

// The sentinels mark the end of an agent's event stream so far: each makes one report, queued
// after every report the agent made before it (the event queue keeps order), so a test that
// waited for it has seen everything before it, without waiting for time to pass.
const (
	sentinelRequest  = "sentinel"
	sentinelTransfer = "x-sentinel"
)

// drainConsumer waits until the consumer has reported a pull for an engine the producer does
// not have (it fails at once, with a completion), after the before completions already seen.
func (p *pair) drainConsumer(t *testing.T, before int) {
	t.Helper()
	err := p.consLink.Pull(context.Background(), agentapi.Pull{Request: sentinelRequest, Transfer: sentinelTransfer, Blocks: kvtransfer.BlockIDs{{63}},
		WaitingForRemote: true, RemoteEngine: "engine-sentinel", RemoteBootstrap: p.prodURL})
	if err != nil {
		t.Fatal(err)
	}
	p.completions.Wait(t, before+1, "the sentinel's completion")
}

// drainProducer waits until the producer has released a sentinel transfer it was told was
// aborted, after the before releases already seen.
func (p *pair) drainProducer(t *testing.T, before int) {
	t.Helper()
	ctx := context.Background()
	if err := p.prodLink.Ready(ctx, sentinelTransfer, sentinelRequest, kvtransfer.BlockIDs{{63}}); err != nil {
		t.Fatal(err)
	}
	if err := p.prodLink.Abort(ctx, sentinelTransfer); err != nil {
		t.Fatal(err)
	}
	p.releases.Wait(t, before+1, "the sentinel's release")
}

// reported is what a test compares of a completion: whose, and whether it failed.
type reported struct {
	Request kvtransfer.RequestID
	Failed  bool
}

func reportedOf(cs []kvtransfer.Completion) []reported {
	out := make([]reported, 0, len(cs))
	for _, c := range cs {
		out = append(out, reported{c.Request, c.Err != nil})
	}
	return out
}

// counts reads a labelled counter's series.
func counts(v *prometheus.CounterVec, labels ...string) map[string]float64 {
	out := map[string]float64{}
	for _, l := range labels {
		out[l] = testutil.ToFloat64(v.WithLabelValues(l))
	}
	return out
}

// The seed case: a pull without local blocks tells the producer, which releases the prefill
// request as served, and reports nothing to the decode scheduler. The holds cannot time out
// within the test, so only the pull can have released them.
func TestEmptyPullReleasesProducerAndReportsNothing(t *testing.T) {
	for _, tc := range []struct {
		name   string
		blocks kvtransfer.BlockIDs
	}{{"no groups", nil}, {"one empty group", kvtransfer.BlockIDs{{}}}, {"two empty groups", kvtransfer.BlockIDs{{}, {}}}} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPair(t, func(pc *ProducerConfig, cc *ConsumerConfig) {
				pc.HoldTimeout, pc.ReadyTimeout, cc.PullTimeout = 10*time.Minute, 10*time.Minute, 11*time.Minute
			})
			ctx := context.Background()
			if err := p.prodLink.Expect(ctx, "x", "p"); err != nil {
				t.Fatal(err)
			}
			if err := p.prodLink.Ready(ctx, "x", "p", kvtransfer.BlockIDs{{1, 2}}); err != nil {
				t.Fatal(err)
			}
			p.pull(t, "d", "x", tc.blocks, true)
			p.releases.Wait(t, 1, "the release the empty pull owes the producer")
			want := []kvtransfer.Release{{Request: "p", Transfer: "x", Blocks: 2, Reason: kvtransfer.ReleaseServed}}
			if d := cmp.Diff(want, p.releases.Releases()); d != "" {
				t.Errorf("releases (-want +got):\n%s", d)
			}
			if d := cmp.Diff(map[string]float64{"served": 1, "expired": 0, "aborted": 0}, counts(p.prod.metrics.releases, "served", "expired", "aborted")); d != "" {
				t.Errorf("pdcluster_connector_releases_total (-want +got):\n%s", d)
			}
			p.drainConsumer(t, 0)
			if d := cmp.Diff([]reported{{sentinelRequest, true}}, reportedOf(p.completions.Completions())); d != "" {
				t.Errorf("completions (-want +got): the empty pull must report nothing\n%s", d)
			}
			// The producer releases when it serves the pull; the consumer's task ends after that.
			for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
				st := p.cons.core.Stats()
				if st.NotifiedOnly == 1 && st.InFlight == 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("puller stats %+v, want one notify-only pull and none in flight", st)
				}
			}
		})
	}
}

// A pull for an engine id the producer does not have fails with its blocks reported invalid;
// the same pull without local blocks fails silently.
func TestUnknownEngineFailsByThePolicyRules(t *testing.T) {
	p := newPair(t, nil)
	for _, tc := range []struct {
		req    string
		blocks kvtransfer.BlockIDs
	}{{"empty", nil}, {"full", kvtransfer.BlockIDs{{7, 8}}}} {
		err := p.consLink.Pull(context.Background(), agentapi.Pull{Request: kvtransfer.RequestID(tc.req), Transfer: "x", Blocks: tc.blocks,
			WaitingForRemote: true, RemoteEngine: "engine-gone", RemoteBootstrap: p.prodURL})
		if err != nil {
			t.Fatal(err)
		}
	}
	p.completions.Wait(t, 1, "failed completion")
	time.Sleep(100 * time.Millisecond)
	c := p.completions.Completions()
	if len(c) != 1 || c[0].Request != "full" || c[0].Err == nil || len(c[0].InvalidBlocks) != 2 {
		t.Fatalf("completions = %+v, want one failure for the pull with blocks, with 2 invalid blocks", c)
	}
}

// In the concurrent flow the pull may reach the producer before the prefill request: the
// producer holds it until the request's Expect, on the one connection (the consumer does not
// have to ask again), and the pull succeeds.
func TestEarlyPullWaitsForItsRequest(t *testing.T) {
	p := newPair(t, nil)
	fill(t, p.prodKV, 5, 'z')
	p.pull(t, "d", "early", kvtransfer.BlockIDs{{9}}, true)
	time.Sleep(50 * time.Millisecond)
	ctx := context.Background()
	_ = p.prodLink.Expect(ctx, "early", "p")
	_ = p.prodLink.Ready(ctx, "early", "p", kvtransfer.BlockIDs{{5}})
	p.completions.Wait(t, 1, "completion")
	if c := p.completions.Completions()[0]; c.Err != nil {
		t.Fatalf("early pull failed: %v", c.Err)
	}
	if got := testutilCounter(t, p.prod.metrics.earlyPulls); got != 1 {
		t.Errorf("early pulls = %v, want 1", got)
	}
	if got := testutilCounter(t, p.prod.metrics.pullsServed); got != 1 {
		t.Errorf("pull connections = %v, want 1: the consumer should not have had to ask again", got)
	}
}

// A corrupted block is caught by its checksum, in either frame kind, for blocks sent through
// the writer's buffer and for blocks written straight from memory in chunks.
func TestChecksumCatchesCorruption(t *testing.T) {
	for _, trailer := range []bool{false, true} {
		for _, size := range []int{64, 8 << 10, 2*chunkBytes + 5} {
			var buf bytes.Buffer
			w := bufio.NewWriterSize(&buf, 4<<10)
			data := make([]byte, size)
			for i := range data {
				data[i] = byte(i * 7)
			}
			if err := writeBlockFrame(w, &buf, 0, 3, data, trailer); err != nil {
				t.Fatal(err)
			}
			_ = w.Flush()
			read := func(frame []byte) (blockFrame, error) {
				r := bufio.NewReader(bytes.NewReader(frame))
				kind, n, err := readFrameHeader(r)
				if err != nil || (kind != frameKindBlock && kind != frameKindBlockTrailer) {
					t.Fatalf("trailer %v, size %d: frame kind %q, err %v", trailer, size, kind, err)
				}
				f, err := readBlockHeader(r, kind, n)
				if err != nil {
					return f, err
				}
				got := make([]byte, f.size)
				readErr, err := readBlockData(r, f, got)
				if readErr != nil {
					t.Fatalf("trailer %v, size %d: read data: %v", trailer, size, readErr)
				}
				if err == nil && !bytes.Equal(got, data) {
					t.Fatalf("trailer %v, size %d: data changed on the way", trailer, size)
				}
				return f, err
			}
			frame := bytes.Clone(buf.Bytes())
			if f, err := read(frame); err != nil || f.dst != 3 || f.size != size || f.trailer != trailer {
				t.Fatalf("trailer %v, size %d: intact block: %+v, err %v", trailer, size, f, err)
			}
			for _, at := range []int{5 + blockHeader + 1, len(frame) - 1} { // in the data; the last byte
				bad := bytes.Clone(frame)
				bad[at] ^= 1
				if _, err := read(bad); !errors.Is(err, ErrChecksum) {
					t.Fatalf("trailer %v, size %d: byte %d corrupted: err %v, want ErrChecksum", trailer, size, at, err)
				}
			}
		}
	}
}

// Each half answers only its own routes of the local API: holds go to the producer, pulls to
// the consumer; both drain reports and answer health, readiness and metrics.
func TestEachHalfServesOnlyItsOwnRoutes(t *testing.T) {
	p := newPair(t, nil)
	prod := httptest.NewServer(p.prod.Handler(prometheus.NewRegistry()))
	defer prod.Close()
	cons := httptest.NewServer(p.cons.Handler(prometheus.NewRegistry()))
	defer cons.Close()
	hold := `{"transfer_id":"x"}`
	pull := `{"request_id":"r","transfer_id":"x"}`
	cases := []struct {
		half         *httptest.Server
		method, path string
		body         string
		want         int
	}{
		{prod, http.MethodGet, "/healthz", "", http.StatusOK},
		{prod, http.MethodGet, "/readyz", "", http.StatusOK},
		{prod, http.MethodGet, "/metrics", "", http.StatusOK},
		{prod, http.MethodGet, agentapi.PathEvents, "", http.StatusOK},
		{prod, http.MethodPost, agentapi.PathExpect, hold, http.StatusOK},
		{prod, http.MethodPost, agentapi.PathAbort, hold, http.StatusOK},
		{prod, http.MethodPost, agentapi.PathPulls, pull, http.StatusNotFound},
		{prod, http.MethodGet, "/query", "", http.StatusNotFound}, // the engine serves the registry
		{prod, http.MethodGet, "/v1/info", "", http.StatusNotFound},
		{cons, http.MethodGet, "/healthz", "", http.StatusOK},
		{cons, http.MethodGet, "/readyz", "", http.StatusOK},
		{cons, http.MethodGet, "/metrics", "", http.StatusOK},
		{cons, http.MethodGet, agentapi.PathEvents, "", http.StatusOK},
		{cons, http.MethodPost, agentapi.PathExpect, hold, http.StatusNotFound},
		{cons, http.MethodPost, agentapi.PathReady, hold, http.StatusNotFound},
		{cons, http.MethodPost, agentapi.PathAbort, hold, http.StatusNotFound},
		{cons, http.MethodPost, "/register", "{}", http.StatusNotFound},
	}
	for _, c := range cases {
		req, _ := http.NewRequest(c.method, c.half.URL+c.path, strings.NewReader(c.body))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != c.want {
			name := map[*httptest.Server]string{prod: "producer", cons: "consumer"}[c.half]
			t.Errorf("%s: %s %s = %d, want %d", name, c.method, c.path, resp.StatusCode, c.want)
		}
	}
}

// A restarted agent finds its previous socket file on the shared volume; it must still bind.
func TestListenReplacesAStaleSocket(t *testing.T) {
	path := filepath.Join(t.TempDir(), "agent.sock")
	first, err := localapi.Listen("unix://" + path)
	if err != nil {
		t.Fatal(err)
	}
	first.(*net.UnixListener).SetUnlinkOnClose(false) // as after a SIGKILL: the file stays
	first.Close()
	second, err := localapi.Listen("unix://" + path)
	if err != nil {
		t.Fatalf("listen over a stale socket: %v", err)
	}
	second.Close()
}

// During a rollout a consumer of the previous version pulls from a producer of this one: it
// does not ask for checksum trailers, so it gets blocks with the checksum in the header, the
// only kind it reads.
func TestProducerSendsHeaderChecksumsToConsumersThatDoNotAskForTrailers(t *testing.T) {
	for _, trailer := range []bool{false, true} {
		p := newPair(t, nil)
		ctx := context.Background()
		src := fill(t, p.prodKV, 2, 'z')
		_ = p.prodLink.Ready(ctx, "x", "p", kvtransfer.BlockIDs{{2}})
		conn, err := net.Dial("tcp", p.prod.cfg.DataAddr)
		if err != nil {
			t.Fatal(err)
		}
		w, r := bufio.NewWriter(conn), bufio.NewReader(conn)
		pf := pullFrame{Transfer: "x", Request: "d", Engine: p.prod.EngineID(), Consumers: 1, Blocks: kvtransfer.BlockIDs{{9}},
			BlockSize: blockBytes, ChecksumTrailer: trailer}
		if err := writeJSONFrame(w, frameKindPull, pf); err != nil {
			t.Fatal(err)
		}
		kind, n, err := readFrameHeader(r)
		if want := map[bool]byte{false: frameKindBlock, true: frameKindBlockTrailer}[trailer]; err != nil || kind != want {
			t.Fatalf("trailer %v: frame %q (err %v), want %q", trailer, kind, err, want)
		}
		f, err := readBlockHeader(r, kind, n)
		if err != nil {
			t.Fatal(err)
		}
		got := make([]byte, f.size)
		if readErr, err := readBlockData(r, f, got); readErr != nil || err != nil || f.dst != 9 || !bytes.Equal(got, src) {
			t.Fatalf("trailer %v: block %d, errors %v %v, bytes equal %v", trailer, f.dst, readErr, err, bytes.Equal(got, src))
		}
		if kind, payload, err := readFrame(r, nil, maxFrame); err != nil || kind != frameKindResult || !strings.Contains(string(payload), `"ok":true`) {
			t.Fatalf("trailer %v: result %q %s (err %v)", trailer, kind, payload, err)
		}
		conn.Close()
	}
}

func testutilCounter(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	return testutil.ToFloat64(c)
}

// A consumer keeps its data connection to a producer between pulls.
func TestPullsShareADataConnection(t *testing.T) {
	p := newPair(t, nil)
	pullInTurn(t, p, 3)
	if got := testutilCounter(t, p.prod.metrics.pullsServed); got != 3 {
		t.Errorf("pulls served = %v, want 3", got)
	}
	if got := testutilCounter(t, p.prod.metrics.peerConns); got != 1 {
		t.Errorf("data connections = %v, want 1 for three pulls in a row", got)
	}
}

// pullInTurn runs n pulls one after the other, each of one block, and checks that each
// completes with the producer's bytes.
func pullInTurn(t *testing.T, p *pair, n int) {
	t.Helper()
	ctx := context.Background()
	for i := range n {
		tid := fmt.Sprintf("x%d", i)
		src := fill(t, p.prodKV, int64(i), 'a'+byte(i))
		_ = p.prodLink.Ready(ctx, kvtransfer.TransferID(tid), kvtransfer.RequestID("p"+tid), kvtransfer.BlockIDs{{kvtransfer.BlockID(i)}})
		p.pull(t, "d"+tid, tid, kvtransfer.BlockIDs{{kvtransfer.BlockID(10 + i)}}, true)
		p.completions.Wait(t, i+1, "completion")
		if c := p.completions.Completions()[i]; c.Err != nil {
			t.Fatalf("pull %d failed: %v", i, c.Err)
		}
		got := make([]byte, blockBytes)
		_ = p.consKV.Read(int64(10+i), got)
		if !bytes.Equal(got, src) {
			t.Fatalf("pull %d: the block did not arrive", i)
		}
	}
}

// A producer of the previous version serves one pull per connection and closes it: the
// consumer's kept connection is found closed, and the pull goes through on a new one.
func TestPullAfterTheProducerClosedAKeptConnection(t *testing.T) {
	p := newPair(t, func(pc *ProducerConfig, _ *ConsumerConfig) {
		pc.DataAddr = onePullPerConnection(t, pc.DataAddr)
	})
	pullInTurn(t, p, 3)
}

// onePullPerConnection serves as a producer of the previous version would, in front of the
// producer at upstream: it relays one pull and its answer, then closes the connection.
func onePullPerConnection(t *testing.T, upstream string) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				u, err := net.Dial("tcp", upstream)
				if err != nil {
					return
				}
				defer u.Close()
				// One pull frame reaches the producer, as one connection carried one pull: a
				// second pull sent on the kept connection must not (a copy of the whole stream
				// once relayed it before the close, and the producer served it unseen).
				kind, payload, err := readFrame(bufio.NewReader(c), nil, maxFrame)
				if err != nil {
					return
				}
				var pull [5]byte
				pull[0] = kind
				binary.BigEndian.PutUint32(pull[1:], uint32(len(payload)))
				if _, err := u.Write(append(pull[:], payload...)); err != nil {
					return
				}
				r := bufio.NewReader(u)
				for {
					kind, payload, err := readFrame(r, nil, maxFrame)
					if err != nil {
						return
					}
					var hdr [5]byte
					hdr[0] = kind
					binary.BigEndian.PutUint32(hdr[1:], uint32(len(payload)))
					if _, err := c.Write(append(hdr[:], payload...)); err != nil || kind == frameKindResult {
						return
					}
				}
			}()
		}
	}()
	return l.Addr().String()
}
