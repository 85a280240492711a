package validation

import (
	"regexp"
	"strings"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
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
func schemaFor(schema *apiextensionsv1.JSONSchemaProps, obj map[string]any) *apiextensionsv1.JSONSchemaProps {
	out := prune(schema, []any{obj}, nil)
	return &out
}

// prune returns s for values (every value the object has at this node, over all list items
// and map entries; none for an absent node). names are the identifiers the CEL rules of the
// node's kept ancestors use.
func prune(s *apiextensionsv1.JSONSchemaProps, values []any, names map[string]bool) apiextensionsv1.JSONSchemaProps {
	out := *s
	if len(values) == 0 {
		out.XValidations = nil // rules of an absent node never run
	} else if len(s.XValidations) > 0 {
		names = withRuleNames(names, s.XValidations)
	}
	if s.Properties != nil {
		out.Properties = make(map[string]apiextensionsv1.JSONSchemaProps, len(s.Properties))
		for name, child := range s.Properties {
			var childValues []any
			for _, v := range values {
				if m, ok := v.(map[string]any); ok {
					if cv, ok := m[name]; ok {
						childValues = append(childValues, cv)
					}
				}
			}
			switch {
			case len(childValues) > 0:
				out.Properties[name] = prune(&child, childValues, names)
			case child.Default != nil:
				out.Properties[name] = child
			case names[name]:
				out.Properties[name] = prune(&child, nil, names)
			}
		}
	}
	if s.Items != nil && s.Items.Schema != nil {
		var elems []any
		for _, v := range values {
			if l, ok := v.([]any); ok {
				elems = append(elems, l...)
			}
		}
		items := prune(s.Items.Schema, elems, names)
		out.Items = &apiextensionsv1.JSONSchemaPropsOrArray{Schema: &items}
	}
	if s.AdditionalProperties != nil && s.AdditionalProperties.Schema != nil {
		var entries []any
		for _, v := range values {
			if m, ok := v.(map[string]any); ok {
				for _, e := range m {
					entries = append(entries, e)
				}
			}
		}
		ap := prune(s.AdditionalProperties.Schema, entries, names)
		out.AdditionalProperties = &apiextensionsv1.JSONSchemaPropsOrBool{Allows: s.AdditionalProperties.Allows, Schema: &ap}
	}
	return out
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
