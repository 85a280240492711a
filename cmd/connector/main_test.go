package main

import (
	"testing"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

// The operator starts this command with the arguments render puts in the sidecar; every one
// must be a flag it defines, and the local API must be the one the engine is told to use.
func TestAcceptsTheRenderedSidecarArguments(t *testing.T) {
	pdc := &v1alpha1.PDCluster{}
	pdc.Name, pdc.Namespace = "c", "ns"
	for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode} {
		dep, err := render.EngineDeployment(pdc, render.DefaultOptions(), role)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range dep.Spec.Template.Spec.Containers {
			if c.Name != v1alpha1.ConnectorContainerName {
				continue
			}
			_, o, err := parseFlags(c.Args)
			if err != nil {
				t.Fatalf("%s sidecar args %v: %v", role, c.Args, err)
			}
			if o.listen != render.ConnectorSocket || o.kvPath == "" || o.blocks <= 0 {
				t.Errorf("%s sidecar: listen %q, kv file %q, %d blocks", role, o.listen, o.kvPath, o.blocks)
			}
		}
	}
	if _, _, err := parseFlags([]string{"--no-such-flag"}); err == nil {
		t.Error("an unknown flag was accepted")
	}
}
