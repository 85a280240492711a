// Command crddesc rewrites the descriptions in CRD YAML files (in place) so that `kubectl
// explain` shows paragraphs: controller-gen keeps the Go comments' line breaks, which kubectl
// prints as they are, breaking sentences mid-line. Lines of a paragraph are joined; blank
// lines, list items and indented (code) lines keep their breaks. make manifests runs it after
// controller-gen.
//
//	go run ./hack/crddesc config/crd/bases/*.yaml
package main

import (
	"bytes"
	"fmt"
	"os"
	"regexp"
	"strings"

	"sigs.k8s.io/yaml"
)

func main() {
	for _, path := range os.Args[1:] {
		if err := rewrite(path); err != nil {
			fmt.Fprintf(os.Stderr, "crddesc: %s: %v\n", path, err)
			os.Exit(1)
		}
	}
}

func rewrite(path string) error {
	in, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	body, sep := in, []byte(nil)
	if rest, ok := bytes.CutPrefix(in, []byte("---\n")); ok {
		body, sep = rest, []byte("---\n")
	}
	var doc map[string]any
	if err := yaml.Unmarshal(body, &doc); err != nil {
		return err
	}
	walk(doc)
	out, err := yaml.Marshal(doc)
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(sep, out...), 0o644)
}

// walk reflows every "description" string under v.
func walk(v any) {
	switch x := v.(type) {
	case map[string]any:
		for k, e := range x {
			if s, ok := e.(string); ok && k == "description" {
				x[k] = Reflow(s)
				continue
			}
			walk(e)
		}
	case []any:
		for _, e := range x {
			walk(e)
		}
	}
}

// keepBreak matches a line that starts a line of its own: a list item or an indented line.
var keepBreak = regexp.MustCompile(`^(\s+|[-*] |\d+[.)] )`)

// Reflow joins the lines of each paragraph of s with spaces. Blank lines separate paragraphs;
// a list item or an indented line starts a line of its own.
func Reflow(s string) string {
	var b strings.Builder
	for i, para := range strings.Split(s, "\n\n") {
		if i > 0 {
			b.WriteString("\n\n")
		}
		for j, line := range strings.Split(para, "\n") {
			switch {
			case j == 0:
			case keepBreak.MatchString(line):
				b.WriteString("\n")
			default:
				b.WriteString(" ")
				line = strings.TrimLeft(line, " ")
			}
			b.WriteString(strings.TrimRight(line, " "))
		}
	}
	return b.String()
}
