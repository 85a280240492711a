// Command bench runs the project's benchmarks (make bench) and prints one table: each figure
// of this project beside its reference measured in the same run on the same machine, their
// ratio, and the target. Every benchmark is bounded in time and keeps its traffic on loopback.
//
//	go run ./hack/bench            # everything (the operator's needs KUBEBUILDER_ASSETS)
//	go run ./hack/bench -only core,pdctl
package main

import (
	"bufio"
	"bytes"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
)

// suite is one `go test -bench` run.
type suite struct {
	name, pkg, pattern, benchtime string
	// tags are the build tags the package's benchmarks need.
	tags string
	// count runs each benchmark this many times; the table takes the median.
	count int
}

var suites = []suite{
	{name: "core", pkg: "./test/sim/kvtransfer", pattern: "^BenchmarkPulls$", benchtime: "1s", count: 5},
	{name: "dataplane", pkg: "./test/sim/kvtransfer/agent", pattern: "^BenchmarkDataPlane$", benchtime: "2s", count: 3},
	{name: "pdctl", pkg: "./internal/pdctl", pattern: "^BenchmarkStart$", benchtime: "1x", count: 1},
	{name: "router", pkg: "./test/sandbox", pattern: "^Benchmark(Router|Balance|PrefixRouting)$", benchtime: "1x", count: 1},
	{name: "operator", pkg: "./test/integration", pattern: "^BenchmarkOperator$", benchtime: "1x", count: 1},
	// Real vLLM engines (PDCLUSTER_VLLM_ENGINES, which make bench sets): minutes to start.
	{name: "realengine", pkg: "./test/realengine", pattern: "^BenchmarkRouterRealEngines$", benchtime: "1x", count: 1, tags: "realengine"},
	// Two prefill and two decode real vLLM engines behind four routers (docs/routing.md), and
	// one engine tokenizing text.
	{name: "routing", pkg: "./test/realengine", pattern: "^Benchmark(RoutingRealEngines|TokenizeRealEngine)$", benchtime: "1x", count: 1, tags: "realengine"},
}

// row is one line of the table. project and reference name a benchmark and a metric;
// compare says how the figure meets its target.
type row struct {
	suite, figure       string
	project, reference  string // benchmark names, without the -GOMAXPROCS suffix
	metric              string
	target              string
	met                 func(project, reference float64) bool
	difference          bool // print project - reference instead of the ratio
	withoutReferenceRow bool // a figure with no reference of its own
}

func ratioAtLeast(min float64) func(p, r float64) bool {
	return func(p, r float64) bool { return p/r >= min }
}
func ratioAtMost(max float64) func(p, r float64) bool {
	return func(p, r float64) bool { return p/r <= max }
}
func diffBelow(max float64) func(p, r float64) bool {
	return func(p, r float64) bool { return p-r < max }
}
func atLeast(min float64) func(p, r float64) bool { return func(p, _ float64) bool { return p >= min } }
func atMost(max float64) func(p, r float64) bool  { return func(p, _ float64) bool { return p <= max } }

var rows = func() []row {
	rs := []row{
		{suite: "core", figure: "connector core, pulls/s, 1 producer rank", project: "BenchmarkPulls/ranks=1", reference: "BenchmarkPulls/reference",
			metric: "pulls/s", target: ">= 1,000,000/s", met: atLeast(1e6)},
		{suite: "core", figure: "connector core, pulls/s, 4 producer ranks", project: "BenchmarkPulls/ranks=4", reference: "BenchmarkPulls/reference",
			metric: "pulls/s"},
		{suite: "dataplane", figure: "data plane, MB/s, 1 MiB blocks, 4 pulls at once", project: "BenchmarkDataPlane/project", reference: "BenchmarkDataPlane/reference",
			metric: "MB/s", target: ">= 0.85x", met: ratioAtLeast(0.85)},
		{suite: "pdctl", figure: "pdctl validate, ms (sample)", project: "BenchmarkStart/validate/project", reference: "BenchmarkStart/reference",
			metric: "ms", target: "< 20 ms", met: atMost(20)},
		{suite: "pdctl", figure: "pdctl render, ms (sample)", project: "BenchmarkStart/render/project", reference: "BenchmarkStart/reference",
			metric: "ms", target: "< 20 ms", met: atMost(20)},
	}
	for _, c := range []string{"1", "8", "64"} {
		p, r := "BenchmarkRouter/clients="+c+"/project", "BenchmarkRouter/clients="+c+"/reference"
		rs = append(rs,
			row{suite: "router", figure: "router p50, ms, " + c + " client(s)", project: p, reference: r, metric: "p50-ms", difference: true, target: "+ < 1 ms", met: diffBelow(1)},
			row{suite: "router", figure: "router p99, ms, " + c + " client(s)", project: p, reference: r, metric: "p99-ms", difference: true, target: "+ < 1 ms", met: diffBelow(1)},
			row{suite: "router", figure: "router CPU, ms/request, " + c + " client(s)", project: p, reference: r, metric: "cpu-ms/req", target: "<= 1.5x", met: ratioAtMost(1.5)},
			row{suite: "router", figure: "whole path CPU, ms/request, " + c + " client(s)", project: p, reference: r, metric: "path-cpu-ms/req"},
			row{suite: "router", figure: "errors, " + c + " client(s)", project: p, reference: r, metric: "errors", difference: true, target: "0", met: func(p, _ float64) bool { return p == 0 }},
		)
		// Beside vLLM's own router (vllm-router, P/D mode) in front of the same engines.
		v := "BenchmarkRouter/clients=" + c + "/vllm-router"
		rs = append(rs,
			row{suite: "router", figure: "router CPU vs vllm-router, ms/request, " + c + " client(s)", project: p, reference: v, metric: "cpu-ms/req", target: "< 1x", met: ratioAtMost(0.9999)},
			row{suite: "router", figure: "router p50 vs vllm-router, ms, " + c + " client(s)", project: p, reference: v, metric: "p50-ms", difference: true},
			row{suite: "router", figure: "router p99 vs vllm-router, ms, " + c + " client(s)", project: p, reference: v, metric: "p99-ms", difference: true},
			row{suite: "router", figure: "vllm-router errors, " + c + " client(s)", project: v, reference: v, metric: "errors", target: "0", met: func(p, _ float64) bool { return p == 0 }, withoutReferenceRow: true},
		)
	}
	for _, c := range []string{"1", "4"} {
		p, r := "BenchmarkRouterRealEngines/clients="+c+"/project", "BenchmarkRouterRealEngines/clients="+c+"/reference"
		rs = append(rs,
			row{suite: "realengine", figure: "real vLLM: P/D through the router vs one engine, p50 ms, " + c + " client(s)", project: p, reference: r, metric: "p50-ms", difference: true},
			row{suite: "realengine", figure: "real vLLM: router CPU vs plain proxy, ms/request, " + c + " client(s)", project: p, reference: r, metric: "cpu-ms/req", target: "<= 1.5x", met: ratioAtMost(1.5)},
			row{suite: "realengine", figure: "real vLLM: errors, " + c + " client(s)", project: p, reference: r, metric: "errors", difference: true, target: "0", met: func(p, _ float64) bool { return p == 0 }},
		)
	}
	rs = append(rs,
		row{suite: "router", figure: "least-in-flight vs round robin, one slow engine per pool, req/s", project: "BenchmarkBalance/project", reference: "BenchmarkBalance/reference",
			metric: "req/s", target: "> 1x", met: ratioAtLeast(1.0001)},
		row{suite: "router", figure: "least-in-flight vs round robin, p50 ms", project: "BenchmarkBalance/project", reference: "BenchmarkBalance/reference", metric: "p50-ms"},
		row{suite: "router", figure: "least-in-flight vs round robin, p99 ms", project: "BenchmarkBalance/project", reference: "BenchmarkBalance/reference", metric: "p99-ms"},
		row{suite: "router", figure: "PrefixAware vs LeastInFlight routing, router CPU, ms/request, 8 clients", project: "BenchmarkPrefixRouting/project", reference: "BenchmarkPrefixRouting/reference",
			metric: "cpu-ms/req", target: "<= 1.1x", met: ratioAtMost(1.1)},
		row{suite: "router", figure: "PrefixAware vs LeastInFlight routing, p50 ms", project: "BenchmarkPrefixRouting/project", reference: "BenchmarkPrefixRouting/reference", metric: "p50-ms"},
		row{suite: "router", figure: "KVEvents vs LeastInFlight routing, router CPU, ms/request, 8 clients", project: "BenchmarkPrefixRouting/kv-events", reference: "BenchmarkPrefixRouting/reference",
			metric: "cpu-ms/req", target: "<= 1.1x", met: ratioAtMost(1.1)},
		row{suite: "router", figure: "KVEvents vs LeastInFlight routing, p50 ms", project: "BenchmarkPrefixRouting/kv-events", reference: "BenchmarkPrefixRouting/reference", metric: "p50-ms"},
	)
	rs = append(rs,
		row{suite: "routing", figure: "real vLLM, a text prompt of 1000 characters: POST /tokenize vs a 1-token completion, p50 ms", project: "BenchmarkTokenizeRealEngine/project",
			reference: "BenchmarkTokenizeRealEngine/reference", metric: "p50-ms"},
		row{suite: "routing", figure: "real vLLM, a text prompt of 1000 characters: POST /tokenize vs a 1-token completion, engine CPU, ms/request", project: "BenchmarkTokenizeRealEngine/project",
			reference: "BenchmarkTokenizeRealEngine/reference", metric: "cpu-ms/req"},
	)
	for _, cache := range []struct{ name, words string }{{"all", "caches hold all"}, {"48-blocks", "48-block caches"}} {
		routing := "BenchmarkRoutingRealEngines/cache=" + cache.name + "/"
		for _, w := range []struct{ name, words string }{{"shared-prefix", "chats"}, {"documents", "documents"}} {
			for _, pr := range []struct{ project, ref string }{
				{"PrefixAware", "LeastInFlight"}, {"PrefixAware", "RoundRobin"}, {"KVEvents", "LeastInFlight"}, {"KVEvents", "PrefixAware"},
			} {
				p, r := routing+w.name+"/"+pr.project, routing+w.name+"/"+pr.ref
				what := "real vLLM, " + cache.words + ", " + w.words + ": "
				vs := ", " + pr.project + " vs " + pr.ref
				rs = append(rs,
					row{suite: "routing", figure: what + "prefill prefix-cache hits, % of prompt" + vs, project: p, reference: r, metric: "prefill-hit-%", difference: true},
					row{suite: "routing", figure: what + "decode prefix-cache hits, % of prompt" + vs, project: p, reference: r, metric: "decode-hit-%", difference: true},
					row{suite: "routing", figure: what + "tokens decode pulled per request" + vs, project: p, reference: r, metric: "pulled-tok/req"},
					row{suite: "routing", figure: what + "p50 ms" + vs, project: p, reference: r, metric: "p50-ms"},
				)
			}
		}
		for _, strategy := range []string{"PrefixAware", "KVEvents"} {
			rs = append(rs,
				row{suite: "routing", figure: "real vLLM, " + cache.words + ", chats: router CPU, ms/request, " + strategy + " vs LeastInFlight", project: routing + "shared-prefix/" + strategy,
					reference: routing + "shared-prefix/LeastInFlight", metric: "cpu-ms/req"},
				row{suite: "routing", figure: "real vLLM, " + cache.words + ", nothing shared: req/s, " + strategy + " vs LeastInFlight", project: routing + "distinct/" + strategy,
					reference: routing + "distinct/LeastInFlight", metric: "req/s"},
				row{suite: "routing", figure: "real vLLM, " + cache.words + ", nothing shared: p50 ms, " + strategy + " vs LeastInFlight", project: routing + "distinct/" + strategy,
					reference: routing + "distinct/LeastInFlight", metric: "p50-ms"},
			)
		}
	}
	rs = append(rs,
		row{suite: "operator", figure: "operator, 1,000 PDClusters, s until all reconciled", project: "BenchmarkOperator/project", reference: "BenchmarkOperator/reference",
			metric: "s", target: "< 15 s", met: atMost(15)},
		row{suite: "operator", figure: "operator, writes per PDCluster at creation", project: "BenchmarkOperator/project", reference: "BenchmarkOperator/reference", metric: "writes/PDCluster"},
		row{suite: "operator", figure: "operator, writes of a full resync", project: "BenchmarkOperator/project", metric: "resync-writes",
			target: "0", met: func(p, _ float64) bool { return p == 0 }, withoutReferenceRow: true},
		row{suite: "operator", figure: "operator, heap bytes per PDCluster", project: "BenchmarkOperator/project", metric: "heap-B/PDCluster", withoutReferenceRow: true},
	)
	return rs
}()

// results maps benchmark name -> metric -> the values of each run.
type results map[string]map[string][]float64

// median is the middle value of a metric's runs.
func (r results) median(bench, metric string) (float64, bool) {
	vs := slices.Clone(r[bench][metric])
	if len(vs) == 0 {
		return 0, false
	}
	slices.Sort(vs)
	return vs[len(vs)/2], true
}

var benchLine = regexp.MustCompile(`^(Benchmark\S+?)(-\d+)?\s+\d+\s+(.*)$`)

func parse(r io.Reader, into results, echo io.Writer) {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := sc.Text()
		fmt.Fprintln(echo, line)
		m := benchLine.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		fields := strings.Fields(m[3])
		if into[m[1]] == nil {
			into[m[1]] = map[string][]float64{}
		}
		for i := 0; i+1 < len(fields); i += 2 {
			if v, err := strconv.ParseFloat(fields[i], 64); err == nil {
				into[m[1]][fields[i+1]] = append(into[m[1]][fields[i+1]], v)
			}
		}
	}
}

func run(s suite, into results, log io.Writer) error {
	args := []string{"test", s.pkg, "-run", "^$", "-bench", s.pattern, "-benchtime", s.benchtime, "-count", strconv.Itoa(s.count), "-timeout", "30m"}
	if s.tags != "" {
		args = append(args, "-tags", s.tags)
	}
	cmd := exec.Command("go", args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	parse(&out, into, log)
	if err != nil {
		return fmt.Errorf("go %s: %w", strings.Join(args, " "), err)
	}
	return nil
}

func format(v float64) string {
	switch {
	case v >= 100:
		return strconv.FormatFloat(v, 'f', 0, 64)
	case v >= 10:
		return strconv.FormatFloat(v, 'f', 1, 64)
	default:
		return strconv.FormatFloat(v, 'f', 2, 64)
	}
}

func main() {
	only := flag.String("only", "", "comma-separated suites to run (core, dataplane, pdctl, router, operator, realengine, routing); default all")
	logPath := flag.String("log", "", "file for the benchmarks' own output (default: discarded)")
	flag.Parse()
	want := map[string]bool{}
	for _, s := range strings.Split(*only, ",") {
		if s != "" {
			want[s] = true
		}
	}
	log := io.Writer(io.Discard)
	if *logPath != "" {
		f, err := os.Create(*logPath)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		defer f.Close()
		log = f
	}
	res := results{}
	ran := map[string]bool{}
	failed := false
	for _, s := range suites {
		if len(want) > 0 && !want[s.name] {
			continue
		}
		if s.name == "realengine" && os.Getenv("PDCLUSTER_VLLM_ENGINES") == "" {
			fmt.Fprintln(os.Stderr, "bench: realengine: PDCLUSTER_VLLM_ENGINES is not set (make bench sets it); skipped")
			continue
		}
		if s.name == "operator" && os.Getenv("KUBEBUILDER_ASSETS") == "" {
			fmt.Fprintln(os.Stderr, "bench: operator: KUBEBUILDER_ASSETS is not set (make bench sets it); skipped")
			continue
		}
		fmt.Fprintf(os.Stderr, "bench: %s (%s)...\n", s.name, s.pkg)
		if err := run(s, res, log); err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			failed = true
		}
		ran[s.name] = true
	}
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "figure\tproject\treference\tratio\ttarget\t")
	for _, r := range rows {
		if !ran[r.suite] {
			continue
		}
		p, okP := res.median(r.project, r.metric)
		ref, okR := res.median(r.reference, r.metric)
		if !okP {
			fmt.Fprintf(w, "%s\tmissing\t\t\t%s\t\n", r.figure, r.target)
			failed = true
			continue
		}
		refS, ratioS := "-", "-"
		if okR && !r.withoutReferenceRow {
			refS = format(ref)
			switch {
			case r.difference:
				ratioS = fmt.Sprintf("%+.2f", p-ref)
			case ref != 0:
				ratioS = fmt.Sprintf("%.2fx", p/ref)
			}
		}
		mark := ""
		if r.met != nil {
			if r.met(p, ref) {
				mark = " (met)"
			} else {
				mark = " (not met)"
			}
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s%s\t\n", r.figure, format(p), refS, ratioS, r.target, mark)
	}
	_ = w.Flush()
	if failed {
		os.Exit(1)
	}
}
