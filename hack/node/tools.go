//go:build tools

// Package tools pins the node runtime and registry commands this module builds.
package tools

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/coredns/coredns"
	_ "github.com/distribution/distribution/v3/cmd/registry"
)
