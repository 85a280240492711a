// Package v1alpha1 holds the PDCluster API (group serving.pdcluster.dev).
// +kubebuilder:object:generate=true
// +groupName=serving.pdcluster.dev
package v1alpha1

import (
	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/controller-runtime/pkg/scheme"
)

var (
	// GroupVersion is the API group and version of PDCluster.
	GroupVersion = schema.GroupVersion{Group: "serving.pdcluster.dev", Version: "v1alpha1"}

	// SchemeBuilder registers the types of this group with a scheme.
	SchemeBuilder = &scheme.Builder{GroupVersion: GroupVersion}

	// AddToScheme adds the types of this group to a scheme.
	AddToScheme = SchemeBuilder.AddToScheme
)
