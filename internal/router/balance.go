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
	// matched is the leading prompt chunks the engine holds (with a preference); passedOver
	// says an engine holding more was left for its load.
	matched    int
	passedOver bool
}

// preference ranks a pool's engines for one request by what they hold of its prompt:
// matched[i] is engine i's leading chunks or blocks (a strategy's score). The engine holding most is
// picked unless it has more than slack requests in flight above the least loaded engine
// (consistent hashing with bounded loads: a popular prefix does not pile its requests on one
// engine); with none held, least-in-flight picks.
type preference struct {
	matched []int
	slack   int
}

// pick chooses one of n engines; url(i) is engine i's URL, by which requests in flight are
// counted (so they survive a reordering of the pool). avoid, when not nil, leaves out the
// engines it names (ejected, or failed in this request); ok is false when it leaves none. pref,
// when not nil, is the request's preference (least-in-flight only).
func (b *balancer) pick(n int, url func(int) string, avoid func(string) bool, pref *preference) (_ picked, ok bool) {
	start := int(b.turn.Add(1)-1) % n
	if !b.leastInFlight {
		for i := range n {
			if j := (start + i) % n; avoid == nil || !avoid(url(j)) {
				return picked{index: j}, true
			}
		}
		return picked{}, false
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	best := -1
	for i := range n {
		j := (start + i) % n
		if avoid != nil && avoid(url(j)) {
			continue
		}
		if best < 0 || b.inFlight[url(j)] < b.inFlight[url(best)] {
			best = j
		}
	}
	if best < 0 {
		return picked{}, false
	}
	p := picked{index: best, url: url(best)}
	if pref != nil {
		least := b.inFlight[p.url]
		held := -1 // the engine within the bound holding most, the less loaded of equals
		most := 0  // the most any engine holds
		for i := range n {
			j := (start + i) % n
			if avoid != nil && avoid(url(j)) {
				continue
			}
			m := pref.matched[j]
			most = max(most, m)
			if b.inFlight[url(j)] > least+pref.slack {
				continue
			}
			if held < 0 || m > pref.matched[held] || (m == pref.matched[held] && b.inFlight[url(j)] < b.inFlight[url(held)]) {
				held = j
			}
		}
		if pref.matched[held] > 0 {
			p = picked{index: held, url: url(held)}
		}
		p.matched, p.passedOver = pref.matched[p.index], most > pref.matched[p.index]
	}
	b.inFlight[p.url]++
	return p, true
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
