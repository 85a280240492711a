package validation

import (
	"context"
	"fmt"
	"maps"
	"strings"
	"sync"

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
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/validation/field"
	celconfig "k8s.io/apiserver/pkg/apis/cel"
	"sigs.k8s.io/yaml"

	"pdcluster.dev/pdcluster-operator/internal/crdschema"
)

// Admitter defaults and validates objects of one CRD version: structural pruning and defaulting,
// OpenAPI validation and CEL rules, in the order and with the messages of kube-apiserver.
//
// The validators are built per object, for the part of the schema the object can reach
// (schemaFor): building them for the whole CRD took most of pdctl's run time. If that part
// ever failed to compile a rule, the object is admitted again with validators for the whole
// schema, built once.
type Admitter struct {
	name       string
	namespaced bool
	schema     *crdschema.Tree
	full       func() (*validators, error)
}

// validators are what admitting needs, built for one schema.
type validators struct {
	structural *structuralschema.Structural
	schema     apiextensionsvalidation.SchemaValidator
	cel        *cel.Validator
}

// NewAdmitter reads a CRD manifest (YAML or JSON) for the given version.
func NewAdmitter(crdManifest []byte, version string) (*Admitter, error) {
	var crd apiextensionsv1.CustomResourceDefinition
	if err := yaml.UnmarshalStrict(crdManifest, &crd); err != nil {
		return nil, fmt.Errorf("decode CRD: %w", err)
	}
	encoded, err := crdschema.Encode(&crd)
	if err != nil {
		return nil, err
	}
	return NewAdmitterFromSchema(encoded, version)
}

func newAdmitter(name string, namespaced bool, schema *crdschema.Tree) *Admitter {
	a := &Admitter{name: name, namespaced: namespaced, schema: schema}
	a.full = sync.OnceValues(func() (*validators, error) {
		whole, err := schema.Build(0)
		if err != nil {
			return nil, fmt.Errorf("decode schema of %s: %w", name, err)
		}
		return newValidators(name, &whole)
	})
	return a
}

func newValidators(crdName string, schema *apiextensionsv1.JSONSchemaProps) (*validators, error) {
	var internal apiextensions.JSONSchemaProps
	if err := apiextensionsv1.Convert_v1_JSONSchemaProps_To_apiextensions_JSONSchemaProps(schema, &internal, nil); err != nil {
		return nil, fmt.Errorf("convert schema of %s: %w", crdName, err)
	}
	structural, err := structuralschema.NewStructural(&internal)
	if err != nil {
		return nil, fmt.Errorf("structural schema of %s: %w", crdName, err)
	}
	validator, _, err := apiextensionsvalidation.NewSchemaValidator(&internal)
	if err != nil {
		return nil, fmt.Errorf("schema validator of %s: %w", crdName, err)
	}
	return &validators{structural: structural, schema: validator, cel: cel.NewValidator(structural, true, celconfig.PerCallLimit)}, nil
}

// Admit prunes unknown fields and applies defaults to obj in place, then validates it.
// It returns the pruned field paths (the apiserver drops them with a warning) and the errors.
func (a *Admitter) Admit(ctx context.Context, obj map[string]any) (pruned []string, errs field.ErrorList) {
	original := runtime.DeepCopyJSON(obj)
	part, err := schemaFor(a.schema, obj)
	var v *validators
	if err == nil {
		v, err = newValidators(a.name, part)
	}
	if err == nil {
		pruned, errs = a.admit(ctx, v, obj)
		if !compileFailed(errs) {
			return pruned, errs
		}
	}
	// The pruned schema should never fail where the whole one does not; if it does, the
	// whole one decides.
	full, err := a.full()
	if err != nil {
		return nil, field.ErrorList{field.InternalError(nil, err)}
	}
	clear(obj)
	maps.Copy(obj, original)
	return a.admit(ctx, full, obj)
}

func (a *Admitter) admit(ctx context.Context, v *validators, obj map[string]any) (pruned []string, errs field.ErrorList) {
	pruned = structuralpruning.PruneWithOptions(obj, v.structural, true, structuralschema.UnknownFieldPathOptions{TrackUnknownFieldPaths: true})
	structuraldefaulting.PruneNonNullableNullsWithoutDefaults(obj, v.structural)
	structuraldefaulting.Default(obj, v.structural)

	// Object metadata as the API server checks it for every custom resource (the name a DNS
	// subdomain, label and annotation syntax). A namespace the request would supply is assumed.
	meta := &unstructured.Unstructured{Object: obj}
	if a.namespaced && meta.GetNamespace() == "" {
		meta = meta.DeepCopy()
		meta.SetNamespace(metav1.NamespaceDefault)
	}
	errs = append(errs, apimachineryvalidation.ValidateObjectMetaAccessor(meta, a.namespaced, apimachineryvalidation.NameIsDNSSubdomain, field.NewPath("metadata"))...)
	errs = append(errs, apiextensionsvalidation.ValidateCustomResource(nil, obj, v.schema)...)
	errs = append(errs, structurallisttype.ValidateListSetsAndMaps(nil, v.structural, obj)...)
	// As the API server (apiextensions' customResourceStrategy.Validate): CEL is skipped, with a
	// note saying so, only after an error that leaves rules without the data they assume;
	// after others (a minimum, say) the rules still run.
	if v.cel != nil {
		if blocked := blockingError(errs); blocked != nil {
			errs = append(errs, blocked)
		} else {
			celErrs, _ := v.cel.Validate(ctx, nil, v.structural, obj, nil, celconfig.RuntimeCELCostBudget)
			errs = append(errs, celErrs...)
		}
	}
	return pruned, errs
}

// compileFailed reports the errors apiextensions' CEL validator gives for rules it could not
// compile (never for a CRD the API server accepted, so only for a schema pruned too far).
func compileFailed(errs field.ErrorList) bool {
	for _, err := range errs {
		if strings.Contains(err.Detail, "rule compile error") || strings.Contains(err.Detail, "rule compiler initialization error") {
			return true
		}
	}
	return false
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
