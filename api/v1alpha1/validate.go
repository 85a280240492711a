package v1alpha1

import (
	"encoding/json"
	"fmt"
	"maps"
	"path"
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	metav1validation "k8s.io/apimachinery/pkg/apis/meta/v1/validation"
	"k8s.io/apimachinery/pkg/util/intstr"
	utilvalidation "k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"

	"pdcluster.dev/pdcluster-operator/internal/routerconfig"
)

// OperatorVolumeNames are the volumes the operator adds to the engine pods (CEL keeps a
// PDCluster's own volumes from taking these names; a volume mount may name them).
var OperatorVolumeNames = []string{"dshm", "connector-run", "connector-ctl", "completion-gate", "model", "hf-cache"}

// OperatorEngineFlags are the `vllm serve` flags the operator sets from typed fields (render's
// engine command, and the launcher's for a replica across pods): spec.*.args may not set them,
// nor abbreviate one (vLLM's parser takes a unique prefix of a long flag) or set one's keys
// after a dot (a JSON flag's), as vLLM 0.30.0's parser would take them. EngineArgs' CEL rule
// lists the same (TestEngineArgsRuleListsTheOperatorsFlags).
var OperatorEngineFlags = []string{
	"--kv-transfer-config", "--kv-events-config", "--block-size", "--tensor-parallel-size", "--pipeline-parallel-size",
	"--data-parallel-size", "--data-parallel-size-local", "--data-parallel-start-rank", "--data-parallel-address",
	"--data-parallel-rpc-port", "--data-parallel-hybrid-lb", "--enable-expert-parallel", "--enable-prefix-caching",
	"--no-enable-prefix-caching", "--served-model-name", "--port", "--host", "--nnodes", "--node-rank", "--master-addr",
	"--master-port", "--headless",
	"-tp", "-dp", "-pp", // short forms: argparse abbreviates long flags only
}

// operatorFlag is the flag of OperatorEngineFlags arg sets, abbreviates or sets a key of, if
// any.
func operatorFlag(arg string) (string, bool) {
	name, _, _ := strings.Cut(arg, "=")
	name, _, _ = strings.Cut(name, ".")
	name = strings.ReplaceAll(name, "_", "-")
	for _, f := range OperatorEngineFlags {
		if name == f || strings.HasPrefix(name, "--") && len(name) > 2 && strings.HasPrefix(f, name) {
			return f, true
		}
	}
	return "", false
}

// validateEngineArgs refuses args that set a flag the operator sets (the CRD's rule says the
// same to the API server; this is it for pdctl and a PDCluster an older CRD admitted).
func validateEngineArgs(path *field.Path, args EngineArgs) field.ErrorList {
	var errs field.ErrorList
	for i, a := range args {
		if f, ok := operatorFlag(a); ok {
			errs = append(errs, field.Forbidden(path.Index(i), "flag "+a+" is set by the operator ("+f+"): use the typed field instead"))
		}
	}
	return errs
}

// OperatorMountPaths are where the operator mounts its volumes in the engine container, and
// whether a path beneath is the operator's too: a PDCluster's volumeMounts may not use them
// (PodSettings' CEL rule says so of each path as written, with or without a trailing slash;
// Validate of each cleaned). Beneath the sockets, the gate plugin's code and shared memory a
// mount would replace what the operator put there; beneath the model and the Hugging Face cache
// (adapters at /models/lora, say) it is the author's to add.
var OperatorMountPaths = map[string]bool{"/dev/shm": true, "/var/run/pdcluster": true, "/opt/pdgate/pdgate": true, "/models": false, "/var/cache/huggingface": false}

// ControlVolumeName is the volume of the connector sidecar's control socket, which drains the
// pod: the engine container may not mount it.
const ControlVolumeName = "connector-ctl"

// ReservedExtraConfigKeys are kv-transfer-config keys the operator derives from typed fields,
// by the field they come from: spec.kvTransfer.extraConfig may not set them.
var ReservedExtraConfigKeys = map[string]string{
	"mooncake_protocol": "spec.kvTransfer.protocol",
	"device_name":       "spec.kvTransfer.rdmaDevices",
}

// Warnings are what a PDCluster says that the operator ignores: admitted, and said back. The
// operator's ValidatingAdmissionPolicy (config/admission/scaling-warnings.yaml) warns of the
// same in the same words, and `pdctl validate` prints them.
func (p *PDCluster) Warnings() []string {
	var out []string
	for _, pool := range []struct {
		name    string
		spec    *PoolSpec
		scaling PoolScalingSpec
	}{{"prefill", &p.Spec.Prefill, p.Spec.Scaling.Prefill}, {"decode", &p.Spec.Decode, p.Spec.Scaling.Decode}} {
		if pool.scaling.Mode == ScalingExternal && pool.spec.Replicas != nil {
			out = append(out, "spec."+pool.name+".replicas ("+strconv.Itoa(int(*pool.spec.Replicas))+") is ignored: spec.scaling."+
				pool.name+".mode is External, so PoolScale "+p.Name+"-"+pool.name+" sets the count")
		}
	}
	// A grace period set by hand that ends before the drain: the kubelet kills the engine
	// while it still holds KV decode has not pulled (or answers it has not finished).
	for _, pool := range []struct {
		name string
		spec *PoolSpec
	}{{"prefill", &p.Spec.Prefill}, {"decode", &p.Spec.Decode}} {
		field, grace := "", int64(0)
		switch {
		case pool.spec.Pod != nil && pool.spec.Pod.TerminationGracePeriodSeconds != nil:
			field, grace = "spec."+pool.name+".pod.terminationGracePeriodSeconds", *pool.spec.Pod.TerminationGracePeriodSeconds
		case p.Spec.Engine.Pod != nil && p.Spec.Engine.Pod.TerminationGracePeriodSeconds != nil:
			field, grace = "spec.engine.pod.terminationGracePeriodSeconds", *p.Spec.Engine.Pod.TerminationGracePeriodSeconds
		default:
			continue
		}
		drain := int64(DefaultDrainTimeoutSeconds)
		if t := pool.spec.Drain.TimeoutSeconds; t != nil {
			drain = int64(*t)
		}
		if need := 15 + drain; grace < need {
			out = append(out, field+" ("+strconv.FormatInt(grace, 10)+") is shorter than the "+pool.name+" pods' drain (15 s router window + spec."+
				pool.name+".drain.timeoutSeconds "+strconv.FormatInt(drain, 10)+" = "+strconv.FormatInt(need, 10)+
				" s): the kubelet stops a deleted "+pool.name+" pod before it finishes what it holds")
		}
	}
	return out
}

// Validate checks what the CRD's schema and CEL cannot: Kubernetes' own rules for the core/v1
// values a PDCluster carries into its pods (which the API server would otherwise report only
// when the operator applies the Deployment, in the Deployment's words), and rules that need
// more than one field. Each error names the PDCluster field. render, the reconciler and
// `pdctl validate` call it.
func (p *PDCluster) Validate() field.ErrorList {
	var errs field.ErrorList
	spec := field.NewPath("spec")
	errs = append(errs, validatePodSettings(spec.Child("engine", "pod"), p.Spec.Engine.Pod)...)
	errs = append(errs, validateEngineArgs(spec.Child("engine", "args"), p.Spec.Engine.Args)...)
	for _, pool := range []struct {
		name string
		spec *PoolSpec
	}{{"prefill", &p.Spec.Prefill}, {"decode", &p.Spec.Decode}} {
		path := spec.Child(pool.name)
		errs = append(errs, validatePodSettings(path.Child("pod"), pool.spec.Pod)...)
		errs = append(errs, validateEngineArgs(path.Child("args"), pool.spec.Args)...)
		errs = append(errs, validateMounts(spec.Child("engine", "pod"), p.Spec.Engine.Pod, path.Child("pod"), pool.spec.Pod)...)
		errs = append(errs, validateTolerations(path.Child("tolerations"), pool.spec.Tolerations)...)
		if b := pool.spec.DisruptionBudget; b != nil {
			errs = append(errs, validateBudgetValue(path.Child("disruptionBudget", "maxUnavailable"), b.MaxUnavailable)...)
			errs = append(errs, validateBudgetValue(path.Child("disruptionBudget", "minAvailable"), b.MinAvailable)...)
		}
	}
	errs = append(errs, validateRollout(spec.Child("rollout"), p.Spec.Rollout)...)
	if pr := p.Spec.Scheduling.Pairing; pr != nil {
		for _, msg := range utilvalidation.IsQualifiedName(pr.TopologyKey) {
			errs = append(errs, field.Invalid(spec.Child("scheduling", "pairing", "topologyKey"), pr.TopologyKey, "must be a node label key: "+msg))
		}
	}
	errs = append(errs, validateTolerations(spec.Child("router", "tolerations"), p.Spec.Router.Tolerations)...)
	if q := p.Spec.Router.MaxRequestBody; q != nil && (q.Cmp(resource.MustParse("1Ki")) < 0 || q.Cmp(resource.MustParse("1Gi")) > 0) {
		errs = append(errs, field.Invalid(spec.Child("router", "maxRequestBody"), q.String(), "must be from 1Ki to 1Gi"))
	}
	errs = append(errs, validateExtraConfig(spec.Child("kvTransfer", "extraConfig"), p.Spec.KVTransfer.ExtraConfig)...)
	errs = append(errs, validateKVIndex(spec.Child("router"), p.Spec.Router)...)
	// An engine-wide mount missing its volume in both pools is one mistake, said once.
	seen := map[string]bool{}
	return slices.DeleteFunc(errs, func(e *field.Error) bool {
		dup := seen[e.Error()]
		seen[e.Error()] = true
		return dup
	})
}

// validateMounts checks that every volume mount of a pool's engine container (the engine-wide
// ones and the pool's) names a volume the pool's pods have: the engine-wide ones', the pool's
// or the operator's.
func validateMounts(enginePath *field.Path, engine *PodSettings, poolPath *field.Path, pool *PodSettings) field.ErrorList {
	volumes := slices.Clone(OperatorVolumeNames)
	for _, s := range []*PodSettings{engine, pool} {
		if s != nil {
			for _, v := range s.Volumes {
				volumes = append(volumes, v.Name)
			}
		}
	}
	var errs field.ErrorList
	for _, s := range []struct {
		path *field.Path
		pod  *PodSettings
	}{{enginePath, engine}, {poolPath, pool}} {
		if s.pod == nil {
			continue
		}
		for i, m := range s.pod.VolumeMounts {
			at := s.path.Child("volumeMounts").Index(i)
			if m.Name == ControlVolumeName {
				errs = append(errs, field.Forbidden(at.Child("name"), ControlVolumeName+" holds the connector sidecar's control socket, which drains the pod: the engine may not mount it"))
			}
			clean := path.Clean(m.MountPath)
			for _, p := range slices.Sorted(maps.Keys(OperatorMountPaths)) {
				if clean == p || OperatorMountPaths[p] && strings.HasPrefix(clean, p+"/") {
					errs = append(errs, field.Forbidden(at.Child("mountPath"), m.MountPath+" is the operator's mount "+p+" or beneath it"))
				}
			}
			if !slices.Contains(volumes, m.Name) {
				errs = append(errs, field.NotFound(at.Child("name"),
					m.Name+" (no volume of that name in "+enginePath.Child("volumes").String()+" or "+poolPath.Child("volumes").String()+")"))
			}
		}
	}
	return errs
}

// envDisableRequestIDRandomization is vLLM's opt-out of unique internal request ids.
const envDisableRequestIDRandomization = "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"

// validatePodSettings checks env and volume names as the API server would in the pods, that
// vLLM's request ids stay unique, shmSize, and the affinity's and topology spread's selectors.
func validatePodSettings(path *field.Path, s *PodSettings) field.ErrorList {
	if s == nil {
		return nil
	}
	var errs field.ErrorList
	for i, e := range s.Env {
		for _, msg := range utilvalidation.IsEnvVarName(e.Name) {
			errs = append(errs, field.Invalid(path.Child("env").Index(i).Child("name"), e.Name, msg))
		}
		if e.Name == envDisableRequestIDRandomization && (e.ValueFrom != nil || e.Value != "0") {
			errs = append(errs, field.Forbidden(path.Child("env").Index(i), envDisableRequestIDRandomization+
				" makes vLLM use a client's X-Request-Id (which the router passes on) as its request id, and two requests with one id kill the engine (EngineDeadError on vLLM 0.30.0)"))
		}
	}
	for i, v := range s.Volumes {
		for _, msg := range utilvalidation.IsDNS1123Label(v.Name) {
			errs = append(errs, field.Invalid(path.Child("volumes").Index(i).Child("name"), v.Name, msg))
		}
	}
	if s.ShmSize != nil && s.ShmSize.Sign() <= 0 {
		errs = append(errs, field.Invalid(path.Child("shmSize"), s.ShmSize.String(), "must be greater than zero"))
	}
	errs = append(errs, validateAffinity(path.Child("affinity"), s.Affinity)...)
	for i, c := range s.TopologySpreadConstraints {
		errs = append(errs, validateLabelSelector(c.LabelSelector, path.Child("topologySpreadConstraints").Index(i).Child("labelSelector"))...)
	}
	return errs
}

var (
	tolerationEffects   = []string{"", string(corev1.TaintEffectNoSchedule), string(corev1.TaintEffectPreferNoSchedule), string(corev1.TaintEffectNoExecute)}
	tolerationOperators = []string{"", string(corev1.TolerationOpEqual), string(corev1.TolerationOpExists)}
	nodeOperators       = []string{string(corev1.NodeSelectorOpIn), string(corev1.NodeSelectorOpNotIn), string(corev1.NodeSelectorOpExists),
		string(corev1.NodeSelectorOpDoesNotExist), string(corev1.NodeSelectorOpGt), string(corev1.NodeSelectorOpLt)}
)

// validateTolerations applies the pod's toleration rules.
func validateTolerations(path *field.Path, ts []corev1.Toleration) field.ErrorList {
	var errs field.ErrorList
	for i, t := range ts {
		p := path.Index(i)
		if !slices.Contains(tolerationEffects, string(t.Effect)) {
			errs = append(errs, field.NotSupported(p.Child("effect"), t.Effect, tolerationEffects[1:]))
		}
		if !slices.Contains(tolerationOperators, string(t.Operator)) {
			errs = append(errs, field.NotSupported(p.Child("operator"), t.Operator, tolerationOperators[1:]))
		}
		if t.Operator == corev1.TolerationOpExists && t.Value != "" {
			errs = append(errs, field.Invalid(p.Child("value"), t.Value, "must be empty when operator is Exists"))
		}
		if t.Key == "" && t.Operator != corev1.TolerationOpExists {
			errs = append(errs, field.Invalid(p.Child("operator"), t.Operator, "must be Exists when key is empty (it tolerates every taint)"))
		}
		if t.Key != "" {
			for _, msg := range utilvalidation.IsQualifiedName(t.Key) {
				errs = append(errs, field.Invalid(p.Child("key"), t.Key, msg))
			}
		}
		if t.TolerationSeconds != nil && t.Effect != corev1.TaintEffectNoExecute {
			errs = append(errs, field.Invalid(p.Child("effect"), t.Effect, "must be NoExecute when tolerationSeconds is set"))
		}
	}
	return errs
}

// validateAffinity checks the operators and values of node affinity's terms and pod
// (anti-)affinity's label selectors.
func validateAffinity(path *field.Path, a *corev1.Affinity) field.ErrorList {
	if a == nil {
		return nil
	}
	var errs field.ErrorList
	if na := a.NodeAffinity; na != nil {
		p := path.Child("nodeAffinity")
		if r := na.RequiredDuringSchedulingIgnoredDuringExecution; r != nil {
			for i, t := range r.NodeSelectorTerms {
				errs = append(errs, validateNodeTerm(p.Child("requiredDuringSchedulingIgnoredDuringExecution", "nodeSelectorTerms").Index(i), t)...)
			}
		}
		for i, t := range na.PreferredDuringSchedulingIgnoredDuringExecution {
			errs = append(errs, validateNodeTerm(p.Child("preferredDuringSchedulingIgnoredDuringExecution").Index(i).Child("preference"), t.Preference)...)
		}
	}
	podTerms := func(p *field.Path, required []corev1.PodAffinityTerm, preferred []corev1.WeightedPodAffinityTerm) {
		for i, t := range required {
			errs = append(errs, validateLabelSelector(t.LabelSelector, p.Child("requiredDuringSchedulingIgnoredDuringExecution").Index(i).Child("labelSelector"))...)
		}
		for i, t := range preferred {
			errs = append(errs, validateLabelSelector(t.PodAffinityTerm.LabelSelector, p.Child("preferredDuringSchedulingIgnoredDuringExecution").Index(i).Child("podAffinityTerm", "labelSelector"))...)
		}
	}
	if pa := a.PodAffinity; pa != nil {
		podTerms(path.Child("podAffinity"), pa.RequiredDuringSchedulingIgnoredDuringExecution, pa.PreferredDuringSchedulingIgnoredDuringExecution)
	}
	if pa := a.PodAntiAffinity; pa != nil {
		podTerms(path.Child("podAntiAffinity"), pa.RequiredDuringSchedulingIgnoredDuringExecution, pa.PreferredDuringSchedulingIgnoredDuringExecution)
	}
	return errs
}

func validateNodeTerm(path *field.Path, t corev1.NodeSelectorTerm) field.ErrorList {
	var errs field.ErrorList
	for _, set := range []struct {
		name string
		reqs []corev1.NodeSelectorRequirement
	}{{"matchExpressions", t.MatchExpressions}, {"matchFields", t.MatchFields}} {
		for i, r := range set.reqs {
			p := path.Child(set.name).Index(i)
			if !slices.Contains(nodeOperators, string(r.Operator)) {
				errs = append(errs, field.NotSupported(p.Child("operator"), r.Operator, nodeOperators))
				continue
			}
			switch r.Operator {
			case corev1.NodeSelectorOpIn, corev1.NodeSelectorOpNotIn:
				if len(r.Values) == 0 {
					errs = append(errs, field.Required(p.Child("values"), "must be specified when operator is In or NotIn"))
				}
			case corev1.NodeSelectorOpExists, corev1.NodeSelectorOpDoesNotExist:
				if len(r.Values) > 0 {
					errs = append(errs, field.Forbidden(p.Child("values"), "may not be specified when operator is Exists or DoesNotExist"))
				}
			case corev1.NodeSelectorOpGt, corev1.NodeSelectorOpLt:
				if len(r.Values) != 1 {
					errs = append(errs, field.Required(p.Child("values"), "must be one integer when operator is Gt or Lt"))
				} else if _, err := strconv.ParseInt(r.Values[0], 10, 64); err != nil {
					errs = append(errs, field.Invalid(p.Child("values").Index(0), r.Values[0], "must be an integer when operator is Gt or Lt"))
				}
			}
		}
	}
	return errs
}

func validateLabelSelector(s *metav1.LabelSelector, path *field.Path) field.ErrorList {
	return metav1validation.ValidateLabelSelector(s, metav1validation.LabelSelectorValidationOptions{}, path)
}

// validateBudgetValue: a PodDisruptionBudget's count may not be negative, nor its percentage
// past 100%.
func validateBudgetValue(path *field.Path, v *intstr.IntOrString) field.ErrorList {
	if v == nil {
		return nil
	}
	if v.Type == intstr.Int {
		if v.IntVal < 0 {
			return field.ErrorList{field.Invalid(path, v.IntVal, "must be greater than or equal to 0")}
		}
		return nil
	}
	pct, ok := strings.CutSuffix(v.StrVal, "%")
	n, err := strconv.Atoi(pct)
	if !ok || err != nil {
		return field.ErrorList{field.Invalid(path, v.StrVal, "must be an integer or a percentage, e.g. 1 or 25%")}
	}
	if n < 0 || n > 100 {
		return field.ErrorList{field.Invalid(path, v.StrVal, "must be a percentage between 0% and 100%")}
	}
	return nil
}

// validateExtraConfig refuses the keys the operator sets from typed fields.
func validateExtraConfig(path *field.Path, raw *apiextensionsv1.JSON) field.ErrorList {
	if raw == nil || len(raw.Raw) == 0 {
		return nil
	}
	var extra map[string]json.RawMessage
	if err := json.Unmarshal(raw.Raw, &extra); err != nil {
		return field.ErrorList{field.Invalid(path, string(raw.Raw), "must be a JSON object")}
	}
	var errs field.ErrorList
	for _, k := range slices.Sorted(maps.Keys(extra)) {
		if from, ok := ReservedExtraConfigKeys[k]; ok {
			errs = append(errs, field.Forbidden(path.Key(k), "set by the operator from "+from+"; remove it"))
		}
	}
	return errs
}

// validateRollout: the bounds may not be negative nor percentages past 100%, and not both 0
// (no pod could move, which a Deployment refuses too).
func validateRollout(path *field.Path, r RolloutSpec) field.ErrorList {
	errs := append(validateBudgetValue(path.Child("maxSurge"), r.MaxSurge), validateBudgetValue(path.Child("maxUnavailable"), r.MaxUnavailable)...)
	zero := func(v *intstr.IntOrString) bool {
		return v != nil && ((v.Type == intstr.Int && v.IntVal == 0) || (v.Type == intstr.String && strings.TrimSpace(v.StrVal) == "0%"))
	}
	if len(errs) == 0 && zero(r.MaxSurge) && zero(r.MaxUnavailable) {
		errs = append(errs, field.Invalid(path.Child("maxUnavailable"), r.MaxUnavailable.String(),
			"may not be 0 when maxSurge is 0: no pod could be replaced (set maxSurge 1 where an accelerator is free, else maxUnavailable 1)"))
	}
	return errs
}

// validateKVIndex refuses a KVEvents index one engine's blocks cannot fit in: each pool's index
// holds at most its share of the router's memory limit (routerconfig.KVIndexBlocks), so an
// engine's blocksPerEngine past it would be evicted at random as it arrives. A router without a
// memory limit is bounded by the node's memory, which only the router knows.
func validateKVIndex(path *field.Path, r RouterSpec) field.ErrorList {
	if r.Routing.Strategy != RoutingKVEvents {
		return nil
	}
	limit, limitSays := resource.MustParse(DefaultRouterMemoryLimit), "the default of spec.router.resources.limits.memory"
	if r.Resources != nil {
		q, ok := r.Resources.Limits[corev1.ResourceMemory]
		if !ok {
			return nil
		}
		limit, limitSays = q, "spec.router.resources.limits.memory"
	}
	blocks, unset := int64(routerconfig.DefaultBlocksPerEngine), " ("+strconv.Itoa(routerconfig.DefaultBlocksPerEngine)+" by default)"
	if e := r.Routing.KVEvents; e != nil && e.BlocksPerEngine != nil {
		blocks, unset = int64(*e.BlocksPerEngine), ""
	}
	fits := routerconfig.KVIndexBlocks(limit.Value())
	if blocks <= fits {
		return nil
	}
	return field.ErrorList{field.Invalid(path.Child("routing", "kvEvents", "blocksPerEngine"), blocks, fmt.Sprintf(
		"one engine's index takes %d MiB of router memory (%d bytes a block), more than a pool's share of the router's memory limit (3/16 of %s, %s: %d blocks): raise the limit or lower blocksPerEngine%s",
		blocks*routerconfig.KVIndexBlockBytes>>20, routerconfig.KVIndexBlockBytes, limit.String(), limitSays, fits, unset))}
}
