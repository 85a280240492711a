// Package chart tests the Helm chart's monitoring objects: they render and lint with every
// option on, stay out by default, and name only metrics the project's binaries (or vLLM, by
// the names in connector/vllm/words.go, which the plugin tests check against vLLM) export.
package chart

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/test/needs"
)

var monitoringOn = []string{"--set", "monitoring.serviceMonitor.enabled=true,monitoring.podMonitor.enabled=true," +
	"monitoring.prometheusRule.enabled=true,monitoring.dashboard.enabled=true"}

func helm(t *testing.T, args ...string) string {
	t.Helper()
	bin := filepath.Join(os.Getenv("KUBEBUILDER_ASSETS"), "helm")
	if _, err := os.Stat(bin); err != nil {
		needs.Skip(t, "helm not in KUBEBUILDER_ASSETS: %v (make test sets it)", err)
	}
	var out, errb bytes.Buffer
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		t.Fatalf("helm %v: %v\n%s%s", args, err, out.String(), errb.String())
	}
	return out.String()
}

const chartDir = "../../charts/pdcluster-operator"

// objects renders the chart and returns its objects by kind.
func objects(t *testing.T, set ...string) map[string][]map[string]any {
	t.Helper()
	out := map[string][]map[string]any{}
	for _, doc := range strings.Split(helm(t, append([]string{"template", "ops", chartDir, "--namespace", "ops"}, set...)...), "\n---") {
		var obj map[string]any
		if err := yaml.Unmarshal([]byte(doc), &obj); err != nil {
			t.Fatalf("rendered YAML: %v\n%s", err, doc)
		}
		if kind, _ := obj["kind"].(string); kind != "" {
			out[kind] = append(out[kind], obj)
		}
	}
	return out
}

func TestMonitoringOffByDefault(t *testing.T) {
	objs := objects(t)
	for _, kind := range []string{"ServiceMonitor", "PodMonitor", "PrometheusRule"} {
		if len(objs[kind]) != 0 {
			t.Errorf("a default install renders a %s", kind)
		}
	}
	for _, cm := range objs["ConfigMap"] {
		if strings.HasSuffix(name(cm), "-dashboard") {
			t.Error("a default install renders the dashboard")
		}
	}
}

func TestMonitoringLintsStrict(t *testing.T) {
	helm(t, append([]string{"lint", "--strict", chartDir}, monitoringOn...)...)
}

// The monitors scrape the ports render gives the pods, each where it serves /metrics (both
// sides of the seam: the pods are render's): vLLM's on the engines' port http, the sidecars' on
// connector, the routers' on metrics and never on their clients' port http. The PodMonitor
// keeps each series' PDCluster and pool, and the ServiceMonitor keeps the operator's namespace
// and name labels.
func TestMonitorsScrapeTheRenderedPorts(t *testing.T) {
	objs := objects(t, monitoringOn...)
	pm := objs["PodMonitor"][0]["spec"].(map[string]any)
	// scraped is the ports the PodMonitor scrapes on a pod of role with ports.
	scraped := func(role string, ports []corev1.ContainerPort) []string {
		var out []string
		for _, e := range pm["podMetricsEndpoints"].([]any) {
			e := e.(map[string]any)
			if !slices.ContainsFunc(ports, func(p corev1.ContainerPort) bool { return p.Name == e["port"] }) {
				continue
			}
			kept := true
			for _, r := range asList(e["relabelings"]) {
				r := r.(map[string]any)
				if r["action"] == "keep" && slices.Equal(toStrings(r["sourceLabels"]), []string{"__meta_kubernetes_pod_label_serving_pdcluster_dev_role"}) {
					kept = regexp.MustCompile("^(?:" + r["regex"].(string) + ")$").MatchString(role)
				}
			}
			if kept {
				out = append(out, e["port"].(string))
			}
		}
		return out
	}
	pdc := &v1alpha1.PDCluster{}
	b, err := os.ReadFile("../../internal/render/testdata/minimal.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.UnmarshalStrict(b, pdc); err != nil {
		t.Fatal(err)
	}
	rendered, err := render.Render(pdc, render.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	want := map[string][]string{"prefill": {"http", "connector"}, "decode": {"http", "connector"}, "router": {"metrics"}}
	for _, o := range rendered {
		d, ok := o.(*appsv1.Deployment)
		if !ok {
			continue
		}
		role := d.Labels[v1alpha1.LabelRole]
		var ports []corev1.ContainerPort
		for _, c := range d.Spec.Template.Spec.Containers {
			ports = append(ports, c.Ports...)
		}
		if got := scraped(role, ports); !slices.Equal(got, want[role]) {
			t.Errorf("%s pods: the PodMonitor scrapes ports %v, want %v", role, got, want[role])
		}
	}
	if got := pm["podTargetLabels"]; !slices.Equal(toStrings(got), []string{"app.kubernetes.io/instance", "serving.pdcluster.dev/role"}) {
		t.Errorf("podTargetLabels = %v", got)
	}
	sm := objs["ServiceMonitor"][0]["spec"].(map[string]any)["endpoints"].([]any)[0].(map[string]any)
	if sm["honorLabels"] != true || sm["scheme"] != "https" || sm["port"] != "metrics" {
		t.Errorf("ServiceMonitor endpoint = %v, want honorLabels, https (metrics.secure) on port metrics", sm)
	}
}

// Every metric the dashboard and the alerts query is one a binary of this project exports, or a
// vLLM metric named in connector/vllm/words.go.
func TestDashboardAndAlertsQueryExportedMetrics(t *testing.T) {
	objs := objects(t, monitoringOn...)
	var exprs []string
	for _, cm := range objs["ConfigMap"] {
		if !strings.HasSuffix(name(cm), "-dashboard") {
			continue
		}
		var dash struct {
			Panels []struct {
				Title   string `json:"title"`
				Targets []struct {
					Expr string `json:"expr"`
				} `json:"targets"`
			} `json:"panels"`
		}
		if err := json.Unmarshal([]byte(cm["data"].(map[string]any)["pdcluster.json"].(string)), &dash); err != nil {
			t.Fatalf("dashboard JSON: %v", err)
		}
		if len(dash.Panels) < 10 {
			t.Errorf("dashboard has %d panels", len(dash.Panels))
		}
		for _, p := range dash.Panels {
			for _, tg := range p.Targets {
				exprs = append(exprs, tg.Expr)
			}
		}
	}
	for _, g := range objs["PrometheusRule"][0]["spec"].(map[string]any)["groups"].([]any) {
		for _, r := range g.(map[string]any)["rules"].([]any) {
			exprs = append(exprs, r.(map[string]any)["expr"].(string))
		}
	}
	if len(exprs) == 0 {
		t.Fatal("no queries found")
	}
	exported := exportedMetrics(t)
	used := regexp.MustCompile(`\b(?:pdcluster_[a-z_]+|vllm:[a-z_]+)`)
	seen := map[string]bool{}
	for _, e := range exprs {
		for _, m := range used.FindAllString(e, -1) {
			seen[m] = true
			base := m
			for _, suffix := range []string{"_bucket", "_sum", "_count"} {
				if b, ok := strings.CutSuffix(m, suffix); ok && exported[b] {
					base = b
				}
			}
			if !exported[base] {
				t.Errorf("%s is queried (%q) but no binary exports it", m, e)
			}
		}
	}
	for _, want := range []string{"pdcluster_kv_transfer_verified", "vllm:prompt_tokens_by_source_total", "pdcluster_router_first_token_seconds_bucket", "pdcluster_connector_gate_completions_total"} {
		if !seen[want] {
			t.Errorf("neither the dashboard nor the alerts query %s", want)
		}
	}
}

// exportedMetrics greps the metric names the shipped packages declare, and vLLM's names in
// connector/vllm/words.go.
func exportedMetrics(t *testing.T) map[string]bool {
	t.Helper()
	decl := regexp.MustCompile(`(?:Name:\s*|NewDesc\(\s*)"(pdcluster_[a-z_]+)"`)
	vllmName := regexp.MustCompile(`"(vllm:[a-z_]+)"`)
	out := map[string]bool{}
	for _, dir := range []string{"controllers", "connector/sidecar", "internal/router"} {
		files, _ := filepath.Glob(filepath.Join("..", "..", dir, "*.go"))
		for _, f := range files {
			if strings.HasSuffix(f, "_test.go") {
				continue
			}
			b, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			for _, m := range decl.FindAllSubmatch(b, -1) {
				out[string(m[1])] = true
			}
		}
	}
	words, err := os.ReadFile("../../connector/vllm/words.go")
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range vllmName.FindAllSubmatch(words, -1) {
		out[string(m[1])] = true
	}
	if !out["pdcluster_router_requests_total"] || !out["pdcluster_connector_gate_loaded"] || !out["pdcluster_ready"] {
		t.Fatalf("the grep found too little: %v", out)
	}
	return out
}

func name(obj map[string]any) string {
	n, _ := obj["metadata"].(map[string]any)["name"].(string)
	return n
}

func toStrings(v any) []string {
	var out []string
	for _, x := range v.([]any) {
		out = append(out, x.(string))
	}
	return out
}

// asList is v as a YAML list, or none.
func asList(v any) []any {
	l, _ := v.([]any)
	return l
}
