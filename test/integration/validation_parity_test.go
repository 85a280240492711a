package integration

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"testing"

	jsonpatch "github.com/evanphx/json-patch/v5"
	"github.com/google/go-cmp/cmp"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/yaml"

	"pdcluster.dev/pdcluster-operator/internal/validation"
)

// parityBase is a valid PDCluster; each case merges a JSON merge patch into it.
const parityBase = `{
  "apiVersion": "serving.pdcluster.dev/v1alpha1", "kind": "PDCluster",
  "metadata": {"name": "parity"},
  "spec": {
    "model": {"path": "facebook/opt-125m"},
    "engine": {"image": "vllm/vllm-openai:v0.11.0"},
    "kvTransfer": {"protocol": "tcp"}
  }
}`

// parityCases are specs the API server must refuse. pdctl validate runs the same defaults,
// schema and CEL from the embedded CRD; this table holds the two to the same verdict and the
// same field and message, error for error.
var parityCases = []struct{ name, patch string }{
	{"prefill replicas negative", `{"spec":{"prefill":{"replicas":-1}}}`},
	{"decode replicas negative", `{"spec":{"decode":{"replicas":-2}}}`},
	{"router replicas negative", `{"spec":{"router":{"replicas":-1}}}`},
	{"tensor parallel zero", `{"spec":{"prefill":{"parallelism":{"tensor":0}}}}`},
	{"tensor parallel above 64", `{"spec":{"decode":{"parallelism":{"tensor":65}}}}`},
	{"data parallel zero", `{"spec":{"decode":{"parallelism":{"data":0}}}}`},
	{"data ranks not a multiple of nodes", `{"spec":{"prefill":{"parallelism":{"data":6,"nodes":4}}}}`},
	{"model across pods not divisible", `{"spec":{"decode":{"parallelism":{"tensor":3,"nodes":2}}}}`},
	{"one data rank per pod without expert", `{"spec":{"decode":{"parallelism":{"data":2,"nodes":2}}}}`},
	{"nodes zero", `{"spec":{"decode":{"parallelism":{"nodes":0}}}}`},
	{"pipeline parallel above 64", `{"spec":{"prefill":{"parallelism":{"pipeline":128}}}}`},
	{"tensor parallel as a string", `{"spec":{"prefill":{"parallelism":{"tensor":"two"}}}}`},
	{"replicas fractional", `{"spec":{"decode":{"replicas":1.5}}}`},
	{"block size not a power vLLM takes", `{"spec":{"engine":{"blockSize":48}}}`},
	{"block size zero", `{"spec":{"engine":{"blockSize":0}}}`},
	{"empty image", `{"spec":{"engine":{"image":""}}}`},
	{"no engine image", `{"spec":{"engine":{"image":null}}}`},
	{"empty model path", `{"spec":{"model":{"path":""}}}`},
	{"no model", `{"spec":{"model":null}}`},
	{"served model name too long", fmt.Sprintf(`{"spec":{"model":{"servedModelName":%q}}}`, string(make([]byte, 0))+longString(257))},
	{"unknown connector", `{"spec":{"kvTransfer":{"connector":"LMCacheConnectorV1"}}}`},
	{"unknown protocol", `{"spec":{"kvTransfer":{"protocol":"roce"}}}`},
	{"unknown buffer device", `{"spec":{"kvTransfer":{"bufferDevice":"tpu"}}}`},
	{"unknown load failure policy", `{"spec":{"kvTransfer":{"loadFailurePolicy":"retry"}}}`},
	{"unknown completion gate value", `{"spec":{"kvTransfer":{"completionGate":"Off"}}}`},
	{"rdma without devices", `{"spec":{"kvTransfer":{"protocol":"rdma"}}}`},
	{"rdma is the default and needs devices", `{"spec":{"kvTransfer":{"protocol":null}}}`},
	{"rdma devices with tcp", `{"spec":{"kvTransfer":{"rdmaDevices":["mlx5_0"]}}}`},
	{"empty rdma device name", `{"spec":{"kvTransfer":{"protocol":"rdma","rdmaDevices":[""]}}}`},
	{"duplicate rdma devices", `{"spec":{"kvTransfer":{"protocol":"rdma","rdmaDevices":["mlx5_0","mlx5_0"]}}}`},
	{"extra config not an object", `{"spec":{"kvTransfer":{"extraConfig":"num_workers=10"}}}`},
	{"operator flag in engine args", `{"spec":{"engine":{"args":["--block-size=32"]}}}`},
	{"operator short flag in pool args", `{"spec":{"decode":{"args":["-tp","4"]}}}`},
	{"underscore spelling of an operator flag", `{"spec":{"prefill":{"args":["--kv_transfer_config={}"]}}}`},
	{"port flag in pool args", `{"spec":{"prefill":{"args":["--port=9000"]}}}`},
	{"GPU limit set by hand", `{"spec":{"decode":{"resources":{"limits":{"nvidia.com/gpu":"4"}}}}}`},
	{"GPU request set by hand", `{"spec":{"prefill":{"resources":{"requests":{"nvidia.com/gpu":"1"}}}}}`},
	{"rdma count zero", `{"spec":{"prefill":{"rdma":{"count":0}}}}`},
	{"empty rdma resource name", `{"spec":{"decode":{"rdma":{"resourceName":""}}}}`},
	{"health period zero", `{"spec":{"connector":{"health":{"periodSeconds":0}}}}`},
	{"health failure threshold zero", `{"spec":{"connector":{"health":{"failureThreshold":0}}}}`},
	{"backoff cap below its start", `{"spec":{"connector":{"health":{"initialBackoffSeconds":60,"maxBackoffSeconds":10}}}}`},
	{"budget window below a minute", `{"spec":{"connector":{"health":{"budgetWindowSeconds":30}}}}`},
	{"restart budget above 100", `{"spec":{"connector":{"health":{"restartBudget":101}}}}`},
	{"name too long for its children", fmt.Sprintf(`{"metadata":{"name":%q}}`, "a"+longString(55))},
	{"name with a dot", `{"metadata":{"name":"qwen.3"}}`},
	{"name with capitals", `{"metadata":{"name":"Qwen"}}`},
	{"two faults at once", `{"spec":{"prefill":{"replicas":-1},"engine":{"blockSize":7}}}`},
	{"two model sources", `{"spec":{"model":{"pvc":{"claimName":"models"},"hostPath":{"path":"/mnt/models"}}}}`},
	{"absolute model path inside a volume", `{"spec":{"model":{"path":"/models/qwen","pvc":{"claimName":"models"}}}}`},
	{"model claim name with capitals", `{"spec":{"model":{"pvc":{"claimName":"Models"}}}}`},
	{"model sub-path escaping the volume", `{"spec":{"model":{"pvc":{"claimName":"models","subPath":"a/../../etc"}}}}`},
	{"relative host path", `{"spec":{"model":{"hostPath":{"path":"mnt/models"}}}}`},
	{"token secret name with an underscore", `{"spec":{"model":{"huggingFace":{"tokenSecret":{"name":"hf_token"}}}}}`},
	{"token secret key with a slash", `{"spec":{"model":{"huggingFace":{"tokenSecret":{"name":"hf","key":"a/b"}}}}}`},
	{"disruption budget with both bounds", `{"spec":{"decode":{"disruptionBudget":{"maxUnavailable":1,"minAvailable":1}}}}`},
	{"disruption budget with neither bound", `{"spec":{"prefill":{"disruptionBudget":{}}}}`},
	{"node selector key with a space", `{"spec":{"prefill":{"nodeSelector":{"gpu pool":"true"}}}}`},
	{"node selector value with a slash", `{"spec":{"decode":{"nodeSelector":{"pool":"a/b"}}}}`},
	{"node selector value too long", fmt.Sprintf(`{"spec":{"decode":{"nodeSelector":{"pool":%q}}}}`, longString(64))},
	{"router node selector key with two slashes", `{"spec":{"router":{"nodeSelector":{"a/b/c":"x"}}}}`},
	{"rdma resource name without a domain", `{"spec":{"prefill":{"rdma":{"resourceName":"hca"}}}}`},
	{"rdma resource name in kubernetes.io", `{"spec":{"prefill":{"rdma":{"resourceName":"kubernetes.io/hca"}}}}`},
	{"env the operator sets", `{"spec":{"engine":{"pod":{"env":[{"name":"VLLM_NIXL_SIDE_CHANNEL_HOST","value":"localhost"}]}}}}`},
	{"pool env the operator sets", `{"spec":{"decode":{"pod":{"env":[{"name":"PYTHONPATH","value":"/x"}]}}}}`},
	{"duplicate env names", `{"spec":{"engine":{"pod":{"env":[{"name":"A","value":"1"},{"name":"A","value":"2"}]}}}}`},
	{"a selector label", `{"spec":{"prefill":{"pod":{"labels":{"serving.pdcluster.dev/role":"decode"}}}}}`},
	{"an operator annotation", `{"spec":{"engine":{"pod":{"annotations":{"serving.pdcluster.dev/config-hash":"x"}}}}}`},
	{"grace period shorter than the drain", `{"spec":{"engine":{"pod":{"terminationGracePeriodSeconds":5}}}}`},
	{"a volume with the operator's name", `{"spec":{"decode":{"pod":{"volumes":[{"name":"dshm","emptyDir":{}}]}}}}`},
	{"a mount over the operator's", `{"spec":{"engine":{"pod":{"volumeMounts":[{"name":"x","mountPath":"/models"}]}}}}`},
	{"topology spread without a key", `{"spec":{"engine":{"pod":{"topologySpreadConstraints":[{"maxSkew":1,"whenUnsatisfiable":"DoNotSchedule"}]}}}}`},
	{"both cache kinds", `{"spec":{"model":{"huggingFace":{"cacheClaimName":"hf","cacheSizeLimit":"10Gi"}}}}`},
	// The routing rules: each of the five CEL rules on spec.router.routing and what it needs.
	{"prefix routing with round-robin balance", `{"spec":{"router":{"balance":"round-robin","routing":{"strategy":"PrefixAware"}}}}`},
	{"prefixAware tuning without its strategy", `{"spec":{"router":{"routing":{"strategy":"LeastInFlight","prefixAware":{"maxChunks":8}}}}}`},
	{"kvEvents tuning with PrefixAware", `{"spec":{"router":{"routing":{"strategy":"PrefixAware","kvEvents":{"blocksPerEngine":2048}}}}}`},
	{"KVEvents without prefix caching", `{"spec":{"engine":{"enablePrefixCaching":false},"router":{"routing":{"strategy":"KVEvents"}}}}`},
	{"KVEvents with a replica across pods", `{"spec":{"decode":{"parallelism":{"tensor":2,"nodes":2}},"router":{"routing":{"strategy":"KVEvents"}}}}`},
}

func longString(n int) string {
	b := make([]byte, n)
	for i := range b {
		b[i] = 'a'
	}
	return string(b)
}

// The same bad specs, through pdctl's validation and through the API server (envtest), give the
// same errors: same fields, same messages.
func TestPdctlAndAPIServerAgree(t *testing.T) {
	if len(parityCases) < 40 {
		t.Fatalf("%d cases; the table promises at least 40", len(parityCases))
	}
	f := newFixture(t)
	loader, err := validation.NewLoader()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range parityCases {
		t.Run(tc.name, func(t *testing.T) {
			doc, err := jsonpatch.MergePatch([]byte(parityBase), []byte(tc.patch))
			if err != nil {
				t.Fatal(err)
			}
			manifest, err := yaml.JSONToYAML(doc)
			if err != nil {
				t.Fatal(err)
			}
			_, pdctlErr := loader.Admit(context.Background(), manifest)
			var invalid *validation.InvalidError
			if !errors.As(pdctlErr, &invalid) {
				t.Fatalf("pdctl: %v, want the spec refused as invalid", pdctlErr)
			}
			var pdctl []string
			for _, e := range invalid.Errors {
				pdctl = append(pdctl, e.Field+": "+e.ErrorBody())
			}

			var obj unstructured.Unstructured
			if err := json.Unmarshal(doc, &obj.Object); err != nil {
				t.Fatal(err)
			}
			obj.SetNamespace(f.ns)
			apiErr := f.c.Create(f.ctx, &obj)
			var status *apierrors.StatusError
			if !errors.As(apiErr, &status) || !apierrors.IsInvalid(apiErr) {
				t.Fatalf("API server: %v, want Invalid", apiErr)
			}
			var api []string
			if d := status.ErrStatus.Details; d != nil {
				for _, c := range d.Causes {
					api = append(api, c.Field+": "+c.Message)
				}
			}
			slices.Sort(pdctl)
			slices.Sort(api)
			if d := cmp.Diff(api, pdctl); d != "" {
				t.Errorf("errors differ (-API server +pdctl):\n%s", d)
			}
		})
	}
}
