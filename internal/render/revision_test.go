package render

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/utils/ptr"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/rollout"
	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

func revisionBase() *v1alpha1.PDCluster {
	pdc := &v1alpha1.PDCluster{Spec: v1alpha1.PDClusterSpec{
		Model:      v1alpha1.ModelSpec{Path: "Qwen/Qwen3-8B"},
		Engine:     v1alpha1.EngineSpec{Image: "vllm/vllm-openai:v0.11.0", BlockSize: ptr.To[int32](64)},
		KVTransfer: v1alpha1.KVTransferSpec{RDMADevices: []string{"mlx5_0"}},
		Prefill:    v1alpha1.PoolSpec{Replicas: ptr.To[int32](2)},
		Decode:     v1alpha1.PoolSpec{Replicas: ptr.To[int32](1)},
	}}
	pdc.Name, pdc.Namespace = "pd", "ns"
	pdc.SetDefaults()
	return pdc
}

// TestKVRevision: the KV revision changes with what decides whether decode can read prefill's
// KV, and with nothing else.
func TestKVRevision(t *testing.T) {
	base, err := KVRevision(revisionBase())
	if err != nil {
		t.Fatal(err)
	}
	if len(base) != 10 {
		t.Fatalf("KV revision %q: want 10 characters (a label value)", base)
	}
	cases := []struct {
		name    string
		change  func(*v1alpha1.PDCluster)
		changes bool
	}{
		// Outside the revision: they roll the pods within one revision.
		{"resources", func(p *v1alpha1.PDCluster) {
			p.Spec.Decode.Resources.Limits = corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("64Gi")}
		}, false},
		{"replicas", func(p *v1alpha1.PDCluster) { p.Spec.Prefill.Replicas = ptr.To[int32](5) }, false},
		{"tolerations", func(p *v1alpha1.PDCluster) {
			p.Spec.Prefill.Tolerations = []corev1.Toleration{{Key: "gpu", Operator: corev1.TolerationOpExists}}
		}, false},
		{"env", func(p *v1alpha1.PDCluster) {
			p.Spec.Decode.Pod = &v1alpha1.PodSettings{Env: []corev1.EnvVar{{Name: "VLLM_LOGGING_LEVEL", Value: "DEBUG"}}}
		}, false},
		{"a flag outside the KV format", func(p *v1alpha1.PDCluster) { p.Spec.Engine.Args = []string{"--max-num-seqs=64"} }, false},
		{"data parallelism", func(p *v1alpha1.PDCluster) { p.Spec.Decode.Parallelism.Data = ptr.To[int32](2) }, false},
		{"verification", func(p *v1alpha1.PDCluster) { p.Spec.KVTransfer.Verification.Mode = v1alpha1.KVVerificationDisabled }, false},
		// Inside it.
		{"engine image", func(p *v1alpha1.PDCluster) { p.Spec.Engine.Image = "vllm/vllm-openai:v0.12.0" }, true},
		{"one pool's image", func(p *v1alpha1.PDCluster) { p.Spec.Prefill.Image = "vllm/vllm-openai:v0.12.0" }, true},
		{"block size", func(p *v1alpha1.PDCluster) { p.Spec.Engine.BlockSize = ptr.To[int32](16) }, true},
		{"model path", func(p *v1alpha1.PDCluster) { p.Spec.Model.Path = "Qwen/Qwen3-14B" }, true},
		{"model revision", func(p *v1alpha1.PDCluster) { p.Spec.Model.Revision = "a1b2c3" }, true},
		{"quantization", func(p *v1alpha1.PDCluster) { p.Spec.Engine.Args = []string{"--quantization", "fp8"} }, true},
		{"quantization as -q", func(p *v1alpha1.PDCluster) { p.Spec.Prefill.Args = []string{"-q=fp8"} }, true},
		{"KV-cache dtype", func(p *v1alpha1.PDCluster) { p.Spec.Decode.Args = []string{"--kv-cache-dtype", "fp8"} }, true},
		{"dtype", func(p *v1alpha1.PDCluster) { p.Spec.Engine.Args = []string{"--dtype=bfloat16"} }, true},
		{"tensor parallelism", func(p *v1alpha1.PDCluster) { p.Spec.Decode.Parallelism.Tensor = ptr.To[int32](2) }, true},
		{"pipeline parallelism", func(p *v1alpha1.PDCluster) { p.Spec.Prefill.Parallelism.Pipeline = ptr.To[int32](2) }, true},
		{"transfer protocol", func(p *v1alpha1.PDCluster) { p.Spec.KVTransfer.Protocol = v1alpha1.ProtocolTCP }, true},
		{"completion gate off", func(p *v1alpha1.PDCluster) { p.Spec.KVTransfer.CompletionGate = v1alpha1.CompletionGateDisabled }, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			pdc := revisionBase()
			c.change(pdc)
			got, err := KVRevision(pdc)
			if err != nil {
				t.Fatal(err)
			}
			if changed := got != base; changed != c.changes {
				t.Errorf("KV revision %s -> %s: changed = %v, want %v", base, got, changed, c.changes)
			}
		})
	}
}

// TestKVRevisionSameFlagSpelledTwoWays: -q fp8, --quantization=fp8 and --quantization fp8 are
// one KV format, as argparse reads them.
func TestKVRevisionSameFlagSpelledTwoWays(t *testing.T) {
	var revs []string
	for _, args := range [][]string{{"-q", "fp8"}, {"--quantization=fp8"}, {"--quantization", "int8", "--quantization", "fp8"}} {
		pdc := revisionBase()
		pdc.Spec.Engine.Args = args
		rev, err := KVRevision(pdc)
		if err != nil {
			t.Fatal(err)
		}
		revs = append(revs, rev)
	}
	if revs[0] != revs[1] || revs[1] != revs[2] {
		t.Errorf("revisions %v: want one", revs)
	}
}

func TestFlagValues(t *testing.T) {
	cases := []struct {
		name string
		args []string
		want map[string]string
	}{
		{"separate value", []string{"--dtype", "half"}, map[string]string{"--dtype": "half"}},
		{"joined value", []string{"--dtype=half"}, map[string]string{"--dtype": "half"}},
		{"alias", []string{"-q", "awq"}, map[string]string{"--quantization": "awq"}},
		{"last wins", []string{"--dtype=half", "--max-num-seqs", "8", "--dtype", "float32"}, map[string]string{"--dtype": "float32"}},
		{"no value before the next flag", []string{"--dtype", "--enforce-eager"}, map[string]string{"--dtype": ""}},
		{"no value at the end", []string{"--dtype"}, map[string]string{"--dtype": ""}},
		{"other flags only", []string{"--max-num-seqs", "8", "--enforce-eager"}, map[string]string{}},
		{"a prefix is not the flag", []string{"--dtypes=half"}, map[string]string{}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if d := cmp.Diff(c.want, flagValues(c.args, kvFormatFlags)); d != "" {
				t.Errorf("flagValues(%q) (-want +got):\n%s", c.args, d)
			}
		})
	}
}

// TestEngineObjectName: a revision's objects carry its name where it fits a DNS label, else a
// hash of the whole name; never longer than 63, never the same for two PDClusters.
func TestEngineObjectName(t *testing.T) {
	long := strings.Repeat("a", 54) + "x" // 55: the longest a PDCluster may be
	longToo := strings.Repeat("a", 54) + "y"
	cases := []struct {
		cluster, rev string
		base         bool
		want         string
	}{
		{"pd", "28489f6979", true, "pd-prefill"},
		{"pd", "28489f6979", false, "pd-prefill-28489f6979"},
		{long, "28489f6979", true, long + "-prefill"},
	}
	for _, tc := range cases {
		if got := EngineObjectName(tc.cluster, v1alpha1.RolePrefill, tc.rev, tc.base); got != tc.want {
			t.Errorf("EngineObjectName(%q, %q, %v) = %q, want %q", tc.cluster, tc.rev, tc.base, got, tc.want)
		}
	}
	a := EngineObjectName(long, v1alpha1.RolePrefill, "28489f6979", false)
	b := EngineObjectName(longToo, v1alpha1.RolePrefill, "28489f6979", false)
	c := EngineObjectName(long, v1alpha1.RolePrefill, "0000000000", false)
	for _, n := range []string{a, b, c} {
		if errs := validation.IsDNS1035Label(n); len(errs) > 0 {
			t.Errorf("%q is not a Service name: %v", n, errs)
		}
	}
	if a == b || a == c {
		t.Errorf("names %q, %q, %q: two clusters or two revisions share one", a, b, c)
	}
}

// TestRenderServing: with an older revision running, router.json lists both revisions'
// Services and the update revision's objects take the suffixed names; the old revision's are
// not rendered (the reconciler scales and deletes them).
func TestRenderServing(t *testing.T) {
	pdc := revisionBase()
	rev, err := KVRevision(pdc)
	if err != nil {
		t.Fatal(err)
	}
	old := routerconfig.RevisionHosts{Revision: "0123456789", PrefillHost: "pd-prefill.ns.svc", DecodeHost: "pd-decode.ns.svc"}
	objs, err := RenderServing(pdc, DefaultOptions(), Serving{Suffixed: true, Old: []routerconfig.RevisionHosts{old}})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	var file routerconfig.File
	for _, o := range objs {
		switch x := o.(type) {
		case *appsv1.Deployment:
			names = append(names, "Deployment "+x.Name)
		case *corev1.Service:
			names = append(names, "Service "+x.Name)
			if x.Name != "pd-router" && x.Spec.Selector[v1alpha1.LabelKVRevision] != rev {
				t.Errorf("Service %s selects %v, want revision %s only", x.Name, x.Spec.Selector, rev)
			}
		case *corev1.ConfigMap:
			if data, ok := x.Data[routerconfig.FileName]; ok {
				if err := json.Unmarshal([]byte(data), &file); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	want := []string{"Deployment pd-prefill-" + rev, "Service pd-prefill-" + rev, "Deployment pd-decode-" + rev, "Service pd-decode-" + rev, "Deployment pd-router", "Service pd-router"}
	if d := cmp.Diff(want, names); d != "" {
		t.Errorf("rendered (-want +got):\n%s", d)
	}
	update := routerconfig.RevisionHosts{Revision: rev, PrefillHost: "pd-prefill-" + rev + ".ns.svc", DecodeHost: "pd-decode-" + rev + ".ns.svc"}
	if d := cmp.Diff([]routerconfig.RevisionHosts{old, update}, file.Revisions); d != "" {
		t.Errorf("router.json revisions (-want +got):\n%s", d)
	}
	if file.PrefillHost != update.PrefillHost || file.DecodeHost != update.DecodeHost {
		t.Errorf("router.json hosts %s, %s: want the update revision's", file.PrefillHost, file.DecodeHost)
	}
}

// A rollout's step is render's input: the update revision's engine Deployments run the step's
// replicas, and nothing else changes (the reconciler rewrites nothing after render, so
// RenderServing is what it applies).
func TestRenderServingTakesTheRolloutStep(t *testing.T) {
	pdc := revisionBase() // prefill 2, decode 1
	old := routerconfig.RevisionHosts{Revision: "0123456789", PrefillHost: "pd-prefill.ns.svc", DecodeHost: "pd-decode.ns.svc"}
	serving := Serving{Suffixed: true, Old: []routerconfig.RevisionHosts{old}}
	plain, err := RenderServing(pdc, DefaultOptions(), serving)
	if err != nil {
		t.Fatal(err)
	}
	serving.Step = &rollout.Counts{Prefill: 1, Decode: 0}
	stepped, err := RenderServing(pdc, DefaultOptions(), serving)
	if err != nil {
		t.Fatal(err)
	}
	replicas := map[string]int32{}
	for i, o := range stepped {
		if d, ok := o.(*appsv1.Deployment); ok {
			replicas[d.Labels[v1alpha1.LabelRole]] = *d.Spec.Replicas
			pd := plain[i].(*appsv1.Deployment).DeepCopy()
			pd.Spec.Replicas = d.Spec.Replicas
			if diff := cmp.Diff(pd, d); diff != "" {
				t.Errorf("Deployment %s differs beyond its replicas (-without +with the step):\n%s", d.Name, diff)
			}
			continue
		}
		if diff := cmp.Diff(plain[i], o); diff != "" {
			t.Errorf("%s changed with the step (-without +with):\n%s", o.GetName(), diff)
		}
	}
	if d := cmp.Diff(map[string]int32{"prefill": 1, "decode": 0, "router": 1}, replicas); d != "" {
		t.Errorf("replicas with the step (-want +got):\n%s", d)
	}
}

// TestRenderPairing: each pool prefers the other's domains, each pool of the update and the
// older revision gets a Service per domain, router.json lists them per revision, and a
// user's affinity is kept, not changed in place.
func TestRenderPairing(t *testing.T) {
	pdc := revisionBase()
	pdc.Spec.Scheduling.Pairing = &v1alpha1.PairingSpec{TopologyKey: "example.com/rack", Mode: v1alpha1.PairingPreferred}
	user := &corev1.Affinity{PodAffinity: &corev1.PodAffinity{PreferredDuringSchedulingIgnoredDuringExecution: []corev1.WeightedPodAffinityTerm{{Weight: 1, PodAffinityTerm: corev1.PodAffinityTerm{TopologyKey: "zone"}}}}}
	pdc.Spec.Engine.Pod = &v1alpha1.PodSettings{Affinity: user}
	rev, err := KVRevision(pdc)
	if err != nil {
		t.Fatal(err)
	}
	old := routerconfig.RevisionHosts{Revision: "0123456789", PrefillHost: "pd-prefill.ns.svc", DecodeHost: "pd-decode.ns.svc"}
	objs, err := RenderServing(pdc, DefaultOptions(), Serving{Suffixed: true, Old: []routerconfig.RevisionHosts{old}, Domains: []string{"r1", "r2"}})
	if err != nil {
		t.Fatal(err)
	}
	var domainSvcs []string
	var file routerconfig.File
	for _, o := range objs {
		switch x := o.(type) {
		case *appsv1.Deployment:
			if x.Name == "pd-router" {
				continue
			}
			terms := x.Spec.Template.Spec.Affinity.PodAffinity.PreferredDuringSchedulingIgnoredDuringExecution
			if len(terms) != 2 || terms[0].PodAffinityTerm.TopologyKey != "zone" || terms[1].PodAffinityTerm.TopologyKey != "example.com/rack" {
				t.Errorf("%s pod affinity %+v: want the user's term and the rack preference", x.Name, terms)
			}
		case *corev1.Service:
			if d := x.Labels[v1alpha1.LabelDomain]; d != "" {
				domainSvcs = append(domainSvcs, x.Name)
				if x.Spec.Selector[v1alpha1.LabelDomain] != d {
					t.Errorf("Service %s of domain %s selects %v", x.Name, d, x.Spec.Selector)
				}
			}
		case *corev1.ConfigMap:
			if data, ok := x.Data[routerconfig.FileName]; ok {
				if err := json.Unmarshal([]byte(data), &file); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	if len(user.PodAffinity.PreferredDuringSchedulingIgnoredDuringExecution) != 1 {
		t.Error("render changed the user's affinity in place")
	}
	if len(domainSvcs) != 8 {
		t.Errorf("domain Services %v: want 2 domains x 2 pools x 2 revisions", domainSvcs)
	}
	if file.Pairing == nil || file.Pairing.Mode != routerconfig.PairingPreferred || len(file.Domains) != 0 || len(file.Revisions) != 2 {
		t.Fatalf("router.json %+v: want pairing, the domains per revision", file)
	}
	for _, r := range file.Revisions {
		if len(r.Domains) != 2 || r.Domains[0].Domain != "r1" {
			t.Errorf("revision %s domains %+v", r.Revision, r.Domains)
		}
	}
	if got := file.Revisions[1].Domains[1].DecodeHost; got != DomainServiceName("pd-decode-"+rev, "r2")+".ns.svc" {
		t.Errorf("update revision's r2 decode host %s", got)
	}
}
