package v1alpha1

import (
	"os"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	corev1 "k8s.io/api/core/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"
)

// Each case breaks one rule (or keeps to it) and checks the errors, by PDCluster field.
func TestValidate(t *testing.T) {
	nodeTerm := func(op corev1.NodeSelectorOperator, values ...string) *corev1.Affinity {
		return &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{
			NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchExpressions: []corev1.NodeSelectorRequirement{{Key: "rack", Operator: op, Values: values}}}}}}}
	}
	pct := func(s string) *intstr.IntOrString { return ptr.To(intstr.FromString(s)) }
	for _, tc := range []struct {
		name   string
		mutate func(*PDCluster)
		want   []string // field.Error strings
	}{
		{"nothing set", func(*PDCluster) {}, nil},
		{"mounts on the operator's paths, however written, and of its control socket", func(p *PDCluster) {
			p.Spec.Engine.Pod = &PodSettings{Volumes: []corev1.Volume{{Name: "x"}}, VolumeMounts: []corev1.VolumeMount{
				{Name: "x", MountPath: "/var/run/pdcluster/"}, {Name: "x", MountPath: "/opt/pdgate//pdgate/pdgate.py"},
				{Name: "x", MountPath: "/models/./"}, {Name: "x", MountPath: "/models/lora"}, {Name: "x", MountPath: "/dev/shmem"},
			}}
			p.Spec.Decode.Pod = &PodSettings{VolumeMounts: []corev1.VolumeMount{{Name: "connector-ctl", MountPath: "/ctl"}}}
		}, []string{
			`spec.engine.pod.volumeMounts[0].mountPath: Forbidden: /var/run/pdcluster/ is the operator's mount /var/run/pdcluster or beneath it`,
			`spec.engine.pod.volumeMounts[1].mountPath: Forbidden: /opt/pdgate//pdgate/pdgate.py is the operator's mount /opt/pdgate/pdgate or beneath it`,
			`spec.engine.pod.volumeMounts[2].mountPath: Forbidden: /models/./ is the operator's mount /models or beneath it`,
			`spec.decode.pod.volumeMounts[0].name: Forbidden: connector-ctl holds the connector sidecar's control socket, which drains the pod: the engine may not mount it`,
		}},
		{"engine flags the operator sets, however spelled", func(p *PDCluster) {
			p.Spec.Engine.Args = EngineArgs{"--max-model-len=4096", "--block-siz=32", "--data-parallel-backend", "ray", "--enable-prompt-tokens-details"}
			p.Spec.Prefill.Args = EngineArgs{"--kv-transfer-config.kv_connector=X", "--kv_events_config", "{}", "--compilation-config.level=3"}
			p.Spec.Decode.Args = EngineArgs{"-tp", "4", "--node-rank=1", "--p", "8001"}
		}, []string{
			`spec.engine.args[1]: Forbidden: flag --block-siz=32 is set by the operator (--block-size): use the typed field instead`,
			`spec.prefill.args[0]: Forbidden: flag --kv-transfer-config.kv_connector=X is set by the operator (--kv-transfer-config): use the typed field instead`,
			`spec.prefill.args[1]: Forbidden: flag --kv_events_config is set by the operator (--kv-events-config): use the typed field instead`,
			`spec.decode.args[0]: Forbidden: flag -tp is set by the operator (-tp): use the typed field instead`,
			`spec.decode.args[2]: Forbidden: flag --node-rank=1 is set by the operator (--node-rank): use the typed field instead`,
			`spec.decode.args[3]: Forbidden: flag --p is set by the operator (--pipeline-parallel-size): use the typed field instead`,
		}},
		{"a KV index one engine overflows the default router's memory with", func(p *PDCluster) {
			p.Spec.Router.Routing = RouterRouting{Strategy: RoutingKVEvents, KVEvents: &KVEventsRouting{BlocksPerEngine: ptr.To[int32](16777216)}}
		}, []string{`spec.router.routing.kvEvents.blocksPerEngine: Invalid value: 16777216: one engine's index takes 2560 MiB of router memory (160 bytes a block), more than a pool's share of the router's memory limit (3/16 of 1Gi, the default of spec.router.resources.limits.memory: 1258291 blocks): raise the limit or lower blocksPerEngine`}},
		{"the default KV index past a small router's memory", func(p *PDCluster) {
			p.Spec.Router.Routing = RouterRouting{Strategy: RoutingKVEvents}
			p.Spec.Router.Resources = &corev1.ResourceRequirements{Limits: corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("128Mi")}}
		}, []string{`spec.router.routing.kvEvents.blocksPerEngine: Invalid value: 262144: one engine's index takes 40 MiB of router memory (160 bytes a block), more than a pool's share of the router's memory limit (3/16 of 128Mi, spec.router.resources.limits.memory: 157286 blocks): raise the limit or lower blocksPerEngine (262144 by default)`}},
		{"a large KV index in a router sized for it", func(p *PDCluster) {
			p.Spec.Router.Routing = RouterRouting{Strategy: RoutingKVEvents, KVEvents: &KVEventsRouting{BlocksPerEngine: ptr.To[int32](16777216)}}
			p.Spec.Router.Resources = &corev1.ResourceRequirements{Limits: corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("16Gi")}}
		}, nil},
		{"a router without a memory limit: the node's memory bounds the index", func(p *PDCluster) {
			p.Spec.Router.Routing = RouterRouting{Strategy: RoutingKVEvents, KVEvents: &KVEventsRouting{BlocksPerEngine: ptr.To[int32](16777216)}}
			p.Spec.Router.Resources = &corev1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("128Mi")}}
		}, nil},
		{"no KV index without KVEvents", func(p *PDCluster) {
			p.Spec.Router.Routing = RouterRouting{Strategy: RoutingPrefixAware, KVEvents: &KVEventsRouting{BlocksPerEngine: ptr.To[int32](16777216)}}
		}, nil},
		{"toleration effect", func(p *PDCluster) {
			p.Spec.Decode.Tolerations = []corev1.Toleration{{Key: "a", Operator: corev1.TolerationOpExists}, {Key: "gpu", Operator: corev1.TolerationOpExists, Effect: "Sometimes"}}
		}, []string{`spec.decode.tolerations[1].effect: Unsupported value: "Sometimes": supported values: "NoSchedule", "PreferNoSchedule", "NoExecute"`}},
		{"toleration value with Exists, seconds without NoExecute", func(p *PDCluster) {
			p.Spec.Router.Tolerations = []corev1.Toleration{{Key: "a", Operator: corev1.TolerationOpExists, Value: "x", TolerationSeconds: ptr.To[int64](5), Effect: corev1.TaintEffectNoSchedule}}
		}, []string{`spec.router.tolerations[0].value: Invalid value: "x": must be empty when operator is Exists`,
			`spec.router.tolerations[0].effect: Invalid value: "NoSchedule": must be NoExecute when tolerationSeconds is set`}},
		{"good tolerations", func(p *PDCluster) {
			p.Spec.Prefill.Tolerations = []corev1.Toleration{{Operator: corev1.TolerationOpExists}, {Key: "nvidia.com/gpu", Value: "true", Effect: corev1.TaintEffectNoExecute, TolerationSeconds: ptr.To[int64](30)}}
		}, nil},
		{"a mount naming no volume", func(p *PDCluster) {
			p.Spec.Prefill.Pod = &PodSettings{VolumeMounts: []corev1.VolumeMount{{Name: "scratch", MountPath: "/scratch"}}}
		}, []string{`spec.prefill.pod.volumeMounts[0].name: Not found: "scratch (no volume of that name in spec.engine.pod.volumes or spec.prefill.pod.volumes)"`}},
		{"mounts of the pool's, the engine's and the operator's volumes", func(p *PDCluster) {
			p.Spec.Engine.Pod = &PodSettings{Volumes: []corev1.Volume{{Name: "cache"}}, VolumeMounts: []corev1.VolumeMount{{Name: "scratch", MountPath: "/scratch"}}}
			for _, pool := range []*PoolSpec{&p.Spec.Prefill, &p.Spec.Decode} {
				pool.Pod = &PodSettings{Volumes: []corev1.Volume{{Name: "scratch"}}, VolumeMounts: []corev1.VolumeMount{{Name: "cache", MountPath: "/cache"}, {Name: "model", MountPath: "/weights"}}}
			}
		}, nil},
		{"an engine-wide mount one pool lacks the volume of", func(p *PDCluster) {
			p.Spec.Engine.Pod = &PodSettings{VolumeMounts: []corev1.VolumeMount{{Name: "scratch", MountPath: "/scratch"}}}
			p.Spec.Decode.Pod = &PodSettings{Volumes: []corev1.Volume{{Name: "scratch"}}}
		}, []string{`spec.engine.pod.volumeMounts[0].name: Not found: "scratch (no volume of that name in spec.engine.pod.volumes or spec.prefill.pod.volumes)"`}},
		{"an engine-wide mount neither pool has: said once per pool", func(p *PDCluster) {
			p.Spec.Engine.Pod = &PodSettings{VolumeMounts: []corev1.VolumeMount{{Name: "x", MountPath: "/x"}}}
		}, []string{`spec.engine.pod.volumeMounts[0].name: Not found: "x (no volume of that name in spec.engine.pod.volumes or spec.prefill.pod.volumes)"`,
			`spec.engine.pod.volumeMounts[0].name: Not found: "x (no volume of that name in spec.engine.pod.volumes or spec.decode.pod.volumes)"`}},
		{"vLLM's request ids made the client's", func(p *PDCluster) {
			p.Spec.Engine.Pod = &PodSettings{Env: []corev1.EnvVar{{Name: "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", Value: "1"}}}
			p.Spec.Decode.Pod = &PodSettings{Env: []corev1.EnvVar{{Name: "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", Value: "0"}}}
		}, []string{`spec.engine.pod.env[0]: Forbidden: VLLM_DISABLE_REQUEST_ID_RANDOMIZATION makes vLLM use a client's X-Request-Id (which the router passes on) as its request id, and two requests with one id kill the engine (EngineDeadError on vLLM 0.30.0)`}},
		{"negative shmSize", func(p *PDCluster) { p.Spec.Decode.Pod = &PodSettings{ShmSize: ptr.To(resource.MustParse("-1Gi"))} },
			[]string{`spec.decode.pod.shmSize: Invalid value: "-1Gi": must be greater than zero`}},
		{"affinity operator", func(p *PDCluster) { p.Spec.Decode.Pod = &PodSettings{Affinity: nodeTerm("Near", "r1")} },
			[]string{`spec.decode.pod.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].operator: Unsupported value: "Near": supported values: "In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"`}},
		{"affinity Gt needs one integer", func(p *PDCluster) {
			p.Spec.Engine.Pod = &PodSettings{Affinity: nodeTerm(corev1.NodeSelectorOpGt, "big")}
		},
			[]string{`spec.engine.pod.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].values[0]: Invalid value: "big": must be an integer when operator is Gt or Lt`}},
		{"pod anti-affinity selector operator", func(p *PDCluster) {
			p.Spec.Decode.Pod = &PodSettings{Affinity: &corev1.Affinity{PodAntiAffinity: &corev1.PodAntiAffinity{RequiredDuringSchedulingIgnoredDuringExecution: []corev1.PodAffinityTerm{{
				TopologyKey: "kubernetes.io/hostname", LabelSelector: &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{{Key: "a", Operator: "Near"}}}}}}}}
		}, []string{`spec.decode.pod.affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution[0].labelSelector.matchExpressions[0].operator: Invalid value: "Near": not a valid selector operator`}},
		{"good affinity", func(p *PDCluster) {
			p.Spec.Decode.Pod = &PodSettings{Affinity: nodeTerm(corev1.NodeSelectorOpIn, "r1")}
		}, nil},
		{"disruption budget past 100%", func(p *PDCluster) { p.Spec.Decode.DisruptionBudget = &DisruptionBudget{MaxUnavailable: pct("150%")} },
			[]string{`spec.decode.disruptionBudget.maxUnavailable: Invalid value: "150%": must be a percentage between 0% and 100%`}},
		{"disruption budget not a number", func(p *PDCluster) { p.Spec.Prefill.DisruptionBudget = &DisruptionBudget{MinAvailable: pct("half")} },
			[]string{`spec.prefill.disruptionBudget.minAvailable: Invalid value: "half": must be an integer or a percentage, e.g. 1 or 25%`}},
		{"good disruption budget", func(p *PDCluster) { p.Spec.Decode.DisruptionBudget = &DisruptionBudget{MaxUnavailable: pct("25%")} }, nil},
		{"rollout that cannot move", func(p *PDCluster) {
			p.Spec.Rollout = RolloutSpec{MaxSurge: pct("0%"), MaxUnavailable: ptr.To(intstr.FromInt32(0))}
		},
			[]string{`spec.rollout.maxUnavailable: Invalid value: "0": may not be 0 when maxSurge is 0: no pod could be replaced (set maxSurge 1 where an accelerator is free, else maxUnavailable 1)`}},
		{"rollout surge past 100%", func(p *PDCluster) { p.Spec.Rollout = RolloutSpec{MaxSurge: pct("200%")} },
			[]string{`spec.rollout.maxSurge: Invalid value: "200%": must be a percentage between 0% and 100%`}},
		{"rollout without surge", func(p *PDCluster) { p.Spec.Rollout = RolloutSpec{MaxSurge: pct("0%"), MaxUnavailable: pct("25%")} }, nil},
		{"env and volume names", func(p *PDCluster) {
			p.Spec.Engine.Pod = &PodSettings{Env: []corev1.EnvVar{{Name: "1BAD"}}, Volumes: []corev1.Volume{{Name: "Scratch"}}}
		}, []string{
			`spec.engine.pod.env[0].name: Invalid value: "1BAD": a valid environment variable name must consist of alphabetic characters, digits, '_', '-', or '.', and must not start with a digit (e.g. 'my.env-name',  or 'MY_ENV.NAME',  or 'MyEnvName1', regex used for validation is '[-._a-zA-Z][-._a-zA-Z0-9]*')`,
			`spec.engine.pod.volumes[0].name: Invalid value: "Scratch": a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')`,
		}},
		{"reserved extraConfig key", func(p *PDCluster) {
			p.Spec.KVTransfer.ExtraConfig = &apiextensionsv1.JSON{Raw: []byte(`{"device_name":"mlx5_9","other":1}`)}
		}, []string{`spec.kvTransfer.extraConfig[device_name]: Forbidden: set by the operator from spec.kvTransfer.rdmaDevices; remove it`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := &PDCluster{}
			tc.mutate(p)
			var got []string
			for _, e := range p.Validate() {
				got = append(got, e.Error())
			}
			if d := cmp.Diff(tc.want, got); d != "" {
				t.Errorf("Validate() (-want +got):\n%s", d)
			}
		})
	}
}

// engineSchema is spec.engine's schema in the generated CRD, which the API server runs.
func engineSchema(t *testing.T) apiextensionsv1.JSONSchemaProps {
	t.Helper()
	crd, err := os.ReadFile("../../config/crd/bases/serving.pdcluster.dev_pdclusters.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var doc apiextensionsv1.CustomResourceDefinition
	if err := yaml.Unmarshal(crd, &doc); err != nil {
		t.Fatal(err)
	}
	return doc.Spec.Versions[0].Schema.OpenAPIV3Schema.Properties["spec"].Properties["engine"]
}

// The CRD's rule on EngineArgs, which the API server runs, refuses the flags Validate does.
func TestEngineArgsRuleListsTheOperatorsFlags(t *testing.T) {
	args := engineSchema(t).Properties["args"]
	if len(args.XValidations) != 1 {
		t.Fatalf("spec.engine.args has %d rules, want 1", len(args.XValidations))
	}
	rule := args.XValidations[0].Rule
	for _, f := range OperatorEngineFlags {
		if !strings.Contains(rule, "'"+f+"'") {
			t.Errorf("the CRD's EngineArgs rule does not list %s", f)
		}
	}
}

// The CRD's rules on PodSettings refuse the operator's mount paths, with or without a trailing
// slash, and its control socket's volume, as Validate does.
func TestPodSettingsRulesListTheOperatorsMounts(t *testing.T) {
	var rules []string
	for _, r := range engineSchema(t).Properties["pod"].XValidations {
		rules = append(rules, r.Rule)
	}
	all := strings.Join(rules, "\n")
	for p := range OperatorMountPaths {
		for _, written := range []string{p, p + "/"} {
			if !strings.Contains(all, "'"+written+"'") {
				t.Errorf("no rule of spec.engine.pod refuses a mount at %s", written)
			}
		}
	}
	if !strings.Contains(all, "m.name != '"+ControlVolumeName+"'") {
		t.Errorf("no rule of spec.engine.pod refuses a mount of %s", ControlVolumeName)
	}
}
