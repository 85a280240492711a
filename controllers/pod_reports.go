package controllers

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"
	crevent "sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/log"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// PodReports reads what the PDClusters' pods report (each engine pod's sidecar: GET /gate; each
// router: GET /canary, GET /pairs) outside Reconcile, so that a slow or silent pod never holds
// a reconcile worker. Reconcile asks it as it would ask the pods (it is a GateReader,
// CanaryReader and PairsReader) and gets the last answer at once. A pod asked about for the
// first time is read right away; every pod asked about within forgetAfter is read again each
// Interval, podReportReads at once and podReportReadsPerCluster of one PDCluster. When an
// answer changes what a reconcile acts on (a pod begins or stops answering, its gate loads or
// unloads or first reports or changes its ranks, a router has a newer canary), the pod's
// PDCluster is enqueued through Events. Counts that move with every request are not such a
// change: they reach status with the reconciler's periodic refresh (countsRefresh), or status
// writes would follow the traffic.
//
// It is a manager runnable (Start) and, as the controller it feeds, runs on the leader only.
type PodReports struct {
	// Gates, Canaries, Pairs and Routing read the pods; a nil one is never asked (Reconcile does not
	// ask for what it has no reader of).
	Gates    GateReader
	Canaries CanaryReader
	Pairs    PairsReader
	Routing  RoutingReader
	// Interval is how often every known pod is read again.
	Interval time.Duration
	// Timeout bounds each read, whatever the reader's own timeout.
	Timeout time.Duration
	// Clock dates the answers; nil is the wall clock.
	Clock clock.PassiveClock

	once   sync.Once
	mu     sync.Mutex
	pods   map[reportKey]*podReport
	kick   chan struct{}
	events chan crevent.GenericEvent
	// slots bound the reads at once, over every poll; clusterSlots each PDCluster's, so that
	// one PDCluster's silent pods (each read waits out Timeout) leave the others' slots free.
	slots        chan struct{}
	clusterSlots map[types.NamespacedName]chan struct{}
}

// NewPodReports reads the pods with the given readers every 10 s (the most often the
// reconciler refreshes counts, countsRefresh), 5 s at most per read.
func NewPodReports(gates GateReader, canaries CanaryReader, pairs PairsReader, routing RoutingReader) *PodReports {
	return &PodReports{Gates: gates, Canaries: canaries, Pairs: pairs, Routing: routing, Interval: 10 * time.Second, Timeout: 5 * time.Second}
}

// reportKind is what is read of a pod.
type reportKind string

const (
	gateReport    reportKind = "gate"
	canaryReport  reportKind = "canary"
	pairsReport   reportKind = "pairs"
	routingReport reportKind = "routing"
)

type reportKey struct {
	uid  types.UID
	kind reportKind
}

// podReport is the last answer of one pod to one question.
type podReport struct {
	pod   *corev1.Pod // as Reconcile last passed it (its IP, its PDCluster's label)
	asked time.Time   // when Reconcile last asked
	read  bool        // read at least once
	// reading is set while a poll reads the pod: a later poll leaves it to that one.
	reading bool
	at      time.Time // when it was last read
	err     error     // why the last read failed; nil when it answered
	gate    vllm.State
	canry   routerconfig.CanaryResult
	pairs   routerconfig.PairCounts
	routg   routerconfig.RoutingCounts
}

// forgetAfter is how long a pod Reconcile stopped asking about (deleted, stopped, its
// PDCluster gone or no longer asking) is still read: Reconcile asks about every pod it wants
// at least every gateRefresh.
const forgetAfter = 3 * gateRefresh

// podReportReads bounds the pods read at once; podReportReadsPerCluster one PDCluster's.
const (
	podReportReads           = gateReads
	podReportReadsPerCluster = podReportReads / 4
)

// errNotReadYet: the pod has not been read since Reconcile first asked about it; its first
// answer enqueues the PDCluster.
var errNotReadYet = errors.New("not read yet")

var podReads = prometheus.NewCounterVec(prometheus.CounterOpts{
	Name: "pdcluster_pod_report_reads_total",
	Help: "Reads of what the PDClusters' pods report (report: gate, canary, pairs, routing), by result (ok, error), made outside Reconcile.",
}, []string{"report", "result"})

func (p *PodReports) init() {
	p.once.Do(func() {
		p.pods = map[reportKey]*podReport{}
		p.kick = make(chan struct{}, 1)
		p.events = make(chan crevent.GenericEvent, 1024)
		p.slots = make(chan struct{}, podReportReads)
		p.clusterSlots = map[types.NamespacedName]chan struct{}{}
	})
}

// Events enqueue the PDClusters whose pods' answers changed: the controller watches them
// (source.Channel).
func (p *PodReports) Events() <-chan crevent.GenericEvent {
	p.init()
	return p.events
}

func (p *PodReports) now() time.Time {
	if p.Clock == nil {
		return time.Now()
	}
	return p.Clock.Now()
}

// ReadGate implements GateReader with the pod's last answer.
func (p *PodReports) ReadGate(_ context.Context, pod *corev1.Pod) (vllm.State, error) {
	st, _, err := p.ReadGateAt(pod)
	return st, err
}

// ReadGateAt is the pod's last answer to GET /gate and when it was read.
func (p *PodReports) ReadGateAt(pod *corev1.Pod) (vllm.State, time.Time, error) {
	r, err := p.last(pod, gateReport)
	return r.gate, r.at, err
}

// ReadCanary implements CanaryReader with the router's last answer.
func (p *PodReports) ReadCanary(_ context.Context, pod *corev1.Pod) (routerconfig.CanaryResult, error) {
	r, err := p.last(pod, canaryReport)
	return r.canry, err
}

// ReadPairs implements PairsReader with the router's last answer.
func (p *PodReports) ReadPairs(_ context.Context, pod *corev1.Pod) (routerconfig.PairCounts, error) {
	r, err := p.last(pod, pairsReport)
	return r.pairs, err
}

// ReadRouting implements RoutingReader with the router's last answer.
func (p *PodReports) ReadRouting(_ context.Context, pod *corev1.Pod) (routerconfig.RoutingCounts, error) {
	r, err := p.last(pod, routingReport)
	return r.routg, err
}

// last records that Reconcile asked about the pod and returns its last answer (a copy).
func (p *PodReports) last(pod *corev1.Pod, kind reportKind) (podReport, error) {
	p.init()
	p.mu.Lock()
	defer p.mu.Unlock()
	k := reportKey{pod.UID, kind}
	r := p.pods[k]
	if r == nil {
		r = &podReport{}
		p.pods[k] = r
		select {
		case p.kick <- struct{}{}:
		default:
		}
	}
	r.pod, r.asked = pod.DeepCopy(), p.now()
	switch {
	case !r.read:
		return podReport{}, errNotReadYet
	case r.err != nil:
		return podReport{}, r.err
	}
	return *r, nil
}

// Start reads the pods until ctx ends: the new ones as soon as Reconcile asks, all of them
// every Interval. Polls overlap: a poll waiting on silent pods (each read waits out Timeout)
// holds up neither the next one nor a new pod's first read.
func (p *PodReports) Start(ctx context.Context) error {
	p.init()
	tick := time.NewTicker(p.Interval)
	defer tick.Stop()
	var polls sync.WaitGroup
	defer polls.Wait()
	for {
		onlyNew := false
		select {
		case <-ctx.Done():
			return nil
		case <-p.kick:
			onlyNew = true
		case <-tick.C:
		}
		polls.Go(func() { p.poll(ctx, onlyNew) })
	}
}

// poll reads the pods (only the never-read ones when onlyNew) that no earlier poll is still
// reading, forgets the ones Reconcile stopped asking about, and enqueues the PDClusters whose
// pods' answers changed. Pods that answered their last read go first.
func (p *PodReports) poll(ctx context.Context, onlyNew bool) {
	p.init()
	type job struct {
		key     reportKey
		pod     *corev1.Pod
		cluster types.NamespacedName
		failed  bool
		slots   chan struct{}
	}
	var jobs []job
	p.mu.Lock()
	now := p.now()
	clusters := map[types.NamespacedName]bool{}
	for k, r := range p.pods {
		if now.Sub(r.asked) > forgetAfter {
			delete(p.pods, k)
			continue
		}
		cluster := types.NamespacedName{Namespace: r.pod.Namespace, Name: r.pod.Labels[v1alpha1.LabelCluster]}
		clusters[cluster] = true
		if (!onlyNew || !r.read) && !r.reading {
			r.reading = true
			jobs = append(jobs, job{key: k, pod: r.pod, cluster: cluster, failed: r.err != nil})
		}
	}
	for c, slots := range p.clusterSlots {
		if !clusters[c] && len(slots) == 0 {
			delete(p.clusterSlots, c)
		}
	}
	for i := range jobs {
		c := jobs[i].cluster
		if p.clusterSlots[c] == nil {
			p.clusterSlots[c] = make(chan struct{}, podReportReadsPerCluster)
		}
		jobs[i].slots = p.clusterSlots[c]
	}
	p.mu.Unlock()
	slices.SortStableFunc(jobs, func(a, b job) int {
		switch {
		case a.failed == b.failed:
			return 0
		case b.failed:
			return -1
		}
		return 1
	})

	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		changed = map[types.NamespacedName]bool{}
	)
	for _, j := range jobs {
		wg.Go(func() {
			// The PDCluster's slot first: a read waiting for one holds none of the others'.
			j.slots <- struct{}{}
			p.slots <- struct{}{}
			defer func() { <-p.slots; <-j.slots }()
			next := p.read(ctx, j.pod, j.key.kind)
			if p.store(j.key, next) {
				mu.Lock()
				changed[j.cluster] = true
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	for key := range changed {
		select {
		case p.events <- crevent.GenericEvent{Object: &v1alpha1.PDCluster{ObjectMeta: metav1.ObjectMeta{Namespace: key.Namespace, Name: key.Name}}}:
		case <-ctx.Done():
			return
		}
	}
}

// read asks one pod, within Timeout.
func (p *PodReports) read(ctx context.Context, pod *corev1.Pod, kind reportKind) podReport {
	ctx, cancel := context.WithTimeout(ctx, p.Timeout)
	defer cancel()
	r := podReport{read: true}
	switch kind {
	case gateReport:
		r.gate, r.err = p.Gates.ReadGate(ctx, pod)
	case canaryReport:
		r.canry, r.err = p.Canaries.ReadCanary(ctx, pod)
	case pairsReport:
		r.pairs, r.err = p.Pairs.ReadPairs(ctx, pod)
	case routingReport:
		r.routg, r.err = p.Routing.ReadRouting(ctx, pod)
	default:
		r.err = fmt.Errorf("unknown report %q", kind)
	}
	r.at = p.now()
	result := "ok"
	if r.err != nil && !errors.Is(r.err, errNoCanary) {
		result = "error"
		log.FromContext(ctx).V(1).Info("pod report not read", "pod", pod.Namespace+"/"+pod.Name, "report", kind, "error", r.err.Error())
	}
	podReads.WithLabelValues(string(kind), result).Inc()
	return r
}

// store keeps next as the pod's last answer (unless Reconcile stopped asking about it
// meanwhile) and reports whether it changes what a reconcile acts on.
func (p *PodReports) store(k reportKey, next podReport) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	r := p.pods[k]
	if r == nil {
		return false
	}
	r.reading = false
	before := r.gist(k.kind)
	next.pod, next.asked = r.pod, r.asked
	*r = next
	return r.gist(k.kind) != before
}

// reportGist is what a reconcile acts on in an answer; it is comparable.
type reportGist struct {
	answered, loaded, reported, engine bool
	ranks                              int
	canaryAt                           time.Time
	canaryResult                       routerconfig.CanaryOutcome
}

func (r *podReport) gist(kind reportKind) reportGist {
	if !r.read || r.err != nil {
		return reportGist{}
	}
	g := reportGist{answered: true}
	switch kind {
	case gateReport:
		g.loaded, g.reported, g.engine, g.ranks = r.gate.Loaded, r.gate.Report != nil, r.gate.Engine != nil, r.gate.Ranks
	case canaryReport:
		g.canaryAt, g.canaryResult = r.canry.Time, r.canry.Result
	}
	return g
}
