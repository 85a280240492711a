// Package gitops tests what the repository ships for GitOps tools: the Argo CD health check
// (Lua, run by Debian's lua5.4 against status objects the operator wrote on the local cluster's
// real node) and the kustomizations Argo CD and Flux apply.
package gitops

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"sigs.k8s.io/yaml"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/pdctl"
	"pdcluster.dev/pdcluster-operator/test/needs"
)

const script = "../../config/gitops/argocd/pdcluster-health.lua"

// luaValue writes a JSON value as a Lua constructor: objects and arrays as tables (arrays
// 1-based, as Argo CD's own JSON-to-Lua conversion makes them).
func luaValue(v any) string {
	switch x := v.(type) {
	case nil:
		return "nil"
	case bool:
		return strconv.FormatBool(x)
	case float64:
		return strconv.FormatFloat(x, 'g', -1, 64)
	case string:
		return strconv.Quote(x) // Go and Lua agree on the escapes a status message holds
	case []any:
		parts := make([]string, len(x))
		for i, e := range x {
			parts[i] = luaValue(e)
		}
		return "{" + strings.Join(parts, ", ") + "}"
	case map[string]any:
		keys := make([]string, 0, len(x))
		for k := range x {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		parts := make([]string, len(keys))
		for i, k := range keys {
			parts[i] = fmt.Sprintf("[%s] = %s", strconv.Quote(k), luaValue(x[k]))
		}
		return "{" + strings.Join(parts, ", ") + "}"
	}
	panic(fmt.Sprintf("unexpected JSON value %T", v))
}

// health runs the health check on obj as Argo CD does and returns hs.status and hs.message.
func health(t *testing.T, lua string, obj map[string]any) (string, string) {
	t.Helper()
	abs, err := filepath.Abs(script)
	if err != nil {
		t.Fatal(err)
	}
	driver := fmt.Sprintf("obj = %s\nlocal hs = dofile(%q)\nio.write(hs.status, \"\\n\", hs.message)\n", luaValue(obj), abs)
	out, err := exec.Command(lua, "-e", driver).CombinedOutput()
	if err != nil {
		t.Fatalf("lua: %v\n%s", err, out)
	}
	status, message, _ := strings.Cut(string(out), "\n")
	return status, message
}

func TestArgoCDHealthCheck(t *testing.T) {
	lua, err := exec.LookPath("lua5.4")
	if err != nil {
		needs.Skip(t, "lua5.4 is not installed (Debian package lua5.4; .ci/run installs it)")
	}
	for _, tc := range []struct {
		fixture, status, message string
	}{
		// Captured from the real node with kubectl get pdc -o json.
		{"ready.json", "Healthy", "AllComponentsReady: prefill, decode and router are ready"},
		{"unschedulable.json", "Degraded", "Unschedulable: decode: pod huge-decode-"},
		{"crashloop.json", "Degraded", "CrashLoopBackOff: prefill: pod crashy-prefill-"},
		// The ready object after a spec change the operator has not seen yet.
		{"not-observed.json", "Progressing", "waiting for the pdcluster-operator to observe generation 2"},
	} {
		t.Run(tc.fixture, func(t *testing.T) {
			b, err := os.ReadFile(filepath.Join("testdata", tc.fixture))
			if err != nil {
				t.Fatal(err)
			}
			var obj map[string]any
			if err := json.Unmarshal(b, &obj); err != nil {
				t.Fatal(err)
			}
			status, message := health(t, lua, obj)
			if status != tc.status || !strings.HasPrefix(message, tc.message) {
				t.Errorf("health = %s %q, want %s %q...", status, message, tc.status, tc.message)
			}
		})
	}
	t.Run("no status yet", func(t *testing.T) {
		obj := map[string]any{"metadata": map[string]any{"name": "new", "generation": float64(1)}}
		if status, _ := health(t, lua, obj); status != "Progressing" {
			t.Errorf("health = %s, want Progressing", status)
		}
	})
	// The script's Degraded reasons are the API's: a reason added to the API reaches the health
	// check (issue 57: MultiNodeUnavailable, which needs LeaderWorkerSet installed, showed as
	// Progressing for ever).
	src, err := os.ReadFile(script)
	if err != nil {
		t.Fatal(err)
	}
	table := regexp.MustCompile(`(?s)local degraded = \{(.*?)\n\}`).FindSubmatch(src)
	if table == nil {
		t.Fatal("no degraded table in the health check")
	}
	var inScript []string
	for _, m := range regexp.MustCompile(`(\w+) = true`).FindAllSubmatch(table[1], -1) {
		inScript = append(inScript, string(m[1]))
	}
	if d := cmp.Diff(slices.Sorted(slices.Values(v1alpha1.ReasonsNeedingSomeone)), slices.Sorted(slices.Values(inScript))); d != "" {
		t.Errorf("the health check's Degraded reasons (-API +script):\n%s", d)
	}
	// Every reason that needs someone to act is Degraded, on the condition the operator puts
	// it on; the reasons that pass by waiting are not.
	cond := func(typ, status, reason string) map[string]any {
		return map[string]any{"type": typ, "status": status, "reason": reason, "message": "the operator's words"}
	}
	readyTrue := cond(v1alpha1.ConditionReady, "True", v1alpha1.ReasonAllReady)
	type healthCase struct {
		name       string
		conditions []any
		status     string
		message    string
	}
	var needing []healthCase
	for _, reason := range v1alpha1.ReasonsNeedingSomeone {
		needing = append(needing,
			healthCase{"Ready " + reason, []any{cond(v1alpha1.ConditionReady, "False", reason)}, "Degraded", reason + ": the operator's words"},
			healthCase{"ConnectorHealthy " + reason, []any{readyTrue, cond(v1alpha1.ConditionConnectorHealthy, "False", reason)}, "Degraded", reason + ": the operator's words"})
	}
	for _, tc := range append(needing, []healthCase{
		// Waiting helps.
		{"Ready " + v1alpha1.ReasonRollingOut, []any{cond(v1alpha1.ConditionReady, "False", v1alpha1.ReasonRollingOut)}, "Progressing", "RollingOut: the operator's words"},
		{"Ready " + v1alpha1.ReasonNotReady, []any{cond(v1alpha1.ConditionReady, "False", v1alpha1.ReasonNotReady)}, "Progressing", "ComponentsNotReady: the operator's words"},
		{"ConnectorHealthy " + v1alpha1.ReasonRestartBackoff, []any{readyTrue, cond(v1alpha1.ConditionConnectorHealthy, "False", v1alpha1.ReasonRestartBackoff)},
			"Healthy", "AllComponentsReady: the operator's words"},
		{"ConnectorHealthy " + v1alpha1.ReasonConnectorNotReady, []any{readyTrue, cond(v1alpha1.ConditionConnectorHealthy, "False", v1alpha1.ReasonConnectorNotReady)},
			"Healthy", "AllComponentsReady: the operator's words"},
	}...) {
		t.Run(tc.name, func(t *testing.T) {
			obj := map[string]any{"metadata": map[string]any{"generation": float64(1)}, "status": map[string]any{"observedGeneration": float64(1), "conditions": tc.conditions}}
			status, message := health(t, lua, obj)
			if d := cmp.Diff([2]string{tc.status, tc.message}, [2]string{status, message}); d != "" {
				t.Errorf("health (-want +got):\n%s", d)
			}
		})
	}
}

// kustomize builds what Argo CD and Flux apply; kubectl comes from the cluster binaries.
func kustomize(t *testing.T, dir string) []map[string]any {
	t.Helper()
	assets := os.Getenv("KUBEBUILDER_ASSETS")
	if assets == "" {
		needs.Skip(t, "needs kubectl: KUBEBUILDER_ASSETS (make test sets it)")
	}
	out, err := exec.Command(filepath.Join(assets, "kubectl"), "kustomize", dir).CombinedOutput()
	if err != nil {
		t.Fatalf("kubectl kustomize %s: %v\n%s", dir, err, out)
	}
	var objs []map[string]any
	for doc := range strings.SplitSeq(string(out), "\n---\n") {
		var o map[string]any
		if err := yaml.Unmarshal([]byte(doc), &o); err != nil {
			t.Fatal(err)
		}
		objs = append(objs, o)
	}
	return objs
}

// Argo CD's argocd-cm gets the health check under the key Argo CD looks up, byte for byte.
func TestArgoCDConfigMapCarriesTheHealthCheck(t *testing.T) {
	objs := kustomize(t, "../../config/gitops/argocd")
	want, err := os.ReadFile(script)
	if err != nil {
		t.Fatal(err)
	}
	if len(objs) != 1 || objs[0]["kind"] != "ConfigMap" {
		t.Fatalf("built %d objects, want argocd-cm", len(objs))
	}
	meta := objs[0]["metadata"].(map[string]any)
	data := objs[0]["data"].(map[string]any)
	if meta["name"] != "argocd-cm" || meta["namespace"] != "argocd" || data["resource.customizations.health.serving.pdcluster.dev_PDCluster"] != string(want) {
		t.Errorf("argocd-cm = %v / keys %v, want the script under resource.customizations.health.serving.pdcluster.dev_PDCluster", meta, data)
	}
}

// The site both tools apply holds the operator and a PDCluster that passes admission: each
// PDCluster is put through `pdctl validate` (the CRD's schema and CEL rules as the API server
// runs them, then what only render checks), which must accept it without dropping a field.
func TestGitOpsSiteBuilds(t *testing.T) {
	kinds := map[string]bool{}
	for _, o := range kustomize(t, "../../config/gitops/site") {
		kinds[fmt.Sprint(o["kind"])] = true
		if o["kind"] != "PDCluster" {
			continue
		}
		name := fmt.Sprint(o["metadata"].(map[string]any)["name"])
		t.Run("pdctl validate "+name, func(t *testing.T) {
			doc, err := yaml.Marshal(o)
			if err != nil {
				t.Fatal(err)
			}
			var stdout, stderr bytes.Buffer
			if code := pdctl.Execute([]string{"validate", "-f", "-"}, bytes.NewReader(doc), &stdout, &stderr); code != 0 || stderr.Len() > 0 {
				t.Errorf("pdctl validate: exit %d\n%s%s\nof:\n%s", code, stdout.Bytes(), stderr.Bytes(), doc)
			}
		})
	}
	for _, k := range []string{"CustomResourceDefinition", "Deployment", "ClusterRole", "PDCluster"} {
		if !kinds[k] {
			t.Errorf("site lacks a %s (has %v)", k, kinds)
		}
	}
}

// Every admission policy binding config/default builds names a policy of the same build: the
// names are prefixed, and kustomize must prefix each binding's policyName with them (it does
// not for a MutatingAdmissionPolicyBinding without config/admission/kustomizeconfig.yaml), or
// the binding binds nothing and the policy never runs.
func TestDefaultBindingsNameTheirPolicies(t *testing.T) {
	policies := map[string]bool{}
	var bindings []map[string]any
	for _, o := range kustomize(t, "../../config/default") {
		switch kind, _ := o["kind"].(string); kind {
		case "ValidatingAdmissionPolicy", "MutatingAdmissionPolicy":
			policies[kind+"/"+o["metadata"].(map[string]any)["name"].(string)] = true
		case "ValidatingAdmissionPolicyBinding", "MutatingAdmissionPolicyBinding":
			bindings = append(bindings, o)
		}
	}
	if len(bindings) < 2 {
		t.Fatalf("%d admission policy bindings in config/default, want the scaling warnings' and the gangs'", len(bindings))
	}
	for _, b := range bindings {
		kind := strings.TrimSuffix(b["kind"].(string), "Binding")
		policy, _ := b["spec"].(map[string]any)["policyName"].(string)
		if !policies[kind+"/"+policy] {
			t.Errorf("%s %s binds %s %q, which config/default does not build (%v)", b["kind"], b["metadata"].(map[string]any)["name"], kind, policy, policies)
		}
	}
}
