package validation

import (
	"fmt"
	"regexp"
	"strings"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"

	"pdcluster.dev/pdcluster-operator/internal/crdschema"
)

// schemaFor returns the part of schema that admitting obj can use, so the validators are built
// for that part only: compiling every CEL rule of the whole CRD (1,700 schema nodes, most of
// them core/v1 pod fields a spec rarely sets) was four fifths of pdctl's run time.
//
// A node is kept when the object has a value there (every such value is pruned, defaulted and
// validated as the API server does, with all its rules), when it has a default (the API server
// sets it, then validates it: kept whole), or when a CEL rule of a kept ancestor names it (the
// rule needs its type to compile; its own rules are dropped, as they never run on an absent
// value). Required lists, enums, formats and the rest of a kept node stay as they are.
func schemaFor(t *crdschema.Tree, obj map[string]any) (*apiextensionsv1.JSONSchemaProps, error) {
	out, err := prune(t, 0, []any{obj}, nil)
	if err != nil {
		return nil, fmt.Errorf("decode schema: %w", err)
	}
	return &out, nil
}

// prune returns node i of t for values (every value the object has at this node, over all list
// items and map entries; none for an absent node). names are the identifiers the CEL rules of
// the node's kept ancestors use. Only the nodes kept are decoded.
func prune(t *crdschema.Tree, i int, values []any, names map[string]bool) (apiextensionsv1.JSONSchemaProps, error) {
	out, err := t.Own(i)
	if err != nil {
		return out, err
	}
	if len(values) == 0 {
		out.XValidations = nil // rules of an absent node never run
	} else if len(out.XValidations) > 0 {
		names = withRuleNames(names, out.XValidations)
	}
	if props := t.Properties(i); len(props) > 0 {
		out.Properties = make(map[string]apiextensionsv1.JSONSchemaProps, len(props))
		for _, c := range props {
			var childValues []any
			for _, v := range values {
				if m, ok := v.(map[string]any); ok {
					if cv, ok := m[c.Name]; ok {
						childValues = append(childValues, cv)
					}
				}
			}
			var kept apiextensionsv1.JSONSchemaProps
			switch {
			case len(childValues) > 0:
				kept, err = prune(t, c.Node, childValues, names)
			case t.HasDefault(c.Node):
				kept, err = t.Build(c.Node)
			case names[c.Name]:
				kept, err = prune(t, c.Node, nil, names)
			default:
				continue
			}
			if err != nil {
				return out, err
			}
			out.Properties[c.Name] = kept
		}
	}
	if it, ok := t.Items(i); ok {
		var elems []any
		for _, v := range values {
			if l, ok := v.([]any); ok {
				elems = append(elems, l...)
			}
		}
		items, err := prune(t, it, elems, names)
		if err != nil {
			return out, err
		}
		out.Items = &apiextensionsv1.JSONSchemaPropsOrArray{Schema: &items}
	}
	if ap, ok := t.AdditionalProperties(i); ok {
		var entries []any
		for _, v := range values {
			if m, ok := v.(map[string]any); ok {
				for _, e := range m {
					entries = append(entries, e)
				}
			}
		}
		schema, err := prune(t, ap, entries, names)
		if err != nil {
			return out, err
		}
		out.AdditionalProperties = &apiextensionsv1.JSONSchemaPropsOrBool{Allows: true, Schema: &schema}
	}
	return out, nil
}

var identifier = regexp.MustCompile(`[A-Za-z_][A-Za-z0-9_]*`)

// withRuleNames adds every identifier the rules use (in rule, messageExpression and
// fieldPath), unescaped as CEL escapes property names, to a copy of names.
func withRuleNames(names map[string]bool, rules apiextensionsv1.ValidationRules) map[string]bool {
	out := make(map[string]bool, len(names)+8)
	for n := range names {
		out[n] = true
	}
	for _, r := range rules {
		for _, text := range []string{r.Rule, r.MessageExpression, r.FieldPath} {
			for _, id := range identifier.FindAllString(text, -1) {
				out[id] = true
				out[celUnescape.Replace(id)] = true
				out[strings.TrimSuffix(strings.TrimPrefix(id, "__"), "__")] = true // __namespace__ etc.
			}
		}
	}
	return out
}

// celUnescape undoes the Kubernetes CEL escaping of property names.
var celUnescape = strings.NewReplacer("__underscores__", "__", "__dot__", ".", "__dash__", "-", "__slash__", "/")
