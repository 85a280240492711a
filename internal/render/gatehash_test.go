package render_test

import (
	"bytes"
	"encoding/json"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"
	corev1 "k8s.io/api/core/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

// gateRender is what the engines get of the completion-gate plugin: its hash, each role's pod
// template and the plugin ConfigMap's files.
type gateRender struct {
	Hash      string                                   `json:"hash"`
	Templates map[v1alpha1.Role]corev1.PodTemplateSpec `json:"templates"`
	Files     map[string]string                        `json:"files"`
}

func renderGate() (gateRender, error) {
	pdc := wrappers.MakePDCluster("ns", "c").Obj()
	out := gateRender{Hash: vllm.Hash(), Templates: map[v1alpha1.Role]corev1.PodTemplateSpec{}, Files: render.GateConfigMap(pdc).Data}
	for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode} {
		dep, err := render.EngineDeployment(pdc, render.DefaultOptions(), role)
		if err != nil {
			return out, err
		}
		out.Templates[role] = dep.Spec.Template
	}
	return out, nil
}

// gateProbe is a program that prints renderGate's result, built with the plugin files the test
// chooses: the files are embedded at build time, so a build is the only way to change them.
const gateProbe = `package main

import (
	"encoding/json"
	"os"

	corev1 "k8s.io/api/core/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
	"pdcluster.dev/pdcluster-operator/internal/render"
	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

func main() {
	pdc := wrappers.MakePDCluster("ns", "c").Obj()
	out := map[string]any{"hash": vllm.Hash(), "files": render.GateConfigMap(pdc).Data}
	tmpls := map[v1alpha1.Role]corev1.PodTemplateSpec{}
	for _, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode} {
		dep, err := render.EngineDeployment(pdc, render.DefaultOptions(), role)
		if err != nil {
			panic(err)
		}
		tmpls[role] = dep.Spec.Template
	}
	out["templates"] = tmpls
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		panic(err)
	}
}
`

// buildWithPlugin runs gateProbe built with the plugin file name's content replaced (no file
// replaced when name is ""), through the go command's overlay: nothing on disk changes.
func buildWithPlugin(t *testing.T, name string, content []byte) gateRender {
	t.Helper()
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	replace := map[string]string{filepath.Join(root, "internal", "render", "gatehashprobe", "main.go"): filepath.Join(dir, "main.go")}
	if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte(gateProbe), 0o644); err != nil {
		t.Fatal(err)
	}
	if name != "" {
		replace[filepath.Join(root, "connector", "vllm", vllm.Package, name)] = filepath.Join(dir, name)
		if err := os.WriteFile(filepath.Join(dir, name), content, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	overlay, _ := json.Marshal(map[string]any{"Replace": replace})
	if err := os.WriteFile(filepath.Join(dir, "overlay.json"), overlay, 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("go", "run", "-overlay", filepath.Join(dir, "overlay.json"), "./gatehashprobe")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go run the probe with %s replaced: %v\n%s", name, err, stderr.Bytes())
	}
	var got gateRender
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatalf("probe output: %v\n%s", err, out)
	}
	return got
}

// roundTrip passes r through JSON, as the probe's output did, so the two compare alike.
func roundTrip(t *testing.T, r gateRender) gateRender {
	t.Helper()
	b, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	var out gateRender
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatal(err)
	}
	return out
}

// withHash is r with its hash, and the annotation of each template, set to hash.
// The plugin is part of the KV revision, so the revision label follows it: kvRevision is that
// of the render with the new plugin.
func withHash(r gateRender, hash, kvRevision string) gateRender {
	r.Hash = hash
	tmpls := map[v1alpha1.Role]corev1.PodTemplateSpec{}
	for role, tmpl := range r.Templates {
		tmpl = *tmpl.DeepCopy()
		tmpl.Annotations[v1alpha1.AnnotationGateHash] = hash
		tmpl.Labels[v1alpha1.LabelKVRevision] = kvRevision
		tmpls[role] = tmpl
	}
	r.Templates = tmpls
	return r
}

// A plugin change must roll the engines: the hash on the pod templates follows the files'
// content (not only their names or sizes), and the same content gives the same hash, build
// after build.
func TestGateHashFollowsThePluginContent(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the renderer once per plugin variant")
	}
	base, err := renderGate()
	if err != nil {
		t.Fatal(err)
	}
	base = roundTrip(t, base)
	for role, tmpl := range base.Templates {
		if tmpl.Annotations[v1alpha1.AnnotationGateHash] != base.Hash {
			t.Fatalf("%s template: annotation %s = %q, want the plugin hash %q", role, v1alpha1.AnnotationGateHash, tmpl.Annotations[v1alpha1.AnnotationGateHash], base.Hash)
		}
	}
	names := slices.Sorted(maps.Keys(base.Files))
	if len(names) == 0 {
		t.Fatal("the plugin has no files")
	}

	t.Run("same content", func(t *testing.T) {
		// The same files, built again (one of them overlaid with its own bytes): the same
		// hash, the same templates.
		if d := cmp.Diff(base, buildWithPlugin(t, names[0], []byte(base.Files[names[0]]))); d != "" {
			t.Errorf("rebuilt with the same files (-in this test +rebuilt):\n%s", d)
		}
	})

	type variant struct{ name, file, content string }
	var variants []variant
	for _, n := range names {
		// One byte changed: the file keeps its name and size.
		b := []byte(base.Files[n])
		i := len(b) / 2
		isLetter := func(c byte) bool { return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' }
		for i < len(b) && !isLetter(b[i]) {
			i++
		}
		if i == len(b) {
			t.Fatalf("%s has no letter past its middle", n)
		}
		b[i] ^= 0x20 // the letter's case
		variants = append(variants, variant{n + ": one byte changed", n, string(b)})
	}
	seen := map[string]string{base.Hash: "the files as they are"}
	for _, v := range variants {
		t.Run(v.name, func(t *testing.T) {
			got := buildWithPlugin(t, v.file, []byte(v.content))
			if prev, dup := seen[got.Hash]; dup {
				t.Fatalf("hash %s, the same as for %s: a plugin change would not roll the engines", got.Hash, prev)
			}
			seen[got.Hash] = v.name
			// Everything else is as before: the ConfigMap carries the new file, and the pod
			// templates differ by the annotation, which is the new hash, and by a new KV
			// revision (decode must not read KV that a prefill with the old plugin made).
			rev := got.Templates[v1alpha1.RoleDecode].Labels[v1alpha1.LabelKVRevision]
			if rev == base.Templates[v1alpha1.RoleDecode].Labels[v1alpha1.LabelKVRevision] {
				t.Errorf("KV revision %q unchanged by a new plugin", rev)
			}
			want := withHash(base, got.Hash, rev)
			want.Files = maps.Clone(base.Files)
			want.Files[v.file] = v.content
			if d := cmp.Diff(want, got); d != "" {
				t.Errorf("rendered (-want +got):\n%s", d)
			}
			if cmp.Equal(base.Templates, got.Templates) {
				t.Error("the pod templates did not change: the engines would not roll")
			}
		})
	}
}
