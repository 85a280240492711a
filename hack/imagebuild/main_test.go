package main

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/klauspost/compress/zstd"
)

// zstdTar writes a zstd tarball of one file and returns its path and the uncompressed tar's
// sha256 (the layer's diff ID).
func zstdTar(t *testing.T, dir, name, content string) (string, string) {
	t.Helper()
	var tb bytes.Buffer
	tw := tar.NewWriter(&tb)
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0o644, Size: int64(len(content))}); err != nil {
		t.Fatal(err)
	}
	if _, err := tw.Write([]byte(content)); err != nil {
		t.Fatal(err)
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	var zb bytes.Buffer
	zw, err := zstd.NewWriter(&zb)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := zw.Write(tb.Bytes()); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, name+".tar.zst")
	if err := os.WriteFile(p, zb.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(tb.Bytes())
	return p, "sha256:" + hex.EncodeToString(sum[:])
}

// TestLayeredImage: the engine image's layers go in as given, in order, as zstd layers of an OCI
// image (containerd pulls zstd only from OCI manifests), with the config asked for.
func TestLayeredImage(t *testing.T) {
	dir := t.TempDir()
	base, baseID := zstdTar(t, dir, "base", "debian")
	venv, venvID := zstdTar(t, dir, "venv", "vllm")
	img, err := layered([]string{base, venv}, "/opt/vllm/bin/vllm", "0:0", "/", []string{"PATH=/opt/vllm/bin:/usr/bin", "HOME=/root"})
	if err != nil {
		t.Fatal(err)
	}
	m, err := img.Manifest()
	if err != nil {
		t.Fatal(err)
	}
	type got struct {
		Manifest, Config types.MediaType
		Layers           []types.MediaType
		DiffIDs          []string
		Entrypoint, Env  []string
		User             string
	}
	g := got{Manifest: m.MediaType, Config: m.Config.MediaType}
	for _, l := range m.Layers {
		g.Layers = append(g.Layers, l.MediaType)
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range cfg.RootFS.DiffIDs {
		g.DiffIDs = append(g.DiffIDs, d.String())
	}
	g.Entrypoint, g.Env, g.User = cfg.Config.Entrypoint, cfg.Config.Env, cfg.Config.User
	want := got{
		Manifest: types.OCIManifestSchema1, Config: types.OCIConfigJSON,
		Layers:     []types.MediaType{types.OCILayerZStd, types.OCILayerZStd},
		DiffIDs:    []string{baseID, venvID},
		Entrypoint: []string{"/opt/vllm/bin/vllm"}, Env: []string{"PATH=/opt/vllm/bin:/usr/bin", "HOME=/root"},
		User: "0:0",
	}
	if d := cmp.Diff(want, g); d != "" {
		t.Errorf("image (-want +got):\n%s", d)
	}
	// A layer's digest is its compressed file's: the registry is asked for what the cache holds.
	b, err := os.ReadFile(base)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(b)
	if got, want := m.Layers[0].Digest.String(), "sha256:"+hex.EncodeToString(sum[:]); got != want {
		t.Errorf("base layer's digest %s, want its file's %s", got, want)
	}
}

func TestLayeredRefusesAMissingLayer(t *testing.T) {
	if _, err := layered([]string{filepath.Join(t.TempDir(), "absent.tar.zst")}, "", "0:0", "/", nil); err == nil {
		t.Fatal("an image of a layer file that does not exist was built")
	}
}
