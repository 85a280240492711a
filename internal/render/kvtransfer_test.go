package render_test

import (
	"strings"
	"testing"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

func TestTCPRequestsNoRDMA(t *testing.T) {
	pdc := load(t, "testdata/nixl-tcp.yaml")
	c := engineContainer(t, pdc, v1alpha1.RoleDecode)
	if _, ok := c.Resources.Requests["rdma/hca"]; ok {
		t.Errorf("tcp pool requests rdma/hca: %v", c.Resources.Requests)
	}
	if got := c.Resources.Limits[v1alpha1.GPUResourceName]; got.Value() != 8 {
		t.Errorf("GPU limit = %s, want 8 (tensor 2 x data 4)", got.String())
	}
	for _, f := range []string{"--enable-expert-parallel", "--no-enable-prefix-caching", "--max-num-seqs=256"} {
		if !contains(c.Args, f) {
			t.Errorf("decode args %v lack %s", c.Args, f)
		}
	}
	if contains(engineContainer(t, pdc, v1alpha1.RolePrefill).Args, "--max-num-seqs=256") {
		t.Error("decode-only args leaked into prefill")
	}
}

func TestExtraConfigMayNotSetOperatorKeys(t *testing.T) {
	pdc := load(t, "testdata/mooncake-rdma.yaml")
	pdc.Spec.KVTransfer.ExtraConfig = &apiextensionsv1.JSON{Raw: []byte(`{"device_name":"mlx5_9"}`)}
	_, err := render.Render(pdc, render.DefaultOptions())
	if err == nil || !strings.Contains(err.Error(), "spec.kvTransfer.extraConfig[device_name]: Forbidden: set by the operator from spec.kvTransfer.rdmaDevices") {
		t.Errorf("err = %v, want the reserved-key error", err)
	}
}
