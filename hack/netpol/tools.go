//go:build tools

// Package tools pins the NetworkPolicy implementation the real node runs.
package tools

import (
	_ "sigs.k8s.io/kube-network-policies/cmd"
)
