package main

import (
	"bytes"
	"maps"
	"os"
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	appsv1 "k8s.io/api/apps/v1"
	"sigs.k8s.io/yaml"

	"pdcluster.dev/pdcluster-operator/controllers"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

// Both sides of the operator-namespace seam: config/manager hands the manager its namespace
// through the downward API as POD_NAMESPACE, and the binary reads that variable into the
// render options (the NetworkPolicies admit the sidecars' port from it). The fallback is the
// default install's namespace, so an end-to-end test in that namespace could not tell.
func TestManagerReadsItsNamespaceFromTheManifest(t *testing.T) {
	b, err := os.ReadFile("../../config/manager/manager.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var dep appsv1.Deployment
	for doc := range bytes.SplitSeq(b, []byte("\n---\n")) {
		var meta struct{ Kind string }
		if err := yaml.Unmarshal(doc, &meta); err != nil {
			t.Fatal(err)
		}
		if meta.Kind == "Deployment" {
			if err := yaml.UnmarshalStrict(doc, &dep); err != nil {
				t.Fatal(err)
			}
		}
	}
	if len(dep.Spec.Template.Spec.Containers) == 0 {
		t.Fatal("no manager Deployment in config/manager/manager.yaml")
	}
	const installedIn = "serving-operators" // not the default
	env := map[string]string{}
	for _, c := range dep.Spec.Template.Spec.Containers {
		for _, e := range c.Env {
			if e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "metadata.namespace" {
				env[e.Name] = installedIn // what the kubelet resolves it to
			}
		}
	}
	cases := []struct {
		name string
		args []string
		env  map[string]string
		want string
	}{
		{"the manifest's environment", nil, env, installedIn},
		{"no environment: the default install's namespace", nil, nil, render.DefaultOptions().OperatorNamespace},
		{"the flag wins", []string{"--operator-namespace=other"}, env, "other"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s, err := parseFlags(tc.args, func(k string) string { return tc.env[k] })
			if err != nil {
				t.Fatal(err)
			}
			if s.opts.OperatorNamespace != tc.want {
				t.Errorf("operator namespace %q, want %q (manifest env %v)", s.opts.OperatorNamespace, tc.want, env)
			}
		})
	}
	if _, err := parseFlags([]string{"--no-such-flag"}, os.Getenv); err == nil {
		t.Error("an unknown flag was accepted")
	}
}

// The engine pods' NetworkPolicies admit the sidecars' port from the manager's pods only, by
// the labels config/manager gives them (test/chart checks the chart's).
func TestManagerPodsCarryTheLabelsTheNetworkPoliciesAdmit(t *testing.T) {
	b, err := os.ReadFile("../../config/manager/manager.yaml")
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for doc := range bytes.SplitSeq(b, []byte("\n---\n")) {
		var dep appsv1.Deployment
		if err := yaml.Unmarshal(doc, &dep); err != nil {
			t.Fatal(err)
		}
		if dep.Kind != "Deployment" {
			continue
		}
		found = true
		for k, v := range render.ManagerPodLabels() {
			if got := dep.Spec.Template.Labels[k]; got != v {
				t.Errorf("manager pod label %s=%q, want %q (render.ManagerPodLabels)", k, got, v)
			}
		}
	}
	if !found {
		t.Fatal("no manager Deployment in config/manager/manager.yaml")
	}
}

// /metrics is behind authentication and authorization unless --metrics-secure=false.
func TestMetricsAreSecureByDefault(t *testing.T) {
	for _, tc := range []struct {
		args   []string
		secure bool
	}{{nil, true}, {[]string{"--metrics-secure=false"}, false}} {
		s, err := parseFlags(tc.args, func(string) string { return "" })
		if err != nil {
			t.Fatal(err)
		}
		o := metricsOptions(s.metricsAddr, s.metricsSecure)
		if o.SecureServing != tc.secure || (o.FilterProvider != nil) != tc.secure {
			t.Errorf("%v: secure serving %v, filter %v; want both %v", tc.args, o.SecureServing, o.FilterProvider != nil, tc.secure)
		}
	}
}

// --read-pod-reports turns every pod read off; the deprecated --read-gate-status still sets it
// and is named at start.
func TestReadPodReports(t *testing.T) {
	for _, tc := range []struct {
		args       []string
		want       bool
		deprecated bool
	}{
		{nil, true, false},
		{[]string{"--read-pod-reports=false"}, false, false},
		{[]string{"--read-gate-status=false"}, false, true},
		{[]string{"--read-gate-status"}, true, true},
	} {
		s, err := parseFlags(tc.args, func(string) string { return "" })
		if err != nil {
			t.Fatalf("%v: %v", tc.args, err)
		}
		if s.readPods != tc.want || (len(s.deprecated) > 0) != tc.deprecated {
			t.Errorf("%v: read pods %v, deprecated %q; want %v, deprecated named %v", tc.args, s.readPods, s.deprecated, tc.want, tc.deprecated)
		}
	}
	if _, err := parseFlags([]string{"--read-gate-status=maybe"}, func(string) string { return "" }); err == nil {
		t.Error("--read-gate-status=maybe accepted")
	}
}

// --watch-namespaces confines the cache to the namespaces the chart's Roles cover.
func TestWatchNamespaces(t *testing.T) {
	for _, tc := range []struct {
		args    []string
		want    []string
		wantErr bool
	}{
		{args: nil, want: nil},
		{args: []string{"--watch-namespaces=team-a"}, want: []string{"team-a"}},
		{args: []string{"--watch-namespaces=team-a, team-b,"}, want: []string{"team-a", "team-b"}},
		{args: []string{"--watch-namespaces=Team_A"}, wantErr: true},
	} {
		s, err := parseFlags(tc.args, func(string) string { return "" })
		if (err != nil) != tc.wantErr {
			t.Fatalf("%v: error %v, want error %v", tc.args, err, tc.wantErr)
		}
		if tc.wantErr {
			continue
		}
		if d := cmp.Diff(tc.want, s.watchNamespaces); d != "" {
			t.Errorf("%v (-want +got):\n%s", tc.args, d)
		}
		got := slices.Sorted(maps.Keys(controllers.CacheOptions(s.watchNamespaces...).DefaultNamespaces))
		if d := cmp.Diff(tc.want, got, cmpopts.EquateEmpty()); d != "" {
			t.Errorf("%v: cache namespaces (-want +got):\n%s", tc.args, d)
		}
	}
}
