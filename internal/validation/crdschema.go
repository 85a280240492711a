package validation

import (
	"fmt"

	"pdcluster.dev/pdcluster-operator/internal/crdschema"
)

// NewAdmitterFromSchema builds an Admitter for version from an encoded crdschema.Schema.
func NewAdmitterFromSchema(encoded []byte, version string) (*Admitter, error) {
	s, err := crdschema.Decode(encoded)
	if err != nil {
		return nil, err
	}
	schema, ok := s.Versions[version]
	if !ok {
		return nil, fmt.Errorf("CRD %s has no version %s", s.Name, version)
	}
	return newAdmitter(s.Name, s.Namespaced, schema), nil
}
