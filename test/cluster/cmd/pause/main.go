// Command pause is the pod sandbox process of the local cluster's real node: it holds the pod's
// namespaces until SIGINT or SIGTERM, as registry.k8s.io/pause does (that image cannot be pulled
// here, so the node's containerd runs this one).
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	<-sig
}
