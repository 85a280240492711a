// Package validation reads PDCluster manifests from YAML or JSON and admits them (prunes,
// defaults, validates) with the generated CRD exactly as kube-apiserver does on `kubectl
// apply`, so `pdctl validate` and the tests reject what the cluster would, with its messages.
package validation

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"strings"

	"k8s.io/apimachinery/pkg/runtime"
	utiljson "k8s.io/apimachinery/pkg/util/json"
	"k8s.io/apimachinery/pkg/util/validation/field"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/config/crd"
)

// InvalidError lists every reason a document was rejected.
type InvalidError struct {
	Name   string
	Errors field.ErrorList
}

func (e *InvalidError) Error() string {
	msgs := make([]string, 0, len(e.Errors))
	for _, err := range e.Errors {
		msgs = append(msgs, "  - "+err.Error())
	}
	return fmt.Sprintf("PDCluster %q is invalid:\n%s", e.Name, strings.Join(msgs, "\n"))
}

// Document is one admitted PDCluster and the unknown fields that were dropped from it.
type Document struct {
	PDCluster *v1alpha1.PDCluster
	Pruned    []string
}

// Loader admits PDCluster manifests with the embedded CRD.
type Loader struct{ admitter *Admitter }

// NewLoader builds a Loader from the embedded CRD.
func NewLoader() (*Loader, error) {
	a, err := NewAdmitterFromSchema(crd.PDClusterSchema, v1alpha1.GroupVersion.Version)
	if err != nil {
		return nil, fmt.Errorf("load PDCluster CRD: %w", err)
	}
	return &Loader{admitter: a}, nil
}

// Read decodes every document in r. Documents of other kinds are an error: a typo in kind
// or apiVersion should not be silently skipped. The error joins every invalid document.
func (l *Loader) Read(ctx context.Context, r io.Reader) ([]Document, error) {
	reader := utilyaml.NewYAMLReader(bufio.NewReader(r))
	var docs []Document
	var errs []error
	for i := 0; ; i++ {
		raw, err := reader.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("read document %d: %w", i+1, err)
		}
		if len(bytes.TrimSpace(raw)) == 0 {
			continue
		}
		doc, err := l.Admit(ctx, raw)
		if err != nil {
			errs = append(errs, fmt.Errorf("document %d: %w", i+1, err))
			continue
		}
		docs = append(docs, *doc)
	}
	if len(docs) == 0 && len(errs) == 0 {
		return nil, errors.New("no PDCluster found in input")
	}
	return docs, errors.Join(errs...)
}

// Admit decodes and admits a single YAML or JSON PDCluster.
func (l *Loader) Admit(ctx context.Context, raw []byte) (*Document, error) {
	// Decode as the API server does: integers as int64, not float64 (sigs.k8s.io/yaml alone
	// gives float64, which CEL's integer rules refuse with "expected int, got float64").
	js, err := yaml.YAMLToJSON(raw)
	if err != nil {
		return nil, fmt.Errorf("decode: %w", err)
	}
	var obj map[string]any
	if err := utiljson.Unmarshal(js, &obj); err != nil {
		return nil, fmt.Errorf("decode: %w", err)
	}
	if obj == nil {
		return nil, errors.New("empty document")
	}
	apiVersion, _ := obj["apiVersion"].(string)
	kind, _ := obj["kind"].(string)
	if apiVersion != v1alpha1.GroupVersion.String() || kind != "PDCluster" {
		return nil, fmt.Errorf("apiVersion %q kind %q: want apiVersion %s kind PDCluster", apiVersion, kind, v1alpha1.GroupVersion)
	}
	meta, _ := obj["metadata"].(map[string]any)
	name, _ := meta["name"].(string)
	if name == "" {
		return nil, &InvalidError{Name: name, Errors: field.ErrorList{field.Required(field.NewPath("metadata", "name"), "")}}
	}
	pruned, errs := l.admitter.Admit(ctx, obj)
	if len(errs) > 0 {
		return nil, &InvalidError{Name: name, Errors: errs}
	}
	var pdc v1alpha1.PDCluster
	if err := runtime.DefaultUnstructuredConverter.FromUnstructuredWithValidation(obj, &pdc, true); err != nil {
		return nil, fmt.Errorf("PDCluster %q: %w", name, err)
	}
	if pdc.Namespace == "" {
		pdc.Namespace = "default"
	}
	return &Document{PDCluster: &pdc, Pruned: pruned}, nil
}
