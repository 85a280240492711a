package render_test

import (
	"maps"
	"net/netip"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
	lwsv1 "sigs.k8s.io/lws/api/leaderworkerset/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

// peer is a pod that sends traffic: its labels and its namespace's.
type peer struct {
	name     string
	labels   map[string]string
	nsLabels map[string]string
	sameNS   bool
}

// selectorTakes reports whether sel selects labels l.
func selectorTakes(t *testing.T, sel *metav1.LabelSelector, l map[string]string) bool {
	t.Helper()
	s, err := metav1.LabelSelectorAsSelector(sel)
	if err != nil {
		t.Fatal(err)
	}
	return s.Matches(labels.Set(l))
}

// selectsPod reports whether a policy peer's selectors take pod p (an ipBlock takes no pod).
func selectsPod(t *testing.T, np networkingv1.NetworkPolicyPeer, p peer) bool {
	t.Helper()
	switch {
	case np.IPBlock != nil:
		return false
	case np.NamespaceSelector == nil:
		return p.sameNS && selectorTakes(t, np.PodSelector, p.labels)
	default:
		return selectorTakes(t, np.NamespaceSelector, p.nsLabels) && (np.PodSelector == nil || selectorTakes(t, np.PodSelector, p.labels))
	}
}

// portTakes reports whether a rule's port p takes port of protocol proto: its number, or the
// range from it to its endPort.
func portTakes(p networkingv1.NetworkPolicyPort, proto corev1.Protocol, port int32) bool {
	if ptr.Deref(p.Protocol, corev1.ProtocolTCP) != proto {
		return false
	}
	if p.Port == nil {
		return true
	}
	return p.Port.IntVal == port || (p.EndPort != nil && port > p.Port.IntVal && port <= *p.EndPort)
}

// admits evaluates NetworkPolicy ingress as the API defines it: a pod selected by no policy
// takes everything; a selected pod takes what some rule of some policy selecting it admits
// (no from: every source; no ports: every port).
func admits(t *testing.T, policies []*networkingv1.NetworkPolicy, to map[string]string, port int32, from peer) bool {
	t.Helper()
	selected := false
	for _, np := range policies {
		if !selectorTakes(t, &np.Spec.PodSelector, to) {
			continue
		}
		selected = true
		for _, rule := range np.Spec.Ingress {
			portOK := len(rule.Ports) == 0
			for _, p := range rule.Ports {
				if portTakes(p, corev1.ProtocolTCP, port) {
					portOK = true
				}
			}
			fromOK := len(rule.From) == 0 || slices.ContainsFunc(rule.From, func(f networkingv1.NetworkPolicyPeer) bool { return selectsPod(t, f, from) })
			if portOK && fromOK {
				return true
			}
		}
	}
	return !selected
}

// Every port of every rendered pod is reached by who needs it and by no one else: a pod of the
// same namespace outside the PDCluster, or of another namespace, reaches the router only.
func TestNetworkPoliciesAdmitOnlyThePeersThatNeedEachPort(t *testing.T) {
	opts := render.DefaultOptions()
	for _, in := range testInputs(t) {
		t.Run(filepath.Base(in), func(t *testing.T) {
			pdc := load(t, in)
			objs, err := render.Render(pdc, opts)
			if err != nil {
				t.Fatal(err)
			}
			var policies []*networkingv1.NetworkPolicy
			var pods []groupPod
			for _, o := range objs {
				switch o := o.(type) {
				case *networkingv1.NetworkPolicy:
					policies = append(policies, o)
				case *appsv1.Deployment:
					pods = append(pods, groupPod{o.Labels[v1alpha1.LabelRole], o.Spec.Template.Labels, o.Spec.Template.Spec})
				case *lwsv1.LeaderWorkerSet:
					pods = append(pods, groupPods(o, 0)...)
				}
			}
			for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode, v1alpha1.RoleRouter} {
				if !slices.ContainsFunc(policies, func(np *networkingv1.NetworkPolicy) bool { return np.Name == render.ObjectName(pdc.Name, role) }) {
					t.Fatalf("no NetworkPolicy %s", render.ObjectName(pdc.Name, role))
				}
			}
			ns := map[string]string{corev1.LabelMetadataName: pdc.Namespace}
			of := func(role v1alpha1.Role) peer {
				return peer{name: string(role), labels: render.Labels(pdc.Name, role), nsLabels: ns, sameNS: true}
			}
			operatorNS := map[string]string{corev1.LabelMetadataName: opts.OperatorNamespace}
			operator := peer{name: "operator", labels: render.ManagerPodLabels(), nsLabels: operatorNS}
			strangers := []peer{
				{name: "a pod of the namespace", labels: map[string]string{"app": "other"}, nsLabels: ns, sameNS: true},
				{name: "another pod of the operator's namespace", labels: map[string]string{"app": "webhook"}, nsLabels: operatorNS},
				{name: "another PDCluster's router", labels: render.Labels("other", v1alpha1.RoleRouter), nsLabels: ns, sameNS: true},
				{name: "a pod of another namespace", labels: render.Labels(pdc.Name, v1alpha1.RoleRouter), nsLabels: map[string]string{corev1.LabelMetadataName: "elsewhere"}},
			}
			other := map[v1alpha1.Role]v1alpha1.Role{v1alpha1.RolePrefill: v1alpha1.RoleDecode, v1alpha1.RoleDecode: v1alpha1.RolePrefill}
			// who needs each port, by port name
			needs := func(role v1alpha1.Role, port string) ([]peer, bool) {
				switch {
				case role == v1alpha1.RoleRouter && port == "http":
					return append([]peer{{name: "a client", labels: map[string]string{"app": "chat"}, nsLabels: ns, sameNS: true}}, strangers...), true // everyone (the engines need not reach it)
				case role == v1alpha1.RoleRouter && port == "metrics":
					// Its counts name engines and what they hold: the operator's and
					// monitoring's, not its clients'.
					return []peer{operator}, true
				case port == "http":
					return []peer{of(v1alpha1.RoleRouter)}, true
				case port == "bootstrap":
					return []peer{of(v1alpha1.RoleRouter), of(v1alpha1.RoleDecode)}, true
				case port == "connector":
					return []peer{operator}, true
				case len(port) > 5 && port[:5] == "nixl-":
					return []peer{of(other[role])}, true
				case strings.HasPrefix(port, "kv-events-") || strings.HasPrefix(port, "kv-replay-"):
					// Every cached prompt's token ids: the router's alone.
					return []peer{of(v1alpha1.RoleRouter)}, true
				}
				return nil, false
			}
			for _, pod := range pods {
				role := v1alpha1.Role(pod.role)
				to := pod.labels
				// The other pool reaches the ports it needs (the transfer engines'), and no other.
				strangers := slices.Clone(strangers)
				if o, ok := other[role]; ok {
					strangers = append(strangers, of(o))
				}
				for _, c := range pod.spec.Containers {
					for _, p := range c.Ports {
						want, ok := needs(role, p.Name)
						if !ok {
							t.Errorf("%s port %s (%d): the test does not say who needs it", role, p.Name, p.ContainerPort)
							continue
						}
						wanted := map[string]bool{}
						for _, from := range want {
							wanted[from.name] = true
							if !admits(t, policies, to, p.ContainerPort, from) {
								t.Errorf("%s port %s (%d) is closed to %s", role, p.Name, p.ContainerPort, from.name)
							}
							// and the sender's own egress lets it out
							there := dest{peer: peer{labels: to, nsLabels: ns, sameNS: true}, proto: corev1.ProtocolTCP, port: p.ContainerPort}
							if from.sameNS && !allowsEgress(t, policies, from.labels, there) {
								t.Errorf("%s port %s (%d): %s may not connect to it", role, p.Name, p.ContainerPort, from.name)
							}
						}
						for _, from := range strangers {
							if !wanted[from.name] && admits(t, policies, to, p.ContainerPort, from) {
								t.Errorf("%s port %s (%d) is open to %s", role, p.Name, p.ContainerPort, from.name)
							}
						}
					}
				}
			}
		})
	}
}

// groupPod is a pod a rendered pod set runs, labelled as it runs: its role, labels and spec.
type groupPod struct {
	role   string
	labels map[string]string
	spec   corev1.PodSpec
}

// groupPods are the pods of group g of lws as the LeaderWorkerSet controller labels them.
func groupPods(lws *lwsv1.LeaderWorkerSet, g int) []groupPod {
	t := lws.Spec.LeaderWorkerTemplate
	templates := []corev1.PodTemplateSpec{t.WorkerTemplate}
	if t.LeaderTemplate != nil {
		templates = append(templates, *t.LeaderTemplate)
	}
	var out []groupPod
	for _, tmpl := range templates {
		l := maps.Clone(tmpl.Labels)
		l[lwsv1.SetNameLabelKey], l[lwsv1.GroupIndexLabelKey] = lws.Name, strconv.Itoa(g)
		out = append(out, groupPod{lws.Labels[v1alpha1.LabelRole], l, tmpl.Spec})
	}
	return out
}

// A pool whose replicas span pods: the pods of one replica reach each other on every port but
// the API's, the sidecar's and the KV events' (torch.distributed, NCCL, vLLM's data-parallel
// coordination pick theirs at run time), and no pod of another replica does; the other pool
// reaches their transfer ports and not those three. An older KV revision's groups keep their
// own (the reconciler keeps them until it drains: TestPruneKeepsAnOlderRevisionsGroups).
func TestNetworkPoliciesKeepEachReplicaToItself(t *testing.T) {
	pdc := load(t, filepath.Join("testdata", "multinode-model.yaml"))
	pdc.Spec.Router.Routing.Strategy = v1alpha1.RoutingKVEvents
	objs, err := render.Render(pdc, render.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	var policies []*networkingv1.NetworkPolicy
	var lws *lwsv1.LeaderWorkerSet
	for _, o := range objs {
		switch o := o.(type) {
		case *networkingv1.NetworkPolicy:
			policies = append(policies, o)
		case *lwsv1.LeaderWorkerSet:
			lws = o
		}
	}
	if lws == nil {
		t.Fatal("no LeaderWorkerSet rendered")
	}
	ns := map[string]string{corev1.LabelMetadataName: pdc.Namespace}
	member := func(g int) peer {
		return peer{name: "group " + strconv.Itoa(g), labels: groupPods(lws, g)[0].labels, nsLabels: ns, sameNS: true}
	}
	decode := peer{name: "decode", labels: render.Labels(pdc.Name, v1alpha1.RoleDecode), nsLabels: ns, sameNS: true}
	// 2 replicas and a surge of one: groups 0 to 2 have their policy; group 3 is never run.
	for _, tc := range []struct {
		from, to peer
		port     int32
		want     bool
	}{
		{member(0), member(0), vllm.MasterPort, true}, // torch.distributed
		{member(0), member(0), 41234, true},           // a port picked at run time
		{member(2), member(2), vllm.MasterPort, true},
		{member(1), member(0), vllm.MasterPort, false},
		{member(0), member(1), 41234, false},
		{member(3), member(3), vllm.MasterPort, false},
		{member(0), member(0), render.ConnectorPort, false},
		{member(0), member(0), vllm.KVEventsPort, false},
		{member(0), member(0), 8000, false},
		{decode, member(1), 41234, true}, // Mooncake's transfer engine
		{decode, member(1), 8998, true},  // its bootstrap
		{decode, member(1), 65535, true},
		{decode, member(1), 1, true},
		{decode, member(1), render.ConnectorPort, false},
		{decode, member(1), vllm.KVEventsPort, false},
		{decode, member(1), vllm.KVEventsReplayPort, false},
		{decode, member(1), 8000, false},
		{member(0), decode, 41234, true},
		{member(0), decode, vllm.KVEventsPort, false},
	} {
		there := dest{peer: tc.to, proto: corev1.ProtocolTCP, port: tc.port}
		if got := admits(t, policies, tc.to.labels, tc.port, tc.from) && allowsEgress(t, policies, tc.from.labels, there); got != tc.want {
			t.Errorf("%s to %s port %d: reaches %v, want %v", tc.from.name, tc.to.name, tc.port, got, tc.want)
		}
	}
	// With the engines' egress not limited, the group's policy does not limit it either.
	pdc.Spec.NetworkPolicy.Egress.Enabled = ptr.To(false)
	objs, err = render.Render(pdc, render.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	policies = nil
	for _, o := range objs {
		if np, ok := o.(*networkingv1.NetworkPolicy); ok {
			policies = append(policies, np)
		}
	}
	for _, to := range []dest{{ip: "10.0.5.7", proto: corev1.ProtocolTCP, port: 9000}, {peer: member(1), proto: corev1.ProtocolTCP, port: 41234}} {
		if !allowsEgress(t, policies, member(0).labels, to) {
			t.Errorf("egress not limited: group 0 may not connect to %+v", to)
		}
	}
}

// The router's counts (/metrics, GET /canary, /pairs, /routing on its metrics port) name
// engines and what they hold of the prompts sent: the operator reads them whatever the
// verification mode or routing strategy, and the router's clients never do, whether
// routerClients narrows the router's port or leaves it open to everyone (issue 56: they
// answered whoever reached the router).
func TestNetworkPolicyKeepsTheRoutersCountsFromItsClients(t *testing.T) {
	pdc := load(t, filepath.Join("testdata", "minimal.yaml"))
	opts := render.DefaultOptions()
	opts.OperatorNamespace = "pdcluster-system"
	operator := peer{name: "operator", labels: render.ManagerPodLabels(), nsLabels: map[string]string{corev1.LabelMetadataName: "pdcluster-system"}}
	bench := peer{name: "bench", labels: map[string]string{"app": "bench"}, sameNS: true}
	narrowed := []networkingv1.NetworkPolicyPeer{{PodSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "bench"}}}}
	router := render.Labels(pdc.Name, v1alpha1.RoleRouter)
	for _, clients := range [][]networkingv1.NetworkPolicyPeer{nil, narrowed} {
		for _, mode := range []v1alpha1.KVVerificationMode{v1alpha1.KVVerificationPassive, v1alpha1.KVVerificationCanary} {
			for _, strategy := range []v1alpha1.RoutingStrategy{v1alpha1.RoutingLeastInFlight, v1alpha1.RoutingPrefixAware, v1alpha1.RoutingKVEvents} {
				p := pdc.DeepCopy()
				p.Spec.NetworkPolicy.RouterClients = clients
				p.Spec.KVTransfer.Verification.Mode, p.Spec.Router.Routing.Strategy = mode, strategy
				policies := render.NetworkPolicies(p, opts)
				for _, c := range []struct {
					from peer
					port int32
					want bool
				}{
					{operator, render.RouterMetricsPort, true},
					{bench, render.RouterMetricsPort, false},
					{bench, render.RouterPort, true},
					{operator, render.RouterPort, clients == nil},
				} {
					if got := admits(t, policies, router, c.port, c.from); got != c.want {
						t.Errorf("routerClients %v, mode %s, routing %s: %s reaches the router's port %d: %v, want %v", clients, mode, strategy, c.from.name, c.port, got, c.want)
					}
				}
			}
		}
	}
}

func TestNetworkPolicySettings(t *testing.T) {
	pdc := load(t, filepath.Join("testdata", "minimal.yaml"))
	prom := peer{name: "prometheus", labels: map[string]string{"app": "prometheus"}, nsLabels: map[string]string{corev1.LabelMetadataName: "monitoring"}}
	promPeer := networkingv1.NetworkPolicyPeer{NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{corev1.LabelMetadataName: "monitoring"}}}
	bench := peer{name: "bench", labels: map[string]string{"app": "bench"}, sameNS: true}
	benchPeer := networkingv1.NetworkPolicyPeer{PodSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "bench"}}}
	for _, tc := range []struct {
		name string
		np   v1alpha1.NetworkPolicySpec
		// want: role/port/peer -> admitted
		want map[string]bool
	}{
		{"disabled", v1alpha1.NetworkPolicySpec{Enabled: ptr.To(false)}, nil},
		{"defaults", v1alpha1.NetworkPolicySpec{}, map[string]bool{
			"prefill/8000/bench": false, "decode/8190/prometheus": false, "router/8000/bench": true, "router/8000/prometheus": true,
			"router/9090/bench": false, "router/9090/prometheus": false,
		}},
		{"engine clients and monitoring", v1alpha1.NetworkPolicySpec{EngineClients: []networkingv1.NetworkPolicyPeer{benchPeer}, Monitoring: []networkingv1.NetworkPolicyPeer{promPeer}}, map[string]bool{
			"prefill/8000/bench": true, "decode/8000/bench": true, "prefill/8998/bench": false, "decode/8190/bench": false,
			"decode/8190/prometheus": true, "prefill/8000/prometheus": true, "prefill/8998/prometheus": false,
		}},
		{"router narrowed", v1alpha1.NetworkPolicySpec{RouterClients: []networkingv1.NetworkPolicyPeer{benchPeer}, Monitoring: []networkingv1.NetworkPolicyPeer{promPeer}}, map[string]bool{
			"router/8000/bench": true, "router/8000/prometheus": false, "router/9090/prometheus": true,
			"router/8000/stranger": false, "router/9090/bench": false, "router/9090/stranger": false,
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := pdc.DeepCopy()
			p.Spec.NetworkPolicy = tc.np
			policies := render.NetworkPolicies(p, render.DefaultOptions())
			if tc.want == nil {
				if len(policies) != 0 {
					t.Fatalf("%d NetworkPolicies rendered, want none", len(policies))
				}
				return
			}
			peers := map[string]peer{"bench": bench, "prometheus": prom, "stranger": {name: "stranger", labels: map[string]string{"app": "x"}, sameNS: true}}
			for key, want := range tc.want {
				parts := strings.Split(key, "/")
				role, from := parts[0], parts[2]
				port, err := strconv.Atoi(parts[1])
				if err != nil {
					t.Fatal(err)
				}
				if got := admits(t, policies, render.Labels(p.Name, v1alpha1.Role(role)), int32(port), peers[from]); got != want {
					t.Errorf("%s: admitted %v, want %v", key, got, want)
				}
			}
		})
	}
}

// dest is where a pod connects: another pod (labels, its namespace's labels, sameNS) or an
// address outside the cluster's pods (ip).
type dest struct {
	peer
	ip    string
	proto corev1.Protocol
	port  int32
}

// allowsEgress evaluates NetworkPolicy egress as the API defines it: a pod selected by no
// policy of type Egress connects anywhere; a selected pod where some egress rule of some such
// policy allows (no to: every destination; no ports: every port). An ipBlock matches
// addresses, not pods (implementations differ there, so the rules never rely on it).
func allowsEgress(t *testing.T, policies []*networkingv1.NetworkPolicy, from map[string]string, to dest) bool {
	t.Helper()
	inBlock := func(b *networkingv1.IPBlock) bool {
		if to.ip == "" {
			return false
		}
		ip := netip.MustParseAddr(to.ip)
		if !netip.MustParsePrefix(b.CIDR).Contains(ip) {
			return false
		}
		for _, e := range b.Except {
			if netip.MustParsePrefix(e).Contains(ip) {
				return false
			}
		}
		return true
	}
	reaches := func(p networkingv1.NetworkPolicyPeer) bool {
		if p.IPBlock != nil {
			return inBlock(p.IPBlock)
		}
		return to.ip == "" && selectsPod(t, p, to.peer)
	}
	selected := false
	for _, np := range policies {
		if !selectorTakes(t, &np.Spec.PodSelector, from) || !slices.Contains(np.Spec.PolicyTypes, networkingv1.PolicyTypeEgress) {
			continue
		}
		selected = true
		for _, rule := range np.Spec.Egress {
			portOK := len(rule.Ports) == 0
			for _, p := range rule.Ports {
				if portTakes(p, to.proto, to.port) {
					portOK = true
				}
			}
			if portOK && (len(rule.To) == 0 || slices.ContainsFunc(rule.To, reaches)) {
				return true
			}
		}
	}
	return !selected
}

// The engine pods connect to the other pool on any port (transfer engines), DNS and public
// HTTPS, and nowhere else a forged remote_bootstrap_addr could send a decode engine: not the
// cluster's Services, other pods, or a cloud's metadata server. spec.networkPolicy.egress
// narrows or widens that; the router is not limited.
func TestNetworkPolicyEgress(t *testing.T) {
	pdc := load(t, filepath.Join("testdata", "minimal.yaml"))
	ns := map[string]string{corev1.LabelMetadataName: pdc.Namespace}
	pod := func(l map[string]string, nsLabels map[string]string, port int32) dest {
		return dest{peer: peer{labels: l, nsLabels: nsLabels, sameNS: nsLabels[corev1.LabelMetadataName] == pdc.Namespace}, proto: corev1.ProtocolTCP, port: port}
	}
	addr := func(ip string, port int32) dest { return dest{ip: ip, proto: corev1.ProtocolTCP, port: port} }
	dests := map[string]dest{
		"decode:41000":    pod(render.Labels(pdc.Name, v1alpha1.RoleDecode), ns, 41000),
		"prefill:8998":    pod(render.Labels(pdc.Name, v1alpha1.RolePrefill), ns, 8998),
		"prefill:41000":   pod(render.Labels(pdc.Name, v1alpha1.RolePrefill), ns, 41000),
		"router:8000":     pod(render.Labels(pdc.Name, v1alpha1.RoleRouter), ns, 8000),
		"other-pdc:8998":  pod(render.Labels("other", v1alpha1.RolePrefill), ns, 8998),
		"stranger:8080":   pod(map[string]string{"app": "stranger"}, ns, 8080),
		"elsewhere:443":   pod(map[string]string{"app": "api"}, map[string]string{corev1.LabelMetadataName: "elsewhere"}, 443),
		"kube-dns:udp/53": {peer: peer{labels: map[string]string{"k8s-app": "kube-dns"}, nsLabels: map[string]string{corev1.LabelMetadataName: "kube-system"}}, proto: corev1.ProtocolUDP, port: 53},
		"node-dns:udp/53": {ip: "169.254.20.10", proto: corev1.ProtocolUDP, port: 53},
		"metadata:80":     addr("169.254.169.254", 80),
		"metadata:443":    addr("169.254.169.254", 443),
		"kubernetes:443":  addr("10.96.0.1", 443),
		"node:10250":      addr("192.168.1.10", 10250),
		"hub:443":         addr("18.244.28.70", 443),
		"hub:80":          addr("18.244.28.70", 80),
		"hub-v6:443":      addr("2600:9000:2000::1", 443),
		"ula-v6:443":      addr("fd00::10", 443),
		"minio:9000":      addr("10.0.5.7", 9000),
		"pod-172:443":     addr("172.17.3.4", 443),
		"cgnat:443":       addr("100.64.1.2", 443),
	}
	minio := networkingv1.NetworkPolicyEgressRule{
		To:    []networkingv1.NetworkPolicyPeer{{IPBlock: &networkingv1.IPBlock{CIDR: "10.0.5.0/24"}}},
		Ports: []networkingv1.NetworkPolicyPort{{Protocol: ptr.To(corev1.ProtocolTCP), Port: ptr.To(intstr.FromInt32(9000))}},
	}
	defaults := map[string]bool{
		"prefill/decode:41000": true, "decode/prefill:8998": true, "decode/prefill:41000": true,
		"decode/kube-dns:udp/53": true, "prefill/node-dns:udp/53": true,
		"decode/hub:443": true, "prefill/hub-v6:443": true,
		"prefill/prefill:41000": false, "decode/router:8000": false, "decode/other-pdc:8998": false,
		"decode/stranger:8080": false, "decode/elsewhere:443": false, "prefill/elsewhere:443": false,
		"decode/metadata:80": false, "decode/metadata:443": false, "decode/kubernetes:443": false,
		"decode/node:10250": false, "decode/hub:80": false, "decode/ula-v6:443": false, "decode/minio:9000": false,
		"decode/pod-172:443": false, "prefill/cgnat:443": false,
		"router/prefill:8998": true, "router/stranger:8080": true, "router/metadata:80": true,
	}
	everywhere := map[string]bool{}
	for key := range defaults {
		everywhere[key] = true
	}
	with := func(over map[string]bool) map[string]bool {
		out := maps.Clone(defaults)
		maps.Copy(out, over)
		return out
	}
	for _, tc := range []struct {
		name string
		e    v1alpha1.EngineEgressSpec
		want map[string]bool
	}{
		{"defaults", v1alpha1.EngineEgressSpec{}, defaults},
		{"disabled", v1alpha1.EngineEgressSpec{Enabled: ptr.To(false)}, everywhere},
		{"no public HTTPS", v1alpha1.EngineEgressSpec{PublicHTTPS: ptr.To(false)}, with(map[string]bool{
			"decode/hub:443": false, "prefill/hub-v6:443": false,
		})},
		{"an S3 endpoint allowed", v1alpha1.EngineEgressSpec{Allow: []networkingv1.NetworkPolicyEgressRule{minio}}, with(map[string]bool{
			"decode/minio:9000": true, "prefill/minio:9000": true,
		})},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := pdc.DeepCopy()
			p.Spec.NetworkPolicy.Egress = tc.e
			policies := render.NetworkPolicies(p, render.DefaultOptions())
			for key, want := range tc.want {
				role, to, _ := strings.Cut(key, "/")
				d, ok := dests[to]
				if !ok {
					t.Fatalf("no destination %q", to)
				}
				if got := allowsEgress(t, policies, render.Labels(p.Name, v1alpha1.Role(role)), d); got != want {
					t.Errorf("%s: allowed %v, want %v", key, got, want)
				}
			}
		})
	}
}
