// Command imagebuild builds the project's container images without a Docker daemon and pushes
// them to a registry: each image is an empty base with one layer of static binaries (no base
// image can be pulled here, and the binaries need none).
//
//	imagebuild --registry 127.0.0.1:5000/pdcluster --tag v0.1.0 \
//	  connector=bin/connector router=bin/router vllm-sim=bin/vllm:/usr/local/bin/vllm ...
//
// Each argument is image=file[:path][,file[:path]...]; the first file is the entrypoint, and a
// file without a path goes to /usr/local/bin/<its name>.
//
// An image of prebuilt layers (vLLM's CPU engine image, hack/vllm-image.sh) is the subcommand
// layers: each layer a zstd tarball, pushed as an OCI image; a layer the registry already has is
// not sent again.
//
//	imagebuild layers --ref 127.0.0.1:5000/pdcluster/vllm-cpu:0.32.0 --entrypoint /opt/vllm/bin/vllm \
//	  --env PATH=/opt/vllm/bin:/usr/bin:/bin base.tar.zst vllm.tar.zst ...
package main

import (
	"archive/tar"
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"runtime"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "layers" {
		if err := layersMain(os.Args[2:]); err != nil {
			fmt.Fprintf(os.Stderr, "imagebuild layers: %v\n", err)
			os.Exit(1)
		}
		return
	}
	registry := flag.String("registry", "127.0.0.1:5000/pdcluster", "repository prefix the images are pushed under")
	tag := flag.String("tag", "", "image tag (the chart's appVersion)")
	user := flag.String("user", "65532:65532", "user the images run as, unless an image's spec ends in @root")
	flag.Parse()
	if *tag == "" || flag.NArg() == 0 {
		fmt.Fprintln(os.Stderr, "usage: imagebuild --registry R --tag T image=file[:path][,...][@root]...")
		os.Exit(2)
	}
	for _, spec := range flag.Args() {
		ref, digest, err := build(*registry, *tag, *user, spec)
		if err != nil {
			fmt.Fprintf(os.Stderr, "imagebuild: %s: %v\n", spec, err)
			os.Exit(1)
		}
		fmt.Printf("%s@%s\n", ref, digest)
	}
}

type file struct{ src, dst string }

func parse(spec, defaultUser string) (image string, files []file, user string, err error) {
	image, list, ok := strings.Cut(spec, "=")
	if !ok || image == "" || list == "" {
		return "", nil, "", fmt.Errorf("want image=file[:path][,...]")
	}
	user = defaultUser
	if l, ok := strings.CutSuffix(list, "@root"); ok {
		list, user = l, "0:0"
	}
	for f := range strings.SplitSeq(list, ",") {
		src, dst, ok := strings.Cut(f, ":")
		if !ok {
			dst = "/usr/local/bin/" + filepath.Base(src)
		}
		files = append(files, file{src, dst})
	}
	return image, files, user, nil
}

func build(registry, tag, defaultUser, spec string) (string, v1.Hash, error) {
	image, files, user, err := parse(spec, defaultUser)
	if err != nil {
		return "", v1.Hash{}, err
	}
	layerTar, err := tarOf(files)
	if err != nil {
		return "", v1.Hash{}, err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(layerTar)), nil })
	if err != nil {
		return "", v1.Hash{}, err
	}
	img, err := mutate.AppendLayers(empty.Image, layer)
	if err != nil {
		return "", v1.Hash{}, err
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		return "", v1.Hash{}, err
	}
	cfg = cfg.DeepCopy()
	cfg.OS, cfg.Architecture = "linux", runtime.GOARCH
	cfg.Config.Entrypoint = []string{files[0].dst}
	cfg.Config.Env = []string{"PATH=/usr/local/bin:/usr/bin:/bin"}
	cfg.Config.User = user
	cfg.Config.Labels = map[string]string{"org.opencontainers.image.source": "https://github.com/pdcluster-dev/pdcluster-operator"}
	if img, err = mutate.ConfigFile(img, cfg); err != nil {
		return "", v1.Hash{}, err
	}
	ref, err := name.NewTag(registry+"/"+image+":"+tag, name.Insecure)
	if err != nil {
		return "", v1.Hash{}, err
	}
	if err := remote.Write(ref, img); err != nil {
		return "", v1.Hash{}, fmt.Errorf("push %s: %w", ref, err)
	}
	d, err := img.Digest()
	return ref.String(), d, err
}

// tarOf is one layer holding files, with their parent directories, a /tmp and fixed times so
// the same binaries give the same digest.
func tarOf(files []file) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	dirs := map[string]bool{}
	addDir := func(d string, mode int64) error {
		if d == "/" || d == "." || dirs[d] {
			return nil
		}
		dirs[d] = true
		return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: strings.TrimPrefix(d, "/") + "/", Mode: mode})
	}
	if err := addDir("/tmp", 0o1777); err != nil {
		return nil, err
	}
	for _, f := range files {
		b, err := os.ReadFile(f.src)
		if err != nil {
			return nil, err
		}
		var parents []string
		for d := path.Dir(f.dst); d != "/" && d != "."; d = path.Dir(d) {
			parents = append([]string{d}, parents...)
		}
		for _, d := range parents {
			if err := addDir(d, 0o755); err != nil {
				return nil, err
			}
		}
		mode := int64(0o644)
		if st, err := os.Stat(f.src); err == nil && st.Mode()&0o111 != 0 {
			mode = 0o755
		}
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: strings.TrimPrefix(f.dst, "/"), Mode: mode, Size: int64(len(b))}); err != nil {
			return nil, err
		}
		if _, err := tw.Write(b); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// stringList is a repeatable flag.
type stringList []string

func (l *stringList) String() string     { return strings.Join(*l, ",") }
func (l *stringList) Set(v string) error { *l = append(*l, v); return nil }

// layersMain pushes an OCI image made of prebuilt zstd layer tarballs, in order.
func layersMain(args []string) error {
	fs := flag.NewFlagSet("layers", flag.ContinueOnError)
	refFlag := fs.String("ref", "", "image reference to push, registry/repository:tag")
	entrypoint := fs.String("entrypoint", "", "the image's entrypoint")
	user := fs.String("user", "0:0", "user the image runs as")
	workdir := fs.String("workdir", "/", "the image's working directory")
	var env stringList
	fs.Var(&env, "env", "KEY=VALUE of the image's environment (repeatable)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *refFlag == "" || fs.NArg() == 0 {
		return errors.New("usage: imagebuild layers --ref R [--entrypoint E] [--env K=V]... LAYER.tar.zst [LAYER.tar.zst ...]")
	}
	img, err := layered(fs.Args(), *entrypoint, *user, *workdir, env)
	if err != nil {
		return err
	}
	ref, err := name.NewTag(*refFlag, name.Insecure)
	if err != nil {
		return err
	}
	if err := remote.Write(ref, img); err != nil {
		return fmt.Errorf("push %s: %w", ref, err)
	}
	d, err := img.Digest()
	if err != nil {
		return err
	}
	fmt.Printf("%s@%s\n", ref, d)
	return nil
}

// layered is the OCI image of layers (zstd tarballs) with the given config.
func layered(layers []string, entrypoint, user, workdir string, env []string) (v1.Image, error) {
	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	for _, p := range layers {
		l, err := tarball.LayerFromFile(p, tarball.WithMediaType(types.OCILayerZStd))
		if err != nil {
			return nil, fmt.Errorf("layer %s: %w", p, err)
		}
		if img, err = mutate.AppendLayers(img, l); err != nil {
			return nil, fmt.Errorf("layer %s: %w", p, err)
		}
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cfg = cfg.DeepCopy()
	cfg.OS, cfg.Architecture = "linux", runtime.GOARCH
	if entrypoint != "" {
		cfg.Config.Entrypoint = []string{entrypoint}
	}
	cfg.Config.Env = env
	cfg.Config.User = user
	cfg.Config.WorkingDir = workdir
	cfg.Config.Labels = map[string]string{"org.opencontainers.image.source": "https://github.com/pdcluster-dev/pdcluster-operator"}
	return mutate.ConfigFile(img, cfg)
}
