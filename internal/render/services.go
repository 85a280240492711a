// The pools' and the router's Services.

package render

import (
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	lwsv1 "sigs.k8s.io/lws/api/leaderworkerset/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
)

// engineService is the headless Service, named name, of a pool's engines of KV revision rev
// (pdc defaulted): the router needs each pod's address (the Mooncake bootstrap server runs per
// prefill pod), not a load-balanced VIP, and only the pods of one revision behind one name, so
// that it never pairs a prefill and a decode of two. Of a pool whose replicas span pods, it
// selects the pods that serve: every pod with data-parallel ranks, the leaders of a sharded
// model.
func engineService(pdc *v1alpha1.PDCluster, role v1alpha1.Role, rev, name string) *corev1.Service {
	// Every port the pod's containers declare, under the same name: the pods are reached by
	// their own addresses, so the Service publishes the set for discovery and DNS SRV records.
	declared := append(enginePorts(pdc, role), connectorPorts()...)
	ports := make([]corev1.ServicePort, 0, len(declared))
	for _, p := range declared {
		ports = append(ports, corev1.ServicePort{Name: p.Name, Port: p.ContainerPort, TargetPort: intstr.FromString(p.Name), Protocol: p.Protocol})
	}
	meta := objectMeta(pdc, role)
	meta.Name = name
	meta.Labels[v1alpha1.LabelKVRevision] = rev
	selector := RevisionLabels(pdc.Name, role, rev)
	if leaderServesAlone(pdc, role) {
		// A model sharded across a group's pods serves from its leader only.
		selector[lwsv1.WorkerIndexLabelKey] = "0"
	}
	return &corev1.Service{
		TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "Service"},
		ObjectMeta: meta,
		Spec: corev1.ServiceSpec{
			ClusterIP:                corev1.ClusterIPNone,
			Selector:                 selector,
			Ports:                    ports,
			PublishNotReadyAddresses: false,
		},
	}
}

// routerService is the client-facing OpenAI endpoint of the cluster (pdc defaulted).
func routerService(pdc *v1alpha1.PDCluster) *corev1.Service {
	return &corev1.Service{
		TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "Service"},
		ObjectMeta: objectMeta(pdc, v1alpha1.RoleRouter),
		Spec: corev1.ServiceSpec{
			Selector: Labels(pdc.Name, v1alpha1.RoleRouter),
			Ports:    []corev1.ServicePort{{Name: portHTTP, Port: 80, TargetPort: intstr.FromString(portHTTP), Protocol: corev1.ProtocolTCP}},
		},
	}
}
