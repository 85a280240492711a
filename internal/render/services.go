// The pools' and the router's Services.

package render

import (
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
)

// EngineService is the headless Service of a pool: the router needs each pod's address (the
// Mooncake bootstrap server runs per prefill pod), not a load-balanced VIP.
func EngineService(pdc *v1alpha1.PDCluster, role v1alpha1.Role) *corev1.Service {
	pdc = defaulted(pdc)
	// Every port the pod's containers declare, under the same name: the pods are reached by
	// their own addresses, so the Service publishes the set for discovery and DNS SRV records.
	declared := append(enginePorts(pdc, role), connectorPorts()...)
	ports := make([]corev1.ServicePort, 0, len(declared))
	for _, p := range declared {
		ports = append(ports, corev1.ServicePort{Name: p.Name, Port: p.ContainerPort, TargetPort: intstr.FromString(p.Name), Protocol: p.Protocol})
	}
	return &corev1.Service{
		TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "Service"},
		ObjectMeta: objectMeta(pdc, role),
		Spec: corev1.ServiceSpec{
			ClusterIP:                corev1.ClusterIPNone,
			Selector:                 Labels(pdc.Name, role),
			Ports:                    ports,
			PublishNotReadyAddresses: false,
		},
	}
}

// RouterService is the client-facing OpenAI endpoint of the cluster.
func RouterService(pdc *v1alpha1.PDCluster) *corev1.Service {
	pdc = defaulted(pdc)
	return &corev1.Service{
		TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "Service"},
		ObjectMeta: objectMeta(pdc, v1alpha1.RoleRouter),
		Spec: corev1.ServiceSpec{
			Selector: Labels(pdc.Name, v1alpha1.RoleRouter),
			Ports:    []corev1.ServicePort{{Name: portHTTP, Port: 80, TargetPort: intstr.FromString(portHTTP), Protocol: corev1.ProtocolTCP}},
		},
	}
}
