// Package crdschema is what admitting needs of a CustomResourceDefinition, in the compact form
// pdctl embeds: make manifests writes it with hack/crdschema, make verify keeps it in step.
package crdschema

import (
	"encoding/json"
	"fmt"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
)

// Schema is what admitting needs of a CRD.
type Schema struct {
	Name       string
	Namespaced bool
	// Versions maps each version to its OpenAPI schema, descriptions left out.
	Versions map[string]*apiextensionsv1.JSONSchemaProps
}

// Encode encodes crd's Schema (as JSON).
func Encode(crd *apiextensionsv1.CustomResourceDefinition) ([]byte, error) {
	s := Schema{Name: crd.Name, Namespaced: crd.Spec.Scope == apiextensionsv1.NamespaceScoped, Versions: map[string]*apiextensionsv1.JSONSchemaProps{}}
	for _, v := range crd.Spec.Versions {
		if v.Schema == nil || v.Schema.OpenAPIV3Schema == nil {
			return nil, fmt.Errorf("CRD %s version %s has no schema", crd.Name, v.Name)
		}
		schema := v.Schema.OpenAPIV3Schema.DeepCopy()
		dropDescriptions(schema)
		s.Versions[v.Name] = schema
	}
	// JSON, not gob (which decodes in a third of the time): gob writes maps in random order,
	// and make verify needs the same bytes from the same CRD.
	out, err := json.Marshal(&s)
	if err != nil {
		return nil, err
	}
	return append(out, '\n'), nil
}

func dropDescriptions(s *apiextensionsv1.JSONSchemaProps) {
	s.Description = ""
	for name, p := range s.Properties {
		dropDescriptions(&p)
		s.Properties[name] = p
	}
	if s.Items != nil {
		if s.Items.Schema != nil {
			dropDescriptions(s.Items.Schema)
		}
		for i := range s.Items.JSONSchemas {
			dropDescriptions(&s.Items.JSONSchemas[i])
		}
	}
	if s.AdditionalProperties != nil && s.AdditionalProperties.Schema != nil {
		dropDescriptions(s.AdditionalProperties.Schema)
	}
	for _, l := range [][]apiextensionsv1.JSONSchemaProps{s.AllOf, s.AnyOf, s.OneOf} {
		for i := range l {
			dropDescriptions(&l[i])
		}
	}
	if s.Not != nil {
		dropDescriptions(s.Not)
	}
}

// Decode decodes what Encode wrote.
func Decode(encoded []byte) (*Schema, error) {
	var s Schema
	if err := json.Unmarshal(encoded, &s); err != nil {
		return nil, fmt.Errorf("decode CRD schema: %w", err)
	}
	return &s, nil
}
