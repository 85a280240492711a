// Command crdjson writes a JSON copy of each CRD YAML it is given (x.yaml -> x.json), for the
// tools that embed the CRD: decoding its ~850 kB of YAML took pdctl 40 ms per run; JSON a few.
//
//	go run ./hack/crdjson config/crd/bases/*.yaml
package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"strings"

	"sigs.k8s.io/yaml"
)

func main() {
	for _, in := range os.Args[1:] {
		if err := convert(in); err != nil {
			fmt.Fprintf(os.Stderr, "crdjson: %s: %v\n", in, err)
			os.Exit(1)
		}
	}
}

func convert(in string) error {
	y, err := os.ReadFile(in)
	if err != nil {
		return err
	}
	j, err := yaml.YAMLToJSON(y)
	if err != nil {
		return err
	}
	var out bytes.Buffer
	if err := json.Compact(&out, j); err != nil {
		return err
	}
	out.WriteByte('\n')
	return os.WriteFile(strings.TrimSuffix(in, ".yaml")+".json", out.Bytes(), 0o644)
}
