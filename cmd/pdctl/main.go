// Command pdctl works with PDCluster manifests without a cluster: it validates them with the
// CRD's own schema and CEL rules, and prints the objects the operator would create.
package main

import (
	"os"

	"pdcluster.dev/pdcluster-operator/internal/pdctl"
)

func main() {
	os.Exit(pdctl.Execute(os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
}
