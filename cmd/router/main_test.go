package main

import (
	"testing"

	"k8s.io/utils/ptr"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

// The operator starts this command with the arguments render puts in the router Deployment;
// every one of them must be a flag it defines.
func TestAcceptsTheRenderedArguments(t *testing.T) {
	pdc := &v1alpha1.PDCluster{Spec: v1alpha1.PDClusterSpec{Router: v1alpha1.RouterSpec{Replicas: ptr.To[int32](1)}}}
	pdc.Name, pdc.Namespace = "c", "ns"
	cm, err := render.RouterConfigMap(pdc)
	if err != nil {
		t.Fatal(err)
	}
	dep, err := render.RouterDeployment(pdc, render.DefaultOptions(), cm)
	if err != nil {
		t.Fatal(err)
	}
	args := dep.Spec.Template.Spec.Containers[0].Args
	o, err := parseFlags(args)
	if err != nil {
		t.Fatalf("rendered router args %v: %v", args, err)
	}
	if o.configPath == "" {
		t.Errorf("rendered router args %v name no --config", args)
	}
	if _, err := parseFlags([]string{"--no-such-flag"}); err == nil {
		t.Error("an unknown flag was accepted")
	}
}
