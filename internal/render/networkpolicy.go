package render

import (
	"slices"
	"strconv"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
	lwsv1 "sigs.k8s.io/lws/api/leaderworkerset/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
)

// networkPoliciesEnabled reports whether spec.networkPolicy asks for the NetworkPolicies.
// Unset reads as true on an undefaulted copy too: isolation ends only where a user said so.
func networkPoliciesEnabled(pdc *v1alpha1.PDCluster) bool {
	return ptr.Deref(pdc.Spec.NetworkPolicy.Enabled, true)
}

// NetworkPolicies isolate pdc's pods, one per pool and one for the router, each named like
// its Deployment; nil when spec.networkPolicy.enabled is false.
//
// Ingress:
//   - engines' OpenAI port: this PDCluster's router, and engineClients.
//   - prefill's bootstrap port: the router (Mooncake asks it for the engine id) and decode.
//   - engines' KV events ports (routing.strategy KVEvents): the router alone (they carry every
//     cached prompt's token ids).
//   - the transfer ports of a pool from the other pool of this PDCluster: every port but the
//     ones with a rule of their own here (the API, the sidecar's, the KV events ports:
//     transferPorts), since vLLM's transfer engines (Mooncake, NIXL over UCX) listen on ports
//     they pick at run time besides the declared bootstrap and side-channel ports. When a
//     pool's replicas span pods, the pods of one replica (a LeaderWorkerSet group) reach each
//     other on those ports too, and no other replica's (groupPolicies).
//   - the connector sidecars' port: the operator's manager pods (they read /gate) and
//     monitoring.
//   - the router's port: routerClients, or everyone when none is set.
//   - the router's metrics port (/metrics, and GET /canary, /pairs and /routing, which name
//     engines and count what they hold of the prompts sent): the operator's manager pods and
//     monitoring, never the router's clients.
//
// Egress of the engine pods (spec.networkPolicy.egress): the other pool's transfer ports (and
// their own replica's, groupPolicies), DNS, public HTTPS and the author's rules. A decode
// engine connects to whatever remote_bootstrap_addr a request names, which these rules keep
// inside the PDCluster.
//
// Kubelet probes come from the node, which a NetworkPolicy always admits.
func NetworkPolicies(pdc *v1alpha1.PDCluster, opts Options) []*networkingv1.NetworkPolicy {
	return networkPolicies(defaulted(pdc), opts)
}

// networkPolicies is NetworkPolicies of a defaulted PDCluster.
func networkPolicies(pdc *v1alpha1.PDCluster, opts Options) []*networkingv1.NetworkPolicy {
	if !networkPoliciesEnabled(pdc) {
		return nil
	}
	np := pdc.Spec.NetworkPolicy
	pods := func(role v1alpha1.Role) networkingv1.NetworkPolicyPeer {
		return networkingv1.NetworkPolicyPeer{PodSelector: &metav1.LabelSelector{MatchLabels: Labels(pdc.Name, role)}}
	}
	var operator []networkingv1.NetworkPolicyPeer
	if opts.OperatorNamespace != "" {
		operator = []networkingv1.NetworkPolicyPeer{{
			NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{corev1.LabelMetadataName: opts.OperatorNamespace}},
			PodSelector:       &metav1.LabelSelector{MatchLabels: ManagerPodLabels()},
		}}
	}
	var out []*networkingv1.NetworkPolicy
	for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode} {
		other := v1alpha1.RoleDecode
		if role == v1alpha1.RoleDecode {
			other = v1alpha1.RolePrefill
		}
		transfer := transferPorts(pdc, role)
		rules := []networkingv1.NetworkPolicyIngressRule{
			{From: append([]networkingv1.NetworkPolicyPeer{pods(v1alpha1.RoleRouter)}, np.EngineClients...), Ports: tcp(vllm.APIPort)},
			{From: []networkingv1.NetworkPolicyPeer{pods(other)}, Ports: transfer},
		}
		if role == v1alpha1.RolePrefill && pdc.Spec.KVTransfer.Connector == v1alpha1.ConnectorMooncake {
			rules = append(rules, networkingv1.NetworkPolicyIngressRule{From: []networkingv1.NetworkPolicyPeer{pods(v1alpha1.RoleRouter)}, Ports: tcp(vllm.MooncakeBootstrapPort)})
		}
		if ports := kvEventsPorts(pdc, role); len(ports) > 0 {
			rules = append(rules, networkingv1.NetworkPolicyIngressRule{From: []networkingv1.NetworkPolicyPeer{pods(v1alpha1.RoleRouter)}, Ports: tcp(ports...)})
		}
		if len(operator) > 0 {
			rules = append(rules, networkingv1.NetworkPolicyIngressRule{From: operator, Ports: tcp(ConnectorPort)})
		}
		if len(np.Monitoring) > 0 {
			rules = append(rules, networkingv1.NetworkPolicyIngressRule{From: np.Monitoring, Ports: tcp(vllm.APIPort, ConnectorPort)})
		}
		out = append(out, networkPolicy(pdc, role, rules, engineEgress(np.Egress, networkingv1.NetworkPolicyEgressRule{To: []networkingv1.NetworkPolicyPeer{pods(other)}, Ports: transfer})))
	}
	routerRules := []networkingv1.NetworkPolicyIngressRule{{From: np.RouterClients, Ports: tcp(RouterPort)}}
	// The operator reads each router's newest canary (GET /canary), pair counts (GET /pairs)
	// and routing counts (GET /routing) there; monitoring scrapes /metrics. No rule without a
	// peer: a rule with no from admits everyone.
	if observers := append(slices.Clone(operator), np.Monitoring...); len(observers) > 0 {
		routerRules = append(routerRules, networkingv1.NetworkPolicyIngressRule{From: observers, Ports: tcp(RouterMetricsPort)})
	}
	return append(out, networkPolicy(pdc, v1alpha1.RoleRouter, routerRules, nil))
}

// ManagerPodLabels are the labels the chart and config/manager give the operator's pods: the
// engine pods' sidecar port admits only them from the operator's namespace.
func ManagerPodLabels() map[string]string {
	return map[string]string{"app.kubernetes.io/name": "pdcluster-operator", "app.kubernetes.io/component": "manager"}
}

// privateV4 and privateV6 are the ranges publicHTTPS keeps closed: where a cluster's pods,
// Services and nodes live, and link-local (a cloud's metadata server).
var (
	privateV4 = []string{"0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12", "192.168.0.0/16"}
	privateV6 = []string{"::1/128", "fc00::/7", "fe80::/10"}
)

// engineEgress is an engine pool's egress (nil: not limited): the other pool's transfer ports
// (otherPool), DNS (port 53 anywhere: cluster DNS, or a node-local cache on a link-local
// address), public HTTPS and the author's rules.
func engineEgress(e v1alpha1.EngineEgressSpec, otherPool networkingv1.NetworkPolicyEgressRule) []networkingv1.NetworkPolicyEgressRule {
	if !ptr.Deref(e.Enabled, true) {
		return nil
	}
	dns := append(udp(53), tcp(53)...)
	rules := []networkingv1.NetworkPolicyEgressRule{otherPool, {Ports: dns}}
	if ptr.Deref(e.PublicHTTPS, true) {
		rules = append(rules, networkingv1.NetworkPolicyEgressRule{Ports: tcp(443), To: []networkingv1.NetworkPolicyPeer{
			{IPBlock: &networkingv1.IPBlock{CIDR: "0.0.0.0/0", Except: privateV4}},
			{IPBlock: &networkingv1.IPBlock{CIDR: "::/0", Except: privateV6}},
		}})
	}
	return append(rules, e.Allow...)
}

// networkPolicy selects role's pods; egress nil leaves their connections out unlimited.
func networkPolicy(pdc *v1alpha1.PDCluster, role v1alpha1.Role, ingress []networkingv1.NetworkPolicyIngressRule, egress []networkingv1.NetworkPolicyEgressRule) *networkingv1.NetworkPolicy {
	types := []networkingv1.PolicyType{networkingv1.PolicyTypeIngress}
	if egress != nil {
		types = append(types, networkingv1.PolicyTypeEgress)
	}
	return &networkingv1.NetworkPolicy{
		TypeMeta:   metav1.TypeMeta{APIVersion: "networking.k8s.io/v1", Kind: "NetworkPolicy"},
		ObjectMeta: objectMeta(pdc, role),
		Spec: networkingv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{MatchLabels: Labels(pdc.Name, role)},
			PolicyTypes: types,
			Ingress:     ingress,
			Egress:      egress,
		},
	}
}

// kvEventsPorts are the KV events publishers' ports of role's pods, and their replay ports,
// one each per data-parallel rank (routing.strategy KVEvents; none otherwise).
func kvEventsPorts(pdc *v1alpha1.PDCluster, role v1alpha1.Role) []int32 {
	if !KVEvents(pdc) {
		return nil
	}
	var ports []int32
	for rank := range *pool(pdc, role).Parallelism.Data {
		ports = append(ports, vllm.KVEventsPort+rank, vllm.KVEventsReplayPort+rank)
	}
	return ports
}

// transferPorts are the ports of role's pods that the other pool (and the pod's own replica
// when it spans pods) may reach: every TCP port but the ones with a rule of their own (the
// API, the sidecar's, the KV events'), as ranges. vLLM's transfer engines and its
// multi-node ranks (torch.distributed, NCCL, data-parallel coordination) listen on ports they
// pick at run time; the excluded ones are bound by the pod's own processes, so none of those
// can land there.
func transferPorts(pdc *v1alpha1.PDCluster, role v1alpha1.Role) []networkingv1.NetworkPolicyPort {
	own := append([]int32{vllm.APIPort, ConnectorPort}, kvEventsPorts(pdc, role)...)
	slices.Sort(own)
	var out []networkingv1.NetworkPolicyPort
	from := int32(1)
	for _, p := range append(own, maxPort+1) {
		switch {
		case p < from:
			continue // a duplicate
		case p == from+1:
			out = append(out, tcp(from)...)
		case p > from+1:
			r := tcp(from)[0]
			r.EndPort = ptr.To(p - 1)
			out = append(out, r)
		}
		from = p + 1
	}
	return out
}

// maxPort is the highest TCP port.
const maxPort = 65535

// groupPolicies let the pods of each group of lws (one replica across pods) reach each other on
// their transfer ports, and no other group's: NetworkPolicy cannot say "my own group", so
// there is one per group that lws may run (groups), named like the group's PodGroup.
func groupPolicies(pdc *v1alpha1.PDCluster, role v1alpha1.Role, lws *lwsv1.LeaderWorkerSet) []Object {
	transfer := transferPorts(pdc, role)
	egress := ptr.Deref(pdc.Spec.NetworkPolicy.Egress.Enabled, true)
	var out []Object
	for g := range groups(lws) {
		group := mergeMaps(Labels(pdc.Name, role), map[string]string{
			lwsv1.SetNameLabelKey: lws.Name, lwsv1.GroupIndexLabelKey: strconv.Itoa(int(g)),
		})
		peers := []networkingv1.NetworkPolicyPeer{{PodSelector: &metav1.LabelSelector{MatchLabels: group}}}
		np := &networkingv1.NetworkPolicy{
			TypeMeta:   metav1.TypeMeta{APIVersion: "networking.k8s.io/v1", Kind: "NetworkPolicy"},
			ObjectMeta: metav1.ObjectMeta{Name: GroupName(lws.Name, g), Namespace: pdc.Namespace, Labels: Labels(pdc.Name, role)},
			Spec: networkingv1.NetworkPolicySpec{
				PodSelector: metav1.LabelSelector{MatchLabels: group},
				PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress},
				Ingress:     []networkingv1.NetworkPolicyIngressRule{{From: peers, Ports: transfer}},
			},
		}
		if egress {
			// Only where the pool's egress is limited: a policy of type Egress limits the
			// pods it selects to what it allows.
			np.Spec.PolicyTypes = append(np.Spec.PolicyTypes, networkingv1.PolicyTypeEgress)
			np.Spec.Egress = []networkingv1.NetworkPolicyEgressRule{{To: peers, Ports: transfer}}
		}
		out = append(out, np)
	}
	return out
}

func tcp(ports ...int32) []networkingv1.NetworkPolicyPort { return portsOf(corev1.ProtocolTCP, ports) }

func udp(ports ...int32) []networkingv1.NetworkPolicyPort { return portsOf(corev1.ProtocolUDP, ports) }

func portsOf(proto corev1.Protocol, ports []int32) []networkingv1.NetworkPolicyPort {
	out := make([]networkingv1.NetworkPolicyPort, len(ports))
	for i, p := range ports {
		out[i] = networkingv1.NetworkPolicyPort{Protocol: ptr.To(proto), Port: ptr.To(intstr.FromInt32(p))}
	}
	return out
}
