// Package crdschema is what admitting needs of a CustomResourceDefinition, in the compact form
// pdctl embeds: make manifests writes it with hack/crdschema, make verify keeps it in step.
//
// The form is a gob table of schema nodes: each node's own fields as JSON, its children as
// indexes (properties as a sorted list: gob writes maps in random order, and make verify needs
// the same bytes from the same CRD). A reader decodes only the nodes it visits: decoding the
// whole schema's JSON was a fifth of pdctl's run, and a spec reaches a tenth of the nodes.
// (A node's fields are JSON, not gob, because gob cannot tell a pointer to zero, such as
// minimum: 0, from no pointer.)
package crdschema

import (
	"bytes"
	"encoding/gob"
	"encoding/json"
	"fmt"
	"maps"
	"slices"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
)

// Schema is what admitting needs of a CRD: its name, scope and each version's OpenAPI schema
// (descriptions left out: kubectl explain's text, most of the bytes, never read at admission).
type Schema struct {
	Name       string
	Namespaced bool
	Versions   map[string]*Tree
}

// table is the encoded form of a Schema.
type table struct {
	Name       string
	Namespaced bool
	Versions   []version
}

type version struct {
	Name  string
	Nodes []node // Nodes[0] is the root
}

// node is one schema node: its own fields as JSON, its children as indexes into the table
// (+1: 0 is none).
type node struct {
	Self                 []byte
	Properties           []Child
	Items                int
	AdditionalProperties int
	HasDefault           bool
}

// Child is a named property's node.
type Child struct {
	Name string
	Node int
}

// Tree is one version's schema, decoded a node at a time. Node 0 is the root.
type Tree struct{ nodes []node }

// Own decodes node i's own fields (no properties, no items or additionalProperties schema).
func (t *Tree) Own(i int) (apiextensionsv1.JSONSchemaProps, error) {
	var s apiextensionsv1.JSONSchemaProps
	if i < 0 || i >= len(t.nodes) {
		return s, fmt.Errorf("schema node %d out of the table", i)
	}
	err := json.Unmarshal(t.nodes[i].Self, &s)
	return s, err
}

// Properties are node i's properties, sorted by name.
func (t *Tree) Properties(i int) []Child { return t.nodes[i].Properties }

// Items is the node of node i's items schema, if it has one.
func (t *Tree) Items(i int) (int, bool) { return t.nodes[i].Items - 1, t.nodes[i].Items > 0 }

// AdditionalProperties is the node of node i's additionalProperties schema, if it has one.
func (t *Tree) AdditionalProperties(i int) (int, bool) {
	return t.nodes[i].AdditionalProperties - 1, t.nodes[i].AdditionalProperties > 0
}

// HasDefault reports whether node i sets a default.
func (t *Tree) HasDefault(i int) bool { return t.nodes[i].HasDefault }

// Build decodes node i with everything below it.
func (t *Tree) Build(i int) (apiextensionsv1.JSONSchemaProps, error) { return t.build(i, 0) }

// Encode encodes crd's Schema.
func Encode(crd *apiextensionsv1.CustomResourceDefinition) ([]byte, error) {
	t := table{Name: crd.Name, Namespaced: crd.Spec.Scope == apiextensionsv1.NamespaceScoped}
	for _, v := range crd.Spec.Versions {
		if v.Schema == nil || v.Schema.OpenAPIV3Schema == nil {
			return nil, fmt.Errorf("CRD %s version %s has no schema", crd.Name, v.Name)
		}
		ver := version{Name: v.Name}
		if _, err := ver.add(v.Schema.OpenAPIV3Schema, "openAPIV3Schema"); err != nil {
			return nil, fmt.Errorf("CRD %s version %s: %w", crd.Name, v.Name, err)
		}
		t.Versions = append(t.Versions, ver)
	}
	var buf bytes.Buffer
	if err := gob.NewEncoder(&buf).Encode(&t); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// add appends s and its children to the table and returns its index.
func (v *version) add(s *apiextensionsv1.JSONSchemaProps, path string) (int, error) {
	self := *s // its children are written as nodes of their own; only self's fields are cleared
	self.Description = ""
	self.Properties = nil
	n := node{HasDefault: s.Default != nil}
	// Maps anywhere else would be encoded in random order; controller-gen writes none.
	if len(self.PatternProperties) > 0 || len(self.Definitions) > 0 || len(self.Dependencies) > 0 {
		return 0, fmt.Errorf("%s: patternProperties, definitions and dependencies are not supported", path)
	}
	for _, sub := range slices.Concat(self.AllOf, self.AnyOf, self.OneOf) {
		if len(sub.Properties) > 1 {
			return 0, fmt.Errorf("%s: properties inside allOf, anyOf or oneOf are not supported", path)
		}
	}
	i := len(v.Nodes)
	v.Nodes = append(v.Nodes, node{})
	if s.Items != nil && s.Items.Schema != nil {
		self.Items = nil
		idx, err := v.add(s.Items.Schema, path+".items")
		if err != nil {
			return 0, err
		}
		n.Items = idx + 1
	}
	if s.AdditionalProperties != nil && s.AdditionalProperties.Schema != nil {
		self.AdditionalProperties = nil
		idx, err := v.add(s.AdditionalProperties.Schema, path+".additionalProperties")
		if err != nil {
			return 0, err
		}
		n.AdditionalProperties = idx + 1
	}
	for _, name := range slices.Sorted(maps.Keys(s.Properties)) {
		p := s.Properties[name]
		idx, err := v.add(&p, path+".properties."+name)
		if err != nil {
			return 0, err
		}
		n.Properties = append(n.Properties, Child{Name: name, Node: idx})
	}
	own, err := json.Marshal(&self)
	if err != nil {
		return 0, fmt.Errorf("%s: %w", path, err)
	}
	n.Self = own
	v.Nodes[i] = n
	return i, nil
}

// Decode decodes what Encode wrote.
func Decode(encoded []byte) (*Schema, error) {
	var t table
	if err := gob.NewDecoder(bytes.NewReader(encoded)).Decode(&t); err != nil {
		return nil, fmt.Errorf("decode CRD schema: %w", err)
	}
	s := &Schema{Name: t.Name, Namespaced: t.Namespaced, Versions: map[string]*Tree{}}
	for _, v := range t.Versions {
		if len(v.Nodes) == 0 {
			return nil, fmt.Errorf("decode CRD schema: version %s has no schema", v.Name)
		}
		s.Versions[v.Name] = &Tree{nodes: v.Nodes}
	}
	return s, nil
}

// build decodes node i with its children.
func (t *Tree) build(i, depth int) (apiextensionsv1.JSONSchemaProps, error) {
	if depth > len(t.nodes) {
		return apiextensionsv1.JSONSchemaProps{}, fmt.Errorf("schema node %d: the table loops", i)
	}
	s, err := t.Own(i)
	if err != nil {
		return s, err
	}
	n := t.nodes[i]
	if n.Items > 0 {
		items, err := t.build(n.Items-1, depth+1)
		if err != nil {
			return s, err
		}
		s.Items = &apiextensionsv1.JSONSchemaPropsOrArray{Schema: &items}
	}
	if n.AdditionalProperties > 0 {
		ap, err := t.build(n.AdditionalProperties-1, depth+1)
		if err != nil {
			return s, err
		}
		s.AdditionalProperties = &apiextensionsv1.JSONSchemaPropsOrBool{Allows: true, Schema: &ap}
	}
	if len(n.Properties) > 0 {
		s.Properties = make(map[string]apiextensionsv1.JSONSchemaProps, len(n.Properties))
		for _, c := range n.Properties {
			p, err := t.build(c.Node, depth+1)
			if err != nil {
				return s, err
			}
			s.Properties[c.Name] = p
		}
	}
	return s, nil
}
