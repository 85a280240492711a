// The completion gate: the pdgate plugin's ConfigMap and the connector class that loads it.

package render

import (
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
)

// GateEnabled reports whether the engines run the completion-gated connector plugin.
func GateEnabled(kv v1alpha1.KVTransferSpec) bool {
	// Anything but Disabled gates, unset included: the engine never runs ungated by accident.
	return kv.CompletionGate != v1alpha1.CompletionGateDisabled
}

// gatedConnector is the plugin's class and module that stand in for connector.
func gatedConnector(connector v1alpha1.Connector) (class, module string) {
	if connector == v1alpha1.ConnectorNixl {
		return vllm.NixlClass, vllm.NixlModule
	}
	return vllm.MooncakeClass, vllm.MooncakeModule
}

// GateObjectName is the ConfigMap of the completion-gate plugin of cluster.
func GateObjectName(cluster string) string { return cluster + "-" + vllm.Package }

// GateConfigMap holds the completion-gate plugin's Python files, mounted into every engine.
func GateConfigMap(pdc *v1alpha1.PDCluster) *corev1.ConfigMap {
	return gateConfigMap(defaulted(pdc))
}

// gateConfigMap is GateConfigMap of a defaulted PDCluster.
func gateConfigMap(pdc *v1alpha1.PDCluster) *corev1.ConfigMap {
	return &corev1.ConfigMap{
		TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "ConfigMap"},
		ObjectMeta: metav1.ObjectMeta{
			Name:      GateObjectName(pdc.Name),
			Namespace: pdc.Namespace,
			Labels:    componentLabels(pdc.Name, vllm.Package),
		},
		Data: vllm.Files(),
	}
}
