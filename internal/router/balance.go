package router

import (
	"maps"
	"sync"
	"sync/atomic"

	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// balancer picks an engine of one pool for each request: round robin, or the engine with the
// fewest of this router's requests in flight, taking turns among equals (so an idle pool
// still spreads requests evenly, and a slow engine, whose requests stay longer, gets fewer).
type balancer struct {
	leastInFlight bool
	turn          atomic.Uint64
	mu            sync.Mutex
	inFlight      map[string]int // by engine URL; engines that left keep nothing once idle
}

func newBalancer(b routerconfig.Balance) *balancer {
	return &balancer{leastInFlight: b != routerconfig.BalanceRoundRobin, inFlight: map[string]int{}}
}

// picked is an engine chosen for a request; done must be called when its leg ends.
type picked struct {
	index int
	url   string
}

// pick chooses one of n engines; url(i) is engine i's URL, by which requests in flight are
// counted (so they survive a reordering of the pool).
func (b *balancer) pick(n int, url func(int) string) picked {
	start := int(b.turn.Add(1)-1) % n
	if !b.leastInFlight {
		return picked{index: start}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	best := start
	for i := range n {
		j := (start + i) % n
		if b.inFlight[url(j)] < b.inFlight[url(best)] {
			best = j
		}
	}
	b.inFlight[url(best)]++
	return picked{index: best, url: url(best)}
}

func (b *balancer) done(p picked) {
	if !b.leastInFlight {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.inFlight[p.url]--; b.inFlight[p.url] <= 0 {
		delete(b.inFlight, p.url)
	}
}

// snapshot is how many requests each engine has from this router now (least-in-flight only).
func (b *balancer) snapshot() map[string]int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return maps.Clone(b.inFlight)
}
