package kvtransfer_test

import (
	"errors"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	clocktesting "k8s.io/utils/clock/testing"

	"pdcluster.dev/pdcluster-operator/test/sim/kvtransfer"
)

type releases struct{ got []kvtransfer.Release }

func (r *releases) FinishedSending(rel kvtransfer.Release) { r.got = append(r.got, rel) }

func newProducer(t *testing.T) (*kvtransfer.Producer, *releases, *clocktesting.FakeClock) {
	t.Helper()
	rec := &releases{}
	clk := clocktesting.NewFakeClock(time.Unix(0, 0))
	p, err := kvtransfer.NewProducer(kvtransfer.ProducerConfig{
		Sink: rec, Clock: clk, HoldTimeout: 480 * time.Second, ReadyTimeout: 60 * time.Second, TombstoneTTL: 10 * time.Minute,
	})
	if err != nil {
		t.Fatal(err)
	}
	return p, rec, clk
}

func pullOf(tid string, consumer, consumers int, blocks ...[]kvtransfer.BlockID) kvtransfer.PullRequest {
	return kvtransfer.PullRequest{Transfer: kvtransfer.TransferID(tid), Consumer: kvtransfer.ConsumerRank(consumer), Consumers: consumers, Blocks: blocks}
}

func TestProducerReleasesOnceAfterEveryConsumer(t *testing.T) {
	p, rec, _ := newProducer(t)
	p.Expect("x", "p1")
	p.Ready("x", "p1", kvtransfer.BlockIDs{{10, 11, 12}})
	d0 := p.Pull(pullOf("x", 0, 2, []kvtransfer.BlockID{7, 8}))
	if d0.Action != kvtransfer.ActionSend {
		t.Fatalf("decision = %+v, want send", d0)
	}
	// A partial local prefix hit on decode: the producer's last blocks are the ones sent.
	want := []kvtransfer.BlockCopy{{Group: 0, Src: 11, Dst: 7}, {Group: 0, Src: 12, Dst: 8}}
	if diff := cmp.Diff(want, d0.Copies); diff != "" {
		t.Errorf("copies (-want +got):\n%s", diff)
	}
	// Empty pull of the second consumer: no bytes, but it counts.
	d1 := p.Pull(pullOf("x", 1, 2))
	if d1.Action != kvtransfer.ActionSend || len(d1.Copies) != 0 {
		t.Fatalf("empty pull decision = %+v, want a send of nothing", d1)
	}
	if dup := p.Pull(pullOf("x", 1, 2)); dup.Action != kvtransfer.ActionReject || !errors.Is(dup.Err, kvtransfer.ErrDuplicatePull) {
		t.Errorf("second pull of consumer 1 = %+v, want ErrDuplicatePull", dup)
	}
	p.SendDone("x", 1, 2, nil)
	if len(rec.got) != 0 {
		t.Fatalf("released with consumer 0 still sending: %v", rec.got)
	}
	p.SendDone("x", 0, 2, nil)
	p.SendDone("x", 0, 2, nil) // duplicate: ignored
	if diff := cmp.Diff([]kvtransfer.Release{{Request: "p1", Transfer: "x", Blocks: 3, Reason: kvtransfer.ReleaseServed}}, rec.got); diff != "" {
		t.Errorf("releases (-want +got):\n%s", diff)
	}
	if late := p.Pull(pullOf("x", 2, 2)); !errors.Is(late.Err, kvtransfer.ErrReleased) {
		t.Errorf("late pull = %+v, want ErrReleased", late)
	}
	if st := p.Stats(); st.Transfers != 0 || st.BlocksPinned != 0 || st.Tombstones != 1 {
		t.Errorf("stats = %+v", st)
	}
}

func TestProducerPullBeforeReadyWaits(t *testing.T) {
	p, rec, _ := newProducer(t)
	p.Expect("x", "p1")
	if d := p.Pull(pullOf("x", 0, 1, []kvtransfer.BlockID{5})); d.Action != kvtransfer.ActionWait {
		t.Fatalf("decision = %+v, want wait", d)
	}
	ds := p.Ready("x", "p1", kvtransfer.BlockIDs{{1}})
	if len(ds) != 1 || ds[0].Action != kvtransfer.ActionSend {
		t.Fatalf("decisions on ready = %+v, want one send", ds)
	}
	p.SendDone("x", 0, 1, nil)
	if len(rec.got) != 1 {
		t.Errorf("releases = %v, want one", rec.got)
	}
}

func TestProducerUnknownTransferLeavesNoState(t *testing.T) {
	p, _, _ := newProducer(t)
	d := p.Pull(pullOf("never", 0, 1, []kvtransfer.BlockID{5}))
	if d.Action != kvtransfer.ActionReject || !errors.Is(d.Err, kvtransfer.ErrUnknownTransfer) {
		t.Fatalf("decision = %+v, want ErrUnknownTransfer", d)
	}
	if st := p.Stats(); st.Transfers != 0 || st.Tombstones != 0 {
		t.Errorf("an unknown pull left state: %+v", st)
	}
}

// Invariant 2: expiry frees blocks no consumer came for, but never during a send.
func TestProducerExpiryWaitsForSends(t *testing.T) {
	p, rec, clk := newProducer(t)
	p.Ready("x", "p1", kvtransfer.BlockIDs{{1, 2}})
	if d := p.Pull(pullOf("x", 0, 2, []kvtransfer.BlockID{8, 9})); d.Action != kvtransfer.ActionSend {
		t.Fatalf("decision = %+v", d)
	}
	clk.Step(481 * time.Second)
	p.Expire()
	if len(rec.got) != 0 {
		t.Fatalf("expired during a send: %v", rec.got)
	}
	p.SendDone("x", 0, 2, nil) // one of two consumers: still held
	if len(rec.got) != 0 {
		t.Fatalf("released before the second consumer or expiry: %v", rec.got)
	}
	p.Expire()
	if len(rec.got) != 1 || rec.got[0].Reason != kvtransfer.ReleaseExpired {
		t.Fatalf("releases = %v, want one expiry", rec.got)
	}
	// Remembered at least the TTL (10 min), forgotten within two.
	clk.Step(9 * time.Minute)
	p.Expire()
	if late := p.Pull(pullOf("x", 1, 2, []kvtransfer.BlockID{9})); !errors.Is(late.Err, kvtransfer.ErrReleased) {
		t.Errorf("pull 9 min after the release = %+v, want ErrReleased", late)
	}
	clk.Step(11 * time.Minute)
	p.Expire()
	if st := p.Stats(); st.Tombstones != 0 {
		t.Errorf("tombstone outlived twice its TTL: %+v", st)
	}
	if late := p.Pull(pullOf("x", 1, 2, []kvtransfer.BlockID{9})); !errors.Is(late.Err, kvtransfer.ErrUnknownTransfer) {
		t.Errorf("pull after the tombstone expired = %+v, want ErrUnknownTransfer", late)
	}
}

func TestProducerAbort(t *testing.T) {
	t.Run("before ready rejects waiting pulls and holds nothing", func(t *testing.T) {
		p, rec, _ := newProducer(t)
		p.Expect("x", "p1")
		p.Pull(pullOf("x", 0, 1, []kvtransfer.BlockID{5}))
		ds := p.Abort("x")
		if len(ds) != 1 || !errors.Is(ds[0].Err, kvtransfer.ErrAborted) {
			t.Fatalf("decisions = %+v, want the waiting pull rejected", ds)
		}
		if len(rec.got) != 0 {
			t.Errorf("released blocks it never held: %v", rec.got)
		}
		if d := p.Pull(pullOf("x", 1, 1)); !errors.Is(d.Err, kvtransfer.ErrReleased) {
			t.Errorf("pull after abort = %+v, want ErrReleased", d)
		}
	})
	t.Run("during a send releases when the send ends", func(t *testing.T) {
		p, rec, _ := newProducer(t)
		p.Ready("x", "p1", kvtransfer.BlockIDs{{1}})
		p.Pull(pullOf("x", 0, 2, []kvtransfer.BlockID{5}))
		p.Abort("x")
		if len(rec.got) != 0 {
			t.Fatalf("released during a send: %v", rec.got)
		}
		p.SendDone("x", 0, 2, nil)
		if len(rec.got) != 1 || rec.got[0].Reason != kvtransfer.ReleaseAborted {
			t.Fatalf("releases = %v, want one abort release", rec.got)
		}
	})
}

func TestProducerBlockMismatchAnswersAndServes(t *testing.T) {
	cases := []struct {
		name   string
		held   kvtransfer.BlockIDs
		pull   kvtransfer.PullRequest
		target error
	}{
		{"consumer wants more blocks", kvtransfer.BlockIDs{{1}}, pullOf("x", 0, 1, []kvtransfer.BlockID{5, 6}), kvtransfer.ErrBlockMismatch},
		{"group count differs", kvtransfer.BlockIDs{{1}}, pullOf("x", 0, 1, []kvtransfer.BlockID{5}, []kvtransfer.BlockID{6}), kvtransfer.ErrGroupMismatch},
		{"producer held nothing", nil, pullOf("x", 0, 1, []kvtransfer.BlockID{5}), kvtransfer.ErrGroupMismatch},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p, rec, _ := newProducer(t)
			p.Ready("x", "p1", tc.held)
			d := p.Pull(tc.pull)
			if d.Action != kvtransfer.ActionReject || !errors.Is(d.Err, tc.target) {
				t.Fatalf("decision = %+v, want %v", d, tc.target)
			}
			if st := p.Stats(); st.Transfers != 0 {
				t.Errorf("the only consumer was answered, yet the transfer is still tracked: %+v", st)
			}
			if want := tc.held.HasLocal(); (len(rec.got) == 1) != want {
				t.Errorf("releases = %v, want one iff blocks were held", rec.got)
			}
		})
	}
}

// Three consumers wait for a transfer whose pulls announce a fan-in of one and carry blocks
// that do not fit: the first is answered and served, which releases the transfer; the others
// must not be decided on released (and reused) state.
func TestProducerWaitersBeyondTheFanInAreRejectedAfterRelease(t *testing.T) {
	p, rec, _ := newProducer(t)
	p.Expect("x", "p1")
	for c := range 3 {
		if d := p.Pull(pullOf("x", c, 1, []kvtransfer.BlockID{1, 2, 3})); d.Action != kvtransfer.ActionWait {
			t.Fatalf("pull %d = %+v, want wait", c, d)
		}
	}
	ds := p.Ready("x", "p1", kvtransfer.BlockIDs{{7}})
	if len(ds) != 3 {
		t.Fatalf("decisions = %+v, want three", ds)
	}
	if !errors.Is(ds[0].Err, kvtransfer.ErrBlockMismatch) {
		t.Errorf("first waiter = %+v, want ErrBlockMismatch", ds[0])
	}
	for _, d := range ds[1:] {
		if d.Action != kvtransfer.ActionReject || !errors.Is(d.Err, kvtransfer.ErrReleased) {
			t.Errorf("waiter after the release = %+v, want ErrReleased", d)
		}
	}
	if diff := cmp.Diff([]kvtransfer.Release{{Request: "p1", Transfer: "x", Blocks: 1, Reason: kvtransfer.ReleaseServed}}, rec.got); diff != "" {
		t.Errorf("releases (-want +got):\n%s", diff)
	}
	// The retired transfer's storage is reused by the next one, with nothing carried over.
	p.Ready("y", "p2", kvtransfer.BlockIDs{{4, 5}})
	d := p.Pull(pullOf("y", 0, 1, []kvtransfer.BlockID{8, 9}))
	if diff := cmp.Diff([]kvtransfer.BlockCopy{{Src: 4, Dst: 8}, {Src: 5, Dst: 9}}, d.Copies); diff != "" {
		t.Errorf("copies of the next transfer (-want +got):\n%s", diff)
	}
}
