package render

import (
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	schedulingv1beta1 "k8s.io/api/scheduling/v1beta1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/utils/ptr"
	lwsv1 "sigs.k8s.io/lws/api/leaderworkerset/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/rollout"
)

// A pool whose replicas span pods renders a LeaderWorkerSet (one group of nodes pods per
// replica) beside its Service; the other pool keeps its Deployment.
func TestRenderGroupsReplicasAcrossPods(t *testing.T) {
	type want struct {
		layout      []string // the launcher's flags, before "--"
		gpusPerPod  string
		gateRanks   string // the sidecar's --gate-ranks, "" for none
		leaderOnly  bool   // the Service selects leaders; the worker template differs
		workerGated bool
	}
	for _, tc := range []struct {
		name string
		par  v1alpha1.Parallelism
		want want
	}{
		{"model tp8 pp2 over 2 pods", v1alpha1.Parallelism{Tensor: ptr.To[int32](8), Pipeline: ptr.To[int32](2), Nodes: ptr.To[int32](2)},
			want{[]string{"--layout=model", "--port=29501"}, "8", "", true, false}},
		{"model tp4 over 4 pods", v1alpha1.Parallelism{Tensor: ptr.To[int32](4), Nodes: ptr.To[int32](4)},
			want{[]string{"--layout=model", "--port=29501"}, "1", "", true, false}},
		{"data 16 expert over 2 pods", v1alpha1.Parallelism{Data: ptr.To[int32](16), Expert: true, Nodes: ptr.To[int32](2)},
			want{[]string{"--layout=data-parallel", "--local-ranks=8", "--port=29550"}, "8", "--gate-ranks=8", false, true}},
		{"data 4 tp2 over 2 pods", v1alpha1.Parallelism{Tensor: ptr.To[int32](2), Data: ptr.To[int32](4), Nodes: ptr.To[int32](2)},
			want{[]string{"--layout=data-parallel", "--local-ranks=2", "--port=29550"}, "4", "--gate-ranks=2", false, true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pdc := revisionBase()
			pdc.Spec.Decode.Parallelism = tc.par
			pdc.SetDefaults()
			objs, err := RenderServing(pdc, DefaultOptions(), Serving{Step: &rollout.Counts{Prefill: 2, Decode: 3}})
			if err != nil {
				t.Fatal(err)
			}
			var lws *lwsv1.LeaderWorkerSet
			var svc *corev1.Service
			var np *networkingv1.NetworkPolicy
			groupPolicies := map[string]*networkingv1.NetworkPolicy{}
			for _, o := range objs {
				switch x := o.(type) {
				case *lwsv1.LeaderWorkerSet:
					lws = x
				case *appsv1.Deployment:
					if x.Labels[v1alpha1.LabelRole] == string(v1alpha1.RoleDecode) {
						t.Errorf("decode renders Deployment %s besides its LeaderWorkerSet", x.Name)
					}
				case *corev1.Service:
					if x.Name == "pd-decode" {
						svc = x
					}
				case *networkingv1.NetworkPolicy:
					if x.Name == "pd-decode" {
						np = x
					}
					groupPolicies[x.Name] = x
				}
			}
			if lws == nil || svc == nil || np == nil {
				t.Fatalf("LeaderWorkerSet %v, Service %v, NetworkPolicy %v: want each", lws != nil, svc != nil, np != nil)
			}
			// Named apart from the Service (LeaderWorkerSet makes its own headless Service,
			// named after itself, with not-ready addresses), which the annotation names.
			if lws.Name != "pd-decode-lws" || lws.Annotations[v1alpha1.AnnotationService] != svc.Name {
				t.Errorf("LeaderWorkerSet %s for Service %s (annotation %q)", lws.Name, svc.Name, lws.Annotations[v1alpha1.AnnotationService])
			}
			s := lws.Spec
			if *s.Replicas != 3 || *s.LeaderWorkerTemplate.Size != *tc.par.Nodes {
				t.Errorf("replicas %d size %d, want the step's 3 and nodes %d", *s.Replicas, *s.LeaderWorkerTemplate.Size, *tc.par.Nodes)
			}
			// What the LeaderWorkerSet controller dereferences and its webhook would default:
			// rendered, so that the object applies as stored.
			if s.StartupPolicy != lwsv1.LeaderCreatedStartupPolicy || s.LeaderWorkerTemplate.RestartPolicy != lwsv1.RecreateGroupOnPodRestart ||
				s.RolloutStrategy.RollingUpdateConfiguration == nil || s.RolloutStrategy.RollingUpdateConfiguration.Partition == nil ||
				s.NetworkConfig == nil || ptr.Deref(s.NetworkConfig.SubdomainPolicy, "") != lwsv1.SubdomainShared {
				t.Errorf("spec leaves to the server what the controller dereferences: %+v", s)
			}
			if got := s.LeaderWorkerTemplate.WorkerTemplate.Labels[v1alpha1.LabelKVRevision]; got == "" || got != lws.Labels[v1alpha1.LabelKVRevision] {
				t.Errorf("pods carry KV revision %q, the LeaderWorkerSet %q", got, lws.Labels[v1alpha1.LabelKVRevision])
			}
			leader := s.LeaderWorkerTemplate.LeaderTemplate
			worker := &s.LeaderWorkerTemplate.WorkerTemplate
			if (leader != nil) != tc.want.leaderOnly {
				t.Fatalf("leader template set %v, want %v", leader != nil, tc.want.leaderOnly)
			}
			if leader == nil {
				leader = worker
			}
			for _, pod := range []struct {
				name   string
				t      *corev1.PodTemplateSpec
				serves bool
			}{{"leader", leader, true}, {"worker", worker, !tc.want.leaderOnly}} {
				spec := pod.t.Spec
				engine, connector := containerNamed(spec.Containers, v1alpha1.EngineContainerName), containerNamed(spec.Containers, v1alpha1.ConnectorContainerName)
				i := slices.Index(engine.Command, "--")
				if i < 2 || engine.Command[0] != Launcher || engine.Command[1] != "launch" || !slices.Equal(engine.Command[i:], []string{"--", "vllm"}) {
					t.Fatalf("%s engine command %q: want %s launch ... -- vllm", pod.name, engine.Command, Launcher)
				}
				if d := cmp.Diff(tc.want.layout, engine.Command[2:i]); d != "" {
					t.Errorf("%s launcher flags (-want +got):\n%s", pod.name, d)
				}
				if engine.Args[0] != "serve" {
					t.Errorf("%s engine args %q: want vllm serve's", pod.name, engine.Args)
				}
				if got := engine.Resources.Limits[v1alpha1.GPUResourceName]; got.String() != tc.want.gpusPerPod {
					t.Errorf("%s asks %s GPUs, want its share %s", pod.name, got.String(), tc.want.gpusPerPod)
				}
				// The launcher comes from the connector image through the init container.
				if len(spec.InitContainers) != 1 || spec.InitContainers[0].Image != connector.Image ||
					!slices.Equal(spec.InitContainers[0].Command, []string{ConnectorBinary, "install", Launcher}) ||
					!mounts(spec.InitContainers[0], launcherVolume, launcherDir) || !mounts(*engine, launcherVolume, launcherDir) {
					t.Errorf("%s init containers %+v do not put the launcher where the engine runs it", pod.name, spec.InitContainers)
				}
				gated := slices.Contains(connector.Args, "--require-gate")
				if gated != pod.serves {
					t.Errorf("%s sidecar requires the gate %v, want %v (the gate runs where vLLM's scheduler runs)", pod.name, gated, pod.serves)
				}
				ranks := ""
				for _, a := range connector.Args {
					if strings.HasPrefix(a, "--gate-ranks=") {
						ranks = a
					}
				}
				if pod.serves && ranks != tc.want.gateRanks {
					t.Errorf("%s sidecar %q, want %q (each pod runs its share of the ranks)", pod.name, ranks, tc.want.gateRanks)
				}
				if (engine.ReadinessProbe != nil) != pod.serves {
					t.Errorf("%s engine readiness probe %v, want one where vLLM serves HTTP", pod.name, engine.ReadinessProbe)
				}
			}
			if _, ok := svc.Spec.Selector[lwsv1.WorkerIndexLabelKey]; ok != tc.want.leaderOnly {
				t.Errorf("Service selector %v: leaders only %v, want %v", svc.Spec.Selector, ok, tc.want.leaderOnly)
			}
			// Each group it runs has its own NetworkPolicy (what it admits:
			// TestNetworkPoliciesKeepEachReplicaToItself).
			for g := range *lws.Spec.Replicas {
				gp := groupPolicies[GroupName(lws.Name, g)]
				if gp == nil || gp.Spec.PodSelector.MatchLabels[lwsv1.GroupIndexLabelKey] != strconv.Itoa(int(g)) {
					t.Errorf("group %d: NetworkPolicy %+v, want one selecting the group's pods", g, gp)
				}
			}
		})
	}
}

func mounts(c corev1.Container, volume, path string) bool {
	return slices.ContainsFunc(c.VolumeMounts, func(m corev1.VolumeMount) bool { return m.Name == volume && m.MountPath == path })
}

// A LeaderWorkerSet's name leaves room for its StatefulSets (<lws>-<group>) and their
// revision labels within a DNS label, and two long names stay apart.
func TestGroupSetName(t *testing.T) {
	long := strings.Repeat("a", 55)
	for _, service := range []string{"pd-decode", long + "-prefill", long + "-prefill-0123456789", long + "-decode"} {
		name := GroupSetName(service)
		if len(name) > maxGroupSetName || len(validation.IsDNS1035Label(name)) > 0 {
			t.Errorf("%s: %q (%d characters)", service, name, len(name))
		}
		// <lws>-<group> with a six-digit group, then "-" and a 10-character revision hash.
		if n := len(name) + 7 + 11; n > maxNameLength {
			t.Errorf("%s: a StatefulSet revision label would be %d characters", service, n)
		}
	}
	if GroupSetName(long+"-prefill") == GroupSetName(long+"-prefill-0123456789") {
		t.Error("two long names give one LeaderWorkerSet name")
	}
}

// The LeaderWorkerSet controller the local clusters build (hack/lws) is the release whose API
// render writes (go.mod): its CRD, webhooks and controller read what render writes.
func TestLocalClustersRunTheRenderedLeaderWorkerSetRelease(t *testing.T) {
	version := func(path string) string {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		m := regexp.MustCompile(`(?m)^\s*(?:require\s+)?sigs\.k8s\.io/lws (v\S+)`).FindSubmatch(b)
		if m == nil {
			t.Fatalf("%s requires no sigs.k8s.io/lws", path)
		}
		return string(m[1])
	}
	if api, controller := version("../../go.mod"), version("../../hack/lws/go.mod"); api != controller {
		t.Errorf("render writes LeaderWorkerSet %s, the local clusters run %s", api, controller)
	}
}

// Each replica across pods is one gang (a PodGroup of minCount its pods) where the cluster
// serves PodGroups and spec.scheduling.gang is Auto; its pods carry the label the admission
// policy reads. Never a replica of one pod, never with gang None or without PodGroups.
func TestGangs(t *testing.T) {
	for _, tc := range []struct {
		name      string
		gang      v1alpha1.GangMode
		podGroups bool
		want      []string
	}{
		// 3 groups, and the one a rolling update adds (maxSurge 25% of 3, rounded up).
		{"Auto, served", v1alpha1.GangAuto, true, []string{"pd-decode-lws-0", "pd-decode-lws-1", "pd-decode-lws-2", "pd-decode-lws-3"}},
		{"unset is Auto", "", true, []string{"pd-decode-lws-0", "pd-decode-lws-1", "pd-decode-lws-2", "pd-decode-lws-3"}},
		{"None", v1alpha1.GangNone, true, nil},
		{"not served", v1alpha1.GangAuto, false, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pdc := revisionBase()
			pdc.Spec.Decode.Parallelism = v1alpha1.Parallelism{Tensor: ptr.To[int32](8), Nodes: ptr.To[int32](2)}
			pdc.Spec.Scheduling.Gang = tc.gang
			objs, err := RenderServing(pdc, DefaultOptions(), Serving{PodGroups: tc.podGroups, Step: &rollout.Counts{Prefill: 2, Decode: 3}})
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			var lws *lwsv1.LeaderWorkerSet
			for _, o := range objs {
				switch x := o.(type) {
				case *schedulingv1beta1.PodGroup:
					got = append(got, x.Name)
					if g := x.Spec.SchedulingPolicy.Gang; g == nil || g.MinCount != 2 || x.Labels[v1alpha1.LabelRole] != "decode" {
						t.Errorf("PodGroup %s: %+v, labels %v: want a gang of the group's 2 pods", x.Name, x.Spec, x.Labels)
					}
				case *lwsv1.LeaderWorkerSet:
					lws = x
				}
			}
			if d := cmp.Diff(tc.want, got); d != "" {
				t.Errorf("PodGroups (-want +got):\n%s", d)
			}
			for _, tmpl := range []*corev1.PodTemplateSpec{lws.Spec.LeaderWorkerTemplate.LeaderTemplate, &lws.Spec.LeaderWorkerTemplate.WorkerTemplate} {
				if joined := tmpl.Labels[v1alpha1.LabelGang] == "true"; joined != (tc.want != nil) {
					t.Errorf("pod template labels %v: in a gang %v, want %v", tmpl.Labels, joined, tc.want != nil)
				}
			}
		})
	}
}

// A LeaderWorkerSet rolls its groups out as spec.rollout says, and each group a rolling update
// may add past the replicas (maxSurge) has its NetworkPolicy before its pods start.
func TestGroupSetRollsOutAsTheSpecSays(t *testing.T) {
	pdc := revisionBase()
	pdc.Spec.Decode.Replicas = ptr.To[int32](2)
	pdc.Spec.Decode.Parallelism = v1alpha1.Parallelism{Tensor: ptr.To[int32](8), Nodes: ptr.To[int32](2)}
	pdc.Spec.Rollout.MaxSurge, pdc.Spec.Rollout.MaxUnavailable = ptr.To(intstr.FromInt32(2)), ptr.To(intstr.FromString("50%"))
	pdc.SetDefaults()
	objs, err := Render(pdc, DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	var lws *lwsv1.LeaderWorkerSet
	var groups []string
	for _, o := range objs {
		switch x := o.(type) {
		case *lwsv1.LeaderWorkerSet:
			lws = x
		case *networkingv1.NetworkPolicy:
			if _, ok := x.Spec.PodSelector.MatchLabels[lwsv1.GroupIndexLabelKey]; ok {
				groups = append(groups, x.Name)
			}
		}
	}
	if lws == nil {
		t.Fatal("no LeaderWorkerSet")
	}
	want := lwsv1.RollingUpdateConfiguration{Partition: ptr.To[int32](0), MaxSurge: intstr.FromInt32(2), MaxUnavailable: intstr.FromString("50%")}
	if d := cmp.Diff(want, *lws.Spec.RolloutStrategy.RollingUpdateConfiguration); d != "" {
		t.Errorf("rolling update (-want +got):\n%s", d)
	}
	// 2 replicas and a surge of 2.
	if d := cmp.Diff([]string{lws.Name + "-0", lws.Name + "-1", lws.Name + "-2", lws.Name + "-3"}, groups); d != "" {
		t.Errorf("group NetworkPolicies (-want +got):\n%s", d)
	}
}
