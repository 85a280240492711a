//go:build tools

// Package tools pins the LeaderWorkerSet controller the local cluster runs (with its
// webhooks, from its own Helm chart: hack/local-node.sh lws).
package tools

import (
	_ "sigs.k8s.io/lws/cmd"
)
