package validation

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"

	"k8s.io/apiextensions-apiserver/pkg/apis/apiextensions"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	structuralschema "k8s.io/apiextensions-apiserver/pkg/apiserver/schema"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema/cel"
	structuraldefaulting "k8s.io/apiextensions-apiserver/pkg/apiserver/schema/defaulting"
	structurallisttype "k8s.io/apiextensions-apiserver/pkg/apiserver/schema/listtype"
	structuralpruning "k8s.io/apiextensions-apiserver/pkg/apiserver/schema/pruning"
	apiextensionsvalidation "k8s.io/apiextensions-apiserver/pkg/apiserver/validation"
	apimachineryvalidation "k8s.io/apimachinery/pkg/api/validation"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/validation/field"
	celconfig "k8s.io/apiserver/pkg/apis/cel"
	"sigs.k8s.io/yaml"
)

// Admitter defaults and validates objects of one CRD version: structural pruning and defaulting,
// OpenAPI validation and CEL rules, in the order and with the messages of kube-apiserver.
type Admitter struct {
	namespaced bool
	structural *structuralschema.Structural
	schema     apiextensionsvalidation.SchemaValidator
	cel        *cel.Validator
}

// NewAdmitter builds an Admitter from a CRD manifest (YAML or JSON) for the given version.
func NewAdmitter(crdManifest []byte, version string) (*Admitter, error) {
	var crd apiextensionsv1.CustomResourceDefinition
	if err := decodeStrict(crdManifest, &crd); err != nil {
		return nil, fmt.Errorf("decode CRD: %w", err)
	}
	for _, v := range crd.Spec.Versions {
		if v.Name != version {
			continue
		}
		if v.Schema == nil || v.Schema.OpenAPIV3Schema == nil {
			return nil, fmt.Errorf("CRD %s version %s has no schema", crd.Name, version)
		}
		var internal apiextensions.JSONSchemaProps
		if err := apiextensionsv1.Convert_v1_JSONSchemaProps_To_apiextensions_JSONSchemaProps(v.Schema.OpenAPIV3Schema, &internal, nil); err != nil {
			return nil, fmt.Errorf("convert schema of %s: %w", crd.Name, err)
		}
		structural, err := structuralschema.NewStructural(&internal)
		if err != nil {
			return nil, fmt.Errorf("structural schema of %s: %w", crd.Name, err)
		}
		validator, _, err := apiextensionsvalidation.NewSchemaValidator(&internal)
		if err != nil {
			return nil, fmt.Errorf("schema validator of %s: %w", crd.Name, err)
		}
		return &Admitter{
			namespaced: crd.Spec.Scope == apiextensionsv1.NamespaceScoped,
			structural: structural,
			schema:     validator,
			cel:        cel.NewValidator(structural, true, celconfig.PerCallLimit),
		}, nil
	}
	return nil, fmt.Errorf("CRD %s has no version %s", crd.Name, version)
}

// decodeStrict decodes JSON directly (the embedded CRD: a tenth of the time) and anything else
// as YAML, refusing unknown fields either way.
func decodeStrict(b []byte, v any) error {
	if t := bytes.TrimSpace(b); len(t) > 0 && t[0] == '{' {
		dec := json.NewDecoder(bytes.NewReader(t))
		dec.DisallowUnknownFields()
		return dec.Decode(v)
	}
	return yaml.UnmarshalStrict(b, v)
}

// Admit prunes unknown fields and applies defaults to obj in place, then validates it.
// It returns the pruned field paths (the apiserver drops them with a warning) and the errors.
func (a *Admitter) Admit(ctx context.Context, obj map[string]any) (pruned []string, errs field.ErrorList) {
	pruned = structuralpruning.PruneWithOptions(obj, a.structural, true, structuralschema.UnknownFieldPathOptions{TrackUnknownFieldPaths: true})
	structuraldefaulting.PruneNonNullableNullsWithoutDefaults(obj, a.structural)
	structuraldefaulting.Default(obj, a.structural)

	// Object metadata as the API server checks it for every custom resource (the name a DNS
	// subdomain, label and annotation syntax). A namespace the request would supply is assumed.
	meta := &unstructured.Unstructured{Object: obj}
	if a.namespaced && meta.GetNamespace() == "" {
		meta = meta.DeepCopy()
		meta.SetNamespace(metav1.NamespaceDefault)
	}
	errs = append(errs, apimachineryvalidation.ValidateObjectMetaAccessor(meta, a.namespaced, apimachineryvalidation.NameIsDNSSubdomain, field.NewPath("metadata"))...)
	errs = append(errs, apiextensionsvalidation.ValidateCustomResource(nil, obj, a.schema)...)
	errs = append(errs, structurallisttype.ValidateListSetsAndMaps(nil, a.structural, obj)...)
	// As the API server (apiextensions' customResourceStrategy.Validate): CEL is skipped, with a
	// note saying so, only after an error that leaves rules without the data they assume;
	// after others (a minimum, say) the rules still run.
	if a.cel != nil {
		if blocked := blockingError(errs); blocked != nil {
			errs = append(errs, blocked)
		} else {
			celErrs, _ := a.cel.Validate(ctx, nil, a.structural, obj, nil, celconfig.RuntimeCELCostBudget)
			errs = append(errs, celErrs...)
		}
	}
	return pruned, errs
}

// blockingError is the API server's hasBlockingErr: a wrong type, a missing required field, an
// unsupported enum value, or a length or count above its maximum blocks the CEL rules.
func blockingError(errs field.ErrorList) *field.Error {
	for _, err := range errs {
		switch err.Type {
		case field.ErrorTypeNotSupported, field.ErrorTypeRequired, field.ErrorTypeTooLong, field.ErrorTypeTooMany, field.ErrorTypeTypeInvalid:
			return field.Invalid(nil, nil, "some validation rules were not checked because the object was invalid; correct the existing errors to complete validation")
		}
	}
	return nil
}
