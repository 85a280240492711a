package validation

import (
	"context"
	"testing"

	"github.com/google/go-cmp/cmp"
	"sigs.k8s.io/yaml"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
)

// Go's SetDefaults and the CRD's +kubebuilder:default markers are two images of one set of
// defaults: the same manifest defaulted by the API server's structural defaulting (the loader)
// and by SetDefaults must come out equal, including fields a user set (never overwritten) and
// defaults inside optional objects (applied only when the object is there).
func TestSetDefaultsMatchesCRD(t *testing.T) {
	cases := map[string]string{
		"minimal": minimal,
		"fields set keep their values": `
apiVersion: serving.pdcluster.dev/v1alpha1
kind: PDCluster
metadata: {name: set}
spec:
  model: {path: m}
  engine: {image: vllm/vllm-openai:v0.11.0, blockSize: 32, enablePrefixCaching: false}
  kvTransfer: {connector: NixlConnector, protocol: tcp, bufferDevice: cpu, loadFailurePolicy: recompute, completionGate: Disabled}
  prefill: {replicas: 3, parallelism: {tensor: 2}, rdma: {resourceName: nvidia.com/hca, count: 2}}
  decode: {replicas: 0, parallelism: {data: 4, pipeline: 2}}
  router: {replicas: 2, balance: round-robin, failurePolicy: {retries: 0, retryBudgetPercent: 0, ejectSeconds: 60, firstTokenTimeoutSeconds: 30, onPrefillFailure: DecodeOnly}}
  connector: {health: {periodSeconds: 5, failureThreshold: 1, initialBackoffSeconds: 1, maxBackoffSeconds: 2, restartBudget: 0, budgetWindowSeconds: 60, restartDecodeWithPrefill: false, gateStartupGraceSeconds: 9}}
  networkPolicy: {enabled: false}
`,
		"defaults inside an optional object": `
apiVersion: serving.pdcluster.dev/v1alpha1
kind: PDCluster
metadata: {name: hf}
spec:
  model: {path: meta-llama/Llama-3.1-8B, huggingFace: {tokenSecret: {name: hf}}}
  engine: {image: vllm/vllm-openai:v0.11.0}
  kvTransfer: {rdmaDevices: [mlx5_0]}
`,
	}
	l := loader(t)
	for name, doc := range cases {
		t.Run(name, func(t *testing.T) {
			admitted, err := l.Admit(context.Background(), []byte(doc))
			if err != nil {
				t.Fatal(err)
			}
			var got v1alpha1.PDCluster
			if err := yaml.UnmarshalStrict([]byte(doc), &got); err != nil {
				t.Fatal(err)
			}
			got.SetDefaults()
			if diff := cmp.Diff(admitted.PDCluster.Spec, got.Spec); diff != "" {
				t.Errorf("SetDefaults differs from the CRD's defaulting (-crd +SetDefaults):\n%s", diff)
			}
		})
	}
}
