// Package v1alpha1 holds the PDCluster API (group serving.pdcluster.dev).
// +kubebuilder:object:generate=true
// +groupName=serving.pdcluster.dev
package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

var (
	// GroupVersion is the API group and version of PDCluster.
	GroupVersion = schema.GroupVersion{Group: "serving.pdcluster.dev", Version: "v1alpha1"}

	// SchemeBuilder registers the types of this group with a scheme. apimachinery's, not
	// controller-runtime's: the connector sidecar and the simulators import this package for its vocabulary.
	SchemeBuilder = runtime.NewSchemeBuilder(func(s *runtime.Scheme) error {
		s.AddKnownTypes(GroupVersion, &PDCluster{}, &PDClusterList{}, &PoolScale{}, &PoolScaleList{})
		metav1.AddToGroupVersion(s, GroupVersion)
		return nil
	})

	// AddToScheme adds the types of this group to a scheme.
	AddToScheme = SchemeBuilder.AddToScheme
)
