package agent

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"testing"

	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer"
	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer/agentapi"
)

// Data plane benchmark shape: 1 MiB blocks, pulls of 16 blocks, 4 pulls in flight, so an
// operation moves 64 MiB, as a decode engine pulling several long prompts at once.
const (
	benchBlockBytes = 1 << 20
	benchBlocks     = 16
	benchStreams    = 4
	benchOpBytes    = benchBlockBytes * benchBlocks * benchStreams
)

// BenchmarkDataPlane moves KV blocks between two agents on loopback (agent), and the same
// bytes through plain loopback TCP connections, one per stream, from memory to memory
// (reference). Both report MB/s; make bench prints their ratio.
func BenchmarkDataPlane(b *testing.B) {
	b.Run("project", benchmarkAgentDataPlane)
	b.Run("reference", benchmarkTCPCopy)
}

func benchmarkAgentDataPlane(b *testing.B) {
	kvBlocks := benchBlocks * benchStreams
	// In a pod the KV buffer is a memory-backed emptyDir (tmpfs): so here too, when there is one.
	dir := b.TempDir()
	if shm, err := os.MkdirTemp("/dev/shm", "pdcluster-bench-"); err == nil {
		dir = shm
		b.Cleanup(func() { os.RemoveAll(shm) })
	}
	prodKV := openKVIn(b, dir, "p.kv", kvBlocks, benchBlockBytes)
	consKV := openKVIn(b, dir, "c.kv", kvBlocks, benchBlockBytes)
	block := make([]byte, benchBlockBytes)
	for id := range kvBlocks {
		for i := range block {
			block[i] = byte(id + i)
		}
		if err := prodKV.Write(int64(id), block); err != nil {
			b.Fatal(err)
		}
	}
	p := newPairKV(b, nil, true, prodKV, consKV)
	ctx := context.Background()
	b.SetBytes(benchOpBytes)
	b.ResetTimer()
	for i := range b.N {
		for s := range benchStreams {
			ids := make([]kvtransfer.BlockID, benchBlocks)
			for j := range ids {
				ids[j] = kvtransfer.BlockID(s*benchBlocks + j)
			}
			tid, req := kvtransfer.TransferID(fmt.Sprintf("x-%d-%d", i, s)), kvtransfer.RequestID(fmt.Sprintf("d-%d-%d", i, s))
			if err := p.prodLink.Ready(ctx, tid, kvtransfer.RequestID("p"+string(req)), kvtransfer.BlockIDs{ids}); err != nil {
				b.Fatal(err)
			}
			if err := p.consLink.Pull(ctx, agentapi.Pull{Request: req, Transfer: tid, Blocks: kvtransfer.BlockIDs{ids},
				WaitingForRemote: true, RemoteEngine: p.prod.EngineID(), RemoteBootstrap: p.prodURL}); err != nil {
				b.Fatal(err)
			}
		}
		p.completions.Wait(b, (i+1)*benchStreams, "completions")
	}
	b.StopTimer()
	for _, c := range p.completions.Completions() {
		if c.Err != nil {
			b.Fatalf("pull failed: %v", c.Err)
		}
	}
	got := make([]byte, benchBlockBytes)
	want := make([]byte, benchBlockBytes)
	_ = prodKV.Read(int64(kvBlocks-1), want)
	if err := consKV.Read(int64(kvBlocks-1), got); err != nil || string(got) != string(want) {
		b.Fatalf("the last block did not arrive intact (%v)", err)
	}
}

func benchmarkTCPCopy(b *testing.B) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	// The same bytes as the agents move: each stream's 16 MiB from its own part of a 64 MiB
	// source to its own part of a 64 MiB destination, in 1 MiB writes and reads.
	perStream := benchOpBytes / benchStreams
	src, dst := make([]byte, benchOpBytes), make([]byte, benchOpBytes)
	for i := range src {
		src[i] = byte(i)
	}
	done := make(chan error, benchStreams)
	conns := make([]net.Conn, benchStreams)
	for s := range conns {
		if conns[s], err = net.Dial("tcp", l.Addr().String()); err != nil {
			b.Fatal(err)
		}
		defer conns[s].Close()
		peer, err := l.Accept()
		if err != nil {
			b.Fatal(err)
		}
		defer peer.Close()
		go func() {
			part := dst[s*perStream : (s+1)*perStream]
			for {
				for off := 0; off < perStream; off += benchBlockBytes {
					if _, err := io.ReadFull(peer, part[off:off+benchBlockBytes]); err != nil {
						return
					}
				}
				done <- nil // every byte of this operation read
			}
		}()
	}
	b.SetBytes(benchOpBytes)
	b.ResetTimer()
	for range b.N {
		for s, c := range conns {
			go func() {
				part := src[s*perStream : (s+1)*perStream]
				for off := 0; off < perStream; off += benchBlockBytes {
					if _, err := c.Write(part[off : off+benchBlockBytes]); err != nil {
						done <- err
						return
					}
				}
			}()
		}
		for range conns {
			if err := <-done; err != nil {
				b.Fatal(err)
			}
		}
	}
	b.StopTimer()
	if string(dst) != string(src) {
		b.Fatal("the copy differs from its source")
	}
}
