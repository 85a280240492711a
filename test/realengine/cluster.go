package realengine

import (
	"fmt"
	"os"
	"path/filepath"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

// LoadPDCluster reads a PDCluster manifest and points its hostPath model at modelDir.
func LoadPDCluster(path, modelDir string) (*v1alpha1.PDCluster, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	pdc := &v1alpha1.PDCluster{}
	if err := yaml.UnmarshalStrict(b, pdc); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if pdc.Spec.Model.HostPath == nil {
		return nil, fmt.Errorf("%s: spec.model.hostPath is where the harness puts the model", path)
	}
	abs, err := filepath.Abs(modelDir)
	if err != nil {
		return nil, err
	}
	pdc.Spec.Model.HostPath.Path = abs
	return pdc, nil
}

// Rendered is what the operator creates for a PDCluster that the harness runs.
type Rendered struct {
	Prefill, Decode, Router *appsv1.Deployment
	ConfigMaps              map[string]*corev1.ConfigMap
}

// Render renders pdc as the operator does (render.Render, what pdctl render prints) and picks
// the objects that run.
func Render(pdc *v1alpha1.PDCluster) (Rendered, error) {
	objs, err := render.Render(pdc, render.DefaultOptions())
	if err != nil {
		return Rendered{}, err
	}
	r := Rendered{ConfigMaps: map[string]*corev1.ConfigMap{}}
	for _, o := range objs {
		switch o := o.(type) {
		case *corev1.ConfigMap:
			r.ConfigMaps[o.Name] = o
		case *appsv1.Deployment:
			switch v1alpha1.Role(o.Labels[v1alpha1.LabelRole]) {
			case v1alpha1.RolePrefill:
				r.Prefill = o
			case v1alpha1.RoleDecode:
				r.Decode = o
			case v1alpha1.RoleRouter:
				r.Router = o
			}
		}
	}
	if r.Prefill == nil || r.Decode == nil || r.Router == nil {
		return r, fmt.Errorf("render gave no prefill, decode or router Deployment for %s", pdc.Name)
	}
	return r, nil
}

// RouterConfigMap is the router Deployment's router.json ConfigMap.
func (r Rendered) RouterConfigMap() (*corev1.ConfigMap, error) {
	for _, v := range r.Router.Spec.Template.Spec.Volumes {
		if v.ConfigMap != nil {
			if cm, ok := r.ConfigMaps[v.ConfigMap.Name]; ok {
				return cm, nil
			}
		}
	}
	return nil, fmt.Errorf("the router Deployment mounts no rendered ConfigMap")
}
