package validation

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
)

const minimal = `
apiVersion: serving.pdcluster.dev/v1alpha1
kind: PDCluster
metadata: {name: tiny}
spec:
  model: {path: facebook/opt-125m}
  engine: {image: vllm/vllm-openai:v0.11.0}
  kvTransfer: {protocol: tcp}
`

func loader(t *testing.T) *Loader {
	t.Helper()
	l, err := NewLoader()
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// The CRD's +kubebuilder:default markers and the Go Default* constants that render falls back
// on must agree; admission of a minimal spec shows what the apiserver fills in.
func TestAdmitAppliesCRDDefaults(t *testing.T) {
	doc, err := loader(t).Admit(context.Background(), []byte(minimal))
	if err != nil {
		t.Fatal(err)
	}
	defaultPool := v1alpha1.PoolSpec{ // replicas has no default: see SetDefaults
		Parallelism: v1alpha1.Parallelism{
			Tensor: ptr.To(v1alpha1.DefaultParallelism), Data: ptr.To(v1alpha1.DefaultParallelism), Pipeline: ptr.To(v1alpha1.DefaultParallelism), Nodes: ptr.To(v1alpha1.DefaultParallelism),
		},
		RDMA:  v1alpha1.RDMASpec{ResourceName: v1alpha1.DefaultRDMAResourceName, Count: ptr.To(v1alpha1.DefaultRDMACount)},
		Drain: v1alpha1.DrainSpec{TimeoutSeconds: ptr.To(v1alpha1.DefaultDrainTimeoutSeconds)},
	}
	want := v1alpha1.PDClusterSpec{
		Model: v1alpha1.ModelSpec{Path: "facebook/opt-125m"},
		Engine: v1alpha1.EngineSpec{
			Image: "vllm/vllm-openai:v0.11.0", BlockSize: ptr.To(v1alpha1.DefaultBlockSize), EnablePrefixCaching: ptr.To(true),
		},
		KVTransfer: v1alpha1.KVTransferSpec{
			Connector: v1alpha1.ConnectorMooncake, Protocol: v1alpha1.ProtocolTCP,
			BufferDevice: v1alpha1.BufferDeviceCUDA, LoadFailurePolicy: v1alpha1.LoadFailurePolicyFail, CompletionGate: v1alpha1.CompletionGateEnabled,
			Verification: v1alpha1.KVVerification{
				Mode: v1alpha1.KVVerificationPassive, CanaryIntervalSeconds: ptr.To(v1alpha1.DefaultCanaryIntervalSeconds),
				WindowSeconds:           ptr.To(v1alpha1.DefaultVerificationWindowSeconds),
				MinExternalSharePercent: ptr.To(v1alpha1.DefaultMinExternalSharePercent),
			},
		},
		Prefill: defaultPool,
		Decode:  defaultPool,
		Scaling: v1alpha1.ScalingSpec{
			Prefill: v1alpha1.PoolScalingSpec{Mode: v1alpha1.ScalingStatic, MinReplicas: ptr.To(v1alpha1.DefaultMinReplicas)},
			Decode:  v1alpha1.PoolScalingSpec{Mode: v1alpha1.ScalingStatic, MinReplicas: ptr.To(v1alpha1.DefaultMinReplicas)},
		},
		Rollout: v1alpha1.RolloutSpec{MaxSurge: ptr.To(intstr.FromString("25%")), MaxUnavailable: ptr.To(intstr.FromString("25%"))},
		Router: v1alpha1.RouterSpec{Replicas: ptr.To(v1alpha1.DefaultReplicas), Balance: v1alpha1.RouterBalanceLeastInFlight,
			Routing: v1alpha1.RouterRouting{Strategy: v1alpha1.RoutingLeastInFlight},
			FailurePolicy: v1alpha1.RouterFailurePolicy{
				Retries: ptr.To(v1alpha1.DefaultRouterRetries), RetryBudgetPercent: ptr.To(v1alpha1.DefaultRouterRetryBudgetPercent),
				EjectSeconds: ptr.To(v1alpha1.DefaultRouterEjectSeconds), ConsecutiveFailures: ptr.To(v1alpha1.DefaultRouterConsecutiveFailures), OnPrefillFailure: v1alpha1.OnPrefillFailureRetry,
			}},
		Connector: v1alpha1.ConnectorSpec{
			Health: v1alpha1.ConnectorHealthPolicy{
				PeriodSeconds: ptr.To(v1alpha1.DefaultHealthPeriodSeconds), FailureThreshold: ptr.To(v1alpha1.DefaultHealthFailureThreshold),
				InitialBackoffSeconds: ptr.To(v1alpha1.DefaultInitialBackoffSeconds), MaxBackoffSeconds: ptr.To(v1alpha1.DefaultMaxBackoffSeconds),
				RestartBudget: ptr.To(v1alpha1.DefaultRestartBudget), BudgetWindowSeconds: ptr.To(v1alpha1.DefaultBudgetWindowSeconds),
				RestartDecodeWithPrefill: ptr.To(true), DecodeCascadeBudget: ptr.To(v1alpha1.DefaultDecodeCascadeBudget),
			},
		},
		NetworkPolicy: v1alpha1.NetworkPolicySpec{Enabled: ptr.To(true), Egress: v1alpha1.EngineEgressSpec{Enabled: ptr.To(true), PublicHTTPS: ptr.To(true)}},
		Scheduling:    v1alpha1.SchedulingSpec{Gang: v1alpha1.GangAuto},
	}
	if diff := cmp.Diff(want, doc.PDCluster.Spec); diff != "" {
		t.Errorf("defaulted spec (-want +got):\n%s", diff)
	}
	if doc.PDCluster.Namespace != "default" {
		t.Errorf("namespace = %q, want default", doc.PDCluster.Namespace)
	}
}

// invalidSpecs are bad manifests with what the error must say.
var invalidSpecs = []struct {
	name string
	doc  string   // a whole manifest
	want []string // substrings of the error: the field path and the user-facing message
}{
	{
		name: "rdma protocol without devices",
		doc:  strings.Replace(minimal, "kvTransfer: {protocol: tcp}", "kvTransfer: {protocol: rdma}", 1),
		want: []string{"spec.kvTransfer", "rdmaDevices must list at least one RDMA device"},
	},
	{
		name: "rdma is the default protocol, so devices are required by default",
		doc:  strings.Replace(minimal, "  kvTransfer: {protocol: tcp}\n", "", 1),
		want: []string{"spec.kvTransfer", "rdmaDevices must list"},
	},
	{
		name: "rdma devices with tcp mean nothing",
		doc:  strings.Replace(minimal, "kvTransfer: {protocol: tcp}", "kvTransfer: {protocol: tcp, rdmaDevices: [mlx5_0]}", 1),
		want: []string{"spec.kvTransfer", "rdmaDevices is only used with protocol rdma"},
	},
	{
		name: "decode-only fallback with a load failure policy that forbids recompute",
		doc:  minimal + "  router: {failurePolicy: {onPrefillFailure: DecodeOnly}}\n",
		want: []string{"spec.router.failurePolicy.onPrefillFailure", "DecodeOnly lets decode recompute prompts"},
	},
	{
		name: "prefix-aware routing with round robin",
		doc:  minimal + "  router: {balance: round-robin, routing: {strategy: PrefixAware}}\n",
		want: []string{"spec.router.routing.strategy", "PrefixAware or KVEvents bounds each engine's load by the router's requests in flight on it: it needs balance least-in-flight"},
	},
	{
		name: "kv-events routing with round robin",
		doc:  minimal + "  router: {balance: round-robin, routing: {strategy: KVEvents}}\n",
		want: []string{"spec.router.routing.strategy", "it needs balance least-in-flight"},
	},
	{
		name: "kv-events routing without prefix caching",
		doc:  strings.Replace(minimal, "engine: {image: vllm/vllm-openai:v0.11.0}", "engine: {image: vllm/vllm-openai:v0.11.0, enablePrefixCaching: false}", 1) + "  router: {routing: {strategy: KVEvents}}\n",
		want: []string{"spec.router.routing.strategy", "KVEvents routes by the blocks the engines' prefix caches hold: it needs engine.enablePrefixCaching true"},
	},
	{
		name: "kv-events routing for replicas across pods",
		doc:  minimal + "  decode: {parallelism: {tensor: 2, nodes: 2}}\n  router: {routing: {strategy: KVEvents}}\n",
		want: []string{"spec.router.routing.strategy", "a replica across pods (parallelism.nodes above 1) numbers from its first pod: use PrefixAware for such pools"},
	},
	{
		name: "kv-events routing for prefill replicas across pods",
		doc:  minimal + "  prefill: {parallelism: {tensor: 2, nodes: 2}}\n  router: {routing: {strategy: KVEvents}}\n",
		want: []string{"spec.router.routing.strategy", "a replica across pods (parallelism.nodes above 1) numbers from its first pod: use PrefixAware for such pools"},
	},
	{
		name: "kv-events settings without the strategy",
		doc:  minimal + "  router: {routing: {strategy: PrefixAware, kvEvents: {blocksPerEngine: 4096}}}\n",
		want: []string{"spec.router.routing.kvEvents", "kvEvents tunes strategy KVEvents"},
	},
	{
		name: "prefix-aware settings without the strategy",
		doc:  minimal + "  router: {routing: {prefixAware: {loadSlack: 4}}}\n",
		want: []string{"spec.router.routing.prefixAware", "prefixAware tunes strategies PrefixAware and KVEvents"},
	},
	{
		name: "a prefix chunk too small",
		doc:  minimal + "  router: {routing: {strategy: PrefixAware, prefixAware: {chunkBytes: 8}}}\n",
		want: []string{"spec.router.routing.prefixAware.chunkBytes", "should be greater than or equal to 16"},
	},
	{
		name: "minReplicas above maxReplicas",
		doc:  minimal + "  scaling: {prefill: {mode: External, minReplicas: 5, maxReplicas: 2}}\n",
		want: []string{"spec.scaling.prefill", "minReplicas may not exceed maxReplicas"},
	},
	{
		name: "ratio min above max",
		doc:  minimal + "  scaling: {ratio: {min: \"2\", max: \"0.5\"}}\n",
		want: []string{"spec.scaling.ratio", "ratio.min may not exceed ratio.max"},
	},
	{
		name: "ratio of 0",
		doc:  minimal + "  scaling: {ratio: {min: \"0\"}}\n",
		want: []string{"spec.scaling.ratio.min", "ratio.min must be above 0"},
	},
	{
		name: "ratio with three decimals",
		doc:  minimal + "  scaling: {ratio: {max: \"0.125\"}}\n",
		want: []string{"spec.scaling.ratio.max", "should match"},
	},
	{
		name: "unknown scaling mode",
		doc:  minimal + "  scaling: {decode: {mode: HPA}}\n",
		want: []string{"spec.scaling.decode.mode", "Unsupported value"},
	},
	{
		name: "retry budget past 100%",
		doc:  minimal + "  router: {failurePolicy: {retryBudgetPercent: 150}}\n",
		want: []string{"spec.router.failurePolicy.retryBudgetPercent", "less than or equal to 100"},
	},
	{
		name: "operator-owned flag in engine args",
		doc:  strings.Replace(minimal, "{image: vllm/vllm-openai:v0.11.0}", `{image: x, args: ["--max-model-len=4096", "--block-size=32"]}`, 1),
		want: []string{"spec.engine.args", "flag --block-size=32 is set by the operator"},
	},
	{
		name: "operator-owned short flag in pool args",
		doc:  minimal + "  decode: {args: [\"-tp\", \"4\"]}\n",
		want: []string{"spec.decode.args", "flag -tp is set by the operator"},
	},
	{
		name: "underscore spelling of an owned flag",
		doc:  minimal + "  prefill: {args: [\"--kv_transfer_config={}\"]}\n",
		want: []string{"spec.prefill.args", "flag --kv_transfer_config={} is set by the operator"},
	},
	// vLLM's parser takes a unique abbreviation of a long flag and a JSON flag's keys after a
	// dot (checked with vLLM 0.30.0): each still names a flag the operator sets (issue 56).
	{
		name: "an abbreviated owned flag",
		doc:  minimal + "  prefill: {args: [\"--kv-transfer-conf={}\"]}\n",
		want: []string{"spec.prefill.args", "flag --kv-transfer-conf={} is set by the operator"},
	},
	{
		name: "an owned flag's key after a dot",
		doc:  minimal + "  decode: {args: [\"--kv-transfer-config.kv_connector=X\"]}\n",
		want: []string{"spec.decode.args", "flag --kv-transfer-config.kv_connector=X is set by the operator"},
	},
	{
		name: "an abbreviated block size",
		doc:  strings.Replace(minimal, "{image: vllm/vllm-openai:v0.11.0}", `{image: x, args: ["--block-siz=32"]}`, 1),
		want: []string{"spec.engine.args", "flag --block-siz=32 is set by the operator"},
	},
	{
		name: "the KV events publisher",
		doc:  minimal + "  decode: {args: [\"--kv-events-config\", \"{}\"]}\n",
		want: []string{"spec.decode.args", "flag --kv-events-config is set by the operator"},
	},
	{
		name: "a multi-node rank",
		doc:  minimal + "  decode: {args: [\"--node-rank=1\"]}\n",
		want: []string{"spec.decode.args", "flag --node-rank=1 is set by the operator"},
	},
	{
		name: "the operator's socket directory with a trailing slash",
		doc:  minimal + "  decode: {pod: {volumes: [{name: x, emptyDir: {}}], volumeMounts: [{name: x, mountPath: /var/run/pdcluster/}]}}\n",
		want: []string{"spec.decode.pod", "volumeMounts may not use /dev/shm, /var/run/pdcluster"},
	},
	{
		name: "the sidecar's control socket mounted in the engine",
		doc:  minimal + "  prefill: {pod: {volumeMounts: [{name: connector-ctl, mountPath: /ctl}]}}\n",
		want: []string{"spec.prefill.pod", "volumeMounts may not mount connector-ctl"},
	},
	{
		name: "connector backoff cap below its start",
		doc:  minimal + "  connector: {health: {initialBackoffSeconds: 60, maxBackoffSeconds: 10}}\n",
		want: []string{"spec.connector.health", "maxBackoffSeconds must be at least initialBackoffSeconds"},
	},
	{
		name: "connector failure threshold of zero",
		doc:  minimal + "  connector: {health: {failureThreshold: 0}}\n",
		want: []string{"spec.connector.health.failureThreshold", "greater than or equal to 1"},
	},
	{
		name: "negative replicas",
		doc:  minimal + "  decode: {replicas: -1}\n",
		want: []string{"spec.decode.replicas", "should be greater than or equal to 0"},
	},
	{
		name: "zero tensor parallelism",
		doc:  minimal + "  prefill: {parallelism: {tensor: 0}}\n",
		want: []string{"spec.prefill.parallelism.tensor", "greater than or equal to 1"},
	},
	{
		name: "unknown connector",
		doc:  strings.Replace(minimal, "{protocol: tcp}", "{protocol: tcp, connector: LMCacheConnector}", 1),
		want: []string{"spec.kvTransfer.connector", `Unsupported value: "LMCacheConnector"`, "MooncakeConnector"},
	},
	{
		name: "block size not supported by vLLM",
		doc:  strings.Replace(minimal, "{image: vllm/vllm-openai:v0.11.0}", "{image: x, blockSize: 48}", 1),
		want: []string{"spec.engine.blockSize", "Unsupported value: 48"},
	},
	{
		name: "GPUs set by hand",
		doc:  minimal + "  prefill: {resources: {limits: {nvidia.com/gpu: 8}}}\n",
		want: []string{"spec.prefill", "resources.limits may not set nvidia.com/gpu"},
	},
	{
		name: "missing model path",
		doc:  strings.Replace(minimal, "model: {path: facebook/opt-125m}", "model: {servedModelName: x}", 1),
		want: []string{"spec.model.path", "Required value"},
	},
	{
		name: "name too long for child objects",
		doc:  strings.Replace(minimal, "name: tiny", "name: "+strings.Repeat("a", 56), 1),
		want: []string{"metadata.name must be at most 55 characters"},
	},
	{
		name: "name that is not a DNS label",
		doc:  strings.Replace(minimal, "name: tiny", "name: 1tiny", 1),
		want: []string{"metadata.name must start with a lowercase letter"},
	},
	{
		name: "wrong kind",
		doc:  strings.Replace(minimal, "kind: PDCluster", "kind: PDClustr", 1),
		want: []string{`kind "PDClustr"`, "want apiVersion serving.pdcluster.dev/v1alpha1 kind PDCluster"},
	},
	{
		name: "missing name",
		doc:  strings.Replace(minimal, "metadata: {name: tiny}", "metadata: {}", 1),
		want: []string{"metadata.name: Required value"},
	},
}

func TestAdmitRejectsInvalidSpecs(t *testing.T) {
	l := loader(t)
	for _, tc := range invalidSpecs {
		t.Run(tc.name, func(t *testing.T) {
			_, err := l.Admit(context.Background(), []byte(tc.doc))
			if err == nil {
				t.Fatalf("admitted, want an error containing %q", tc.want)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q\ndoes not contain %q", err, w)
				}
			}
			// A rule that could not be evaluated is not the verdict the API server gives.
			if strings.Contains(err.Error(), "invalid data") {
				t.Errorf("error %q: a CEL rule failed to evaluate", err)
			}
		})
	}
}

func TestReadJoinsErrorsOfEveryDocument(t *testing.T) {
	bad := strings.Replace(minimal, "{protocol: tcp}", "{protocol: rdma}", 1)
	in := minimal + "---\n" + bad + "---\n" + strings.Replace(bad, "name: tiny", "name: other", 1)
	docs, err := loader(t).Read(context.Background(), strings.NewReader(in))
	if len(docs) != 1 || docs[0].PDCluster.Name != "tiny" {
		t.Errorf("valid documents = %v, want just tiny", docs)
	}
	var invalid *InvalidError
	if !errors.As(err, &invalid) {
		t.Fatalf("error %v is not an InvalidError", err)
	}
	for _, w := range []string{"document 2", `PDCluster "tiny" is invalid`, "document 3", `PDCluster "other" is invalid`} {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("error %q does not contain %q", err, w)
		}
	}
}

func TestReadReportsPrunedUnknownFields(t *testing.T) {
	docs, err := loader(t).Read(context.Background(), strings.NewReader(minimal+"  decode: {replica: 3}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{"spec.decode.replica"}, docs[0].Pruned); diff != "" {
		t.Errorf("pruned (-want +got):\n%s", diff)
	}
}

func TestReadEmptyInput(t *testing.T) {
	if _, err := loader(t).Read(context.Background(), strings.NewReader("\n---\n")); err == nil || !strings.Contains(err.Error(), "no PDCluster") {
		t.Errorf("err = %v, want 'no PDCluster found'", err)
	}
}
