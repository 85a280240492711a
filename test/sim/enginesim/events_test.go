package enginesim

import (
	"context"
	"encoding/binary"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/google/go-cmp/cmp"

	"pdcluster.dev/pdcluster-operator/internal/router/kvevents"
	"pdcluster.dev/pdcluster-operator/test/sim/kvpublish"
)

// replayed is every batch p published, read back through its replay socket and decoded as the
// router decodes vLLM's.
func replayed(t *testing.T, p *kvpublish.Publisher) []kvevents.Batch {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	d := zmq4.NewDealer(ctx)
	defer d.Close()
	if err := d.Dial("tcp://" + p.ReplayAddr()); err != nil {
		t.Fatal(err)
	}
	if err := d.SendMulti(zmq4.NewMsgFrom([]byte{}, make([]byte, 8))); err != nil {
		t.Fatal(err)
	}
	var out []kvevents.Batch
	for {
		msg, err := d.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if len(msg.Frames) != 4 {
			t.Fatalf("replay message of %d frames, want 4", len(msg.Frames))
		}
		if binary.BigEndian.Uint64(msg.Frames[2]) == 1<<64-1 {
			return out
		}
		b, err := kvevents.Decode(msg.Frames[3])
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, b)
	}
}

// The stand-in publishes its prefix cache as vLLM 0.30 and later do: a request's prefix-cache
// hits as stored again from the prompt's first block, then the blocks it cached new after the
// block before them; the partial last block never. (How many batches carry them depends on
// timing, as on vLLM: what queued since the last send goes in one.)
func TestEnginePublishesItsCacheAsVLLM(t *testing.T) {
	p, err := kvpublish.Listen("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "kv", 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	e, err := New(Config{Model: "m", BlockSize: 4, Capacity: 64, PrefixCaching: true, Events: p})
	if err != nil {
		t.Fatal(err)
	}
	prompt := func(n int) *request {
		r := &request{tokens: make([]int, n)}
		for i := range r.tokens {
			r.tokens[i] = 100 + i
		}
		r.hashes = blockHashes(r.tokens, 4)
		return r
	}
	ids := func(from, to int) []uint32 {
		var out []uint32
		for t := from; t < to; t++ {
			out = append(out, uint32(100+t))
		}
		return out
	}
	short, long := prompt(9), prompt(14) // 2 whole blocks and a partial one; 3 and a partial
	e.remember(short)
	e.remember(short)
	e.remember(long)
	want := []kvevents.Event{
		kvevents.Stored{BlockHashes: short.hashes[:2], TokenIDs: ids(0, 8), BlockSize: 4, Medium: "GPU"},
		kvevents.Stored{BlockHashes: short.hashes[:2], TokenIDs: ids(0, 8), BlockSize: 4, Medium: "GPU"},
		kvevents.Stored{BlockHashes: long.hashes[:2], TokenIDs: ids(0, 8), BlockSize: 4, Medium: "GPU"},
		kvevents.Stored{BlockHashes: long.hashes[2:3], Parent: long.hashes[1], HasParent: true, TokenIDs: ids(8, 12), BlockSize: 4, Medium: "GPU"},
	}
	var got []kvevents.Event
	for deadline := time.Now().Add(10 * time.Second); len(got) < len(want) && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		got = nil
		for _, b := range replayed(t, p) {
			got = append(got, b.Events...)
		}
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("published batches (-want +got):\n%s", diff)
	}
}
