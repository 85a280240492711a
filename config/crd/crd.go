// Package crd embeds the generated CustomResourceDefinitions, so tools (pdctl validate) can run
// exactly the schema, defaults and CEL rules that kube-apiserver runs at admission.
package crd

import _ "embed"

// PDCluster is the generated CRD of serving.pdcluster.dev/PDCluster.
//
//go:embed bases/serving.pdcluster.dev_pdclusters.yaml
var PDCluster []byte
