package kvtransfer_test

import (
	"fmt"
	"sync"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer"
)

// BenchmarkPulls measures pulls processed per second through both state machines: the decode
// Puller fans each pull out to every producer rank, each rank's Producer pairs it with held
// blocks and releases them, and the Puller reports the completion. One in four pulls is empty.
// The clock advances 10 ms per pull (a busy engine's 100 requests/s) and Expire runs every
// 1,000 pulls, as the agent's ticker does: the producers remember the default ten minutes of
// released transfers (60,000 to 120,000 tombstones), not every pull of the run.
func BenchmarkPulls(b *testing.B) {
	b.Run("reference", benchmarkPullFloor)
	for _, ranks := range []int{1, 4} {
		b.Run(fmt.Sprintf("ranks=%d", ranks), func(b *testing.B) {
			var completions int
			clk := clocktesting.NewFakeClock(time.Unix(0, 0))
			puller, err := kvtransfer.NewPuller(kvtransfer.PullerConfig{
				Sink: kvtransfer.CompletionFunc(func(kvtransfer.Completion) { completions++ }), Timeout: time.Minute, Clock: clk,
			})
			if err != nil {
				b.Fatal(err)
			}
			producers := make([]*kvtransfer.Producer, ranks)
			rankIDs := make([]kvtransfer.ProducerRank, ranks)
			for r := range producers {
				rankIDs[r] = kvtransfer.ProducerRank(r)
				producers[r], err = kvtransfer.NewProducer(kvtransfer.ProducerConfig{
					Sink: kvtransfer.ReleaseFunc(func(kvtransfer.Release) {}), Rank: kvtransfer.ProducerRank(r),
					HoldTimeout: time.Minute, ReadyTimeout: time.Minute, TombstoneTTL: 10 * time.Minute, Clock: clk,
				})
				if err != nil {
					b.Fatal(err)
				}
			}
			held := kvtransfer.BlockIDs{{1, 2, 3, 4, 5, 6, 7, 8}}
			local := kvtransfer.BlockIDs{{11, 12, 13, 14}}
			ids := transferIDs(b.N)
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				tid, req := ids[i], kvtransfer.RequestID(ids[i])
				meta := kvtransfer.PullMeta{Request: req, Transfer: tid, LocalBlock: local, WaitingForRemote: true}
				if i%4 == 0 {
					meta.LocalBlock = nil
				}
				for _, p := range producers {
					p.Ready(tid, req, held)
				}
				if err := puller.Begin(meta, rankIDs); err != nil {
					b.Fatal(err)
				}
				for r, p := range producers {
					d := p.Pull(kvtransfer.PullRequest{Transfer: tid, Consumers: 1, Blocks: meta.LocalBlock})
					p.SendDone(tid, 0, 1, d.Err)
					puller.TaskDone(req, tid, kvtransfer.ProducerRank(r), d.Err)
				}
				clk.Step(10 * time.Millisecond)
				if i%1000 == 999 {
					for _, p := range producers {
						p.Expire()
					}
					puller.Expire()
				}
			}
			b.StopTimer()
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "pulls/s")
			if want := b.N - (b.N+3)/4; completions != want {
				b.Fatalf("%d completions, want %d", completions, want)
			}
		})
	}
}

// benchmarkPullFloor is the reference: the least any pull tracker does per pull, on each side
// a mutex-guarded map entry added and removed under the transfer id. It measures the machine,
// so the core's figure can be read as a multiple of it.
func benchmarkPullFloor(b *testing.B) {
	var mu [2]sync.Mutex
	maps := [2]map[kvtransfer.TransferID]int{{}, {}}
	ids := transferIDs(b.N)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for side := range maps {
			mu[side].Lock()
			maps[side][ids[i]] = i
			mu[side].Unlock()
		}
		for side := range maps {
			mu[side].Lock()
			delete(maps[side], ids[i])
			mu[side].Unlock()
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "pulls/s")
}

func transferIDs(n int) []kvtransfer.TransferID {
	ids := make([]kvtransfer.TransferID, n)
	for i := range ids {
		ids[i] = kvtransfer.TransferID(fmt.Sprintf("x-%d", i))
	}
	return ids
}
