// Package docs checks that what README.md and docs/ name in code spans exists in the
// repository: paths, Go tests and benchmarks, Python tests, command-line flags and pdcluster_*
// metrics. A stale doc is a bug, and these are the claims a reader acts on first.
package docs

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"sigs.k8s.io/yaml"
)

const root = "../.."

// topLevel are the repository's entries a path in the docs may start with.
var topLevel = []string{"api/", "controllers/", "connector/", "internal/", "cmd/", "test/", "config/", "charts/", "hack/", "docs/", ".ci/"}

var rootFiles = []string{"Makefile", "go.mod", "go.sum", "README.md", "Dockerfile"}

// doc is one Markdown file and its code spans.
type doc struct {
	path  string
	text  string
	spans []string
}

var (
	codeSpan  = regexp.MustCompile("`([^`\n]+)`")
	goTest    = regexp.MustCompile(`\b(?:Test|Benchmark)[A-Z][A-Za-z0-9_]*`)
	pyTest    = regexp.MustCompile(`\b(test_[a-z0-9_]+)\.([A-Z][A-Za-z0-9_]*)(?:\.(test_[a-z0-9_]+))?`)
	flag      = regexp.MustCompile(`(?:^|\s)(--[a-z][a-z0-9-]*)`)
	metric    = regexp.MustCompile(`\bpdcluster_[a-z0-9_]+`)
	metricDef = regexp.MustCompile(`(?:Name:\s*|NewDesc\(\s*)"(pdcluster_[a-z0-9_]+)"`)
)

// docs are README.md and docs/**/*.md with their code spans, read once for every test.
func docs(t *testing.T) []doc {
	t.Helper()
	docsOnce.Do(func() { docsRead, docsErr = readDocs() })
	if docsErr != nil {
		t.Fatal(docsErr)
	}
	if len(docsRead) < 5 {
		t.Fatalf("found %d docs", len(docsRead))
	}
	return docsRead
}

var (
	docsOnce sync.Once
	docsRead []doc
	docsErr  error
)

func readDocs() ([]doc, error) {
	files := []string{filepath.Join(root, "README.md")}
	err := filepath.WalkDir(filepath.Join(root, "docs"), func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() && strings.HasSuffix(p, ".md") {
			files = append(files, p)
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	var out []doc
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			return nil, err
		}
		d := doc{path: strings.TrimPrefix(f, root+"/"), text: string(b)}
		for _, m := range codeSpan.FindAllStringSubmatch(string(b), -1) {
			d.spans = append(d.spans, m[1])
		}
		out = append(out, d)
	}
	return out, nil
}

// sources reads every file of the repository outside docs, bin and hidden directories (but
// .ci) that keep says to. The repository is walked once for every test, and each file read
// once.
func sources(t *testing.T, keep func(path string) bool) map[string]string {
	t.Helper()
	repoOnce.Do(func() { repoPaths, repoErr = walkRepo() })
	if repoErr != nil {
		t.Fatal(repoErr)
	}
	out := map[string]string{}
	for _, rel := range repoPaths {
		if !keep(rel) {
			continue
		}
		s, err := readRepoFile(rel)
		if err != nil {
			t.Fatal(err)
		}
		out[rel] = s
	}
	return out
}

var (
	repoOnce  sync.Once
	repoPaths []string
	repoErr   error
	readMu    sync.Mutex
	readFiles = map[string]string{}
)

func walkRepo() ([]string, error) {
	var paths []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel := strings.TrimPrefix(p, root+"/")
		if d.IsDir() {
			if rel == "bin" || rel == ".git" || rel == "docs" || strings.HasPrefix(d.Name(), ".") && rel != ".ci" && p != root {
				return filepath.SkipDir
			}
			return nil
		}
		paths = append(paths, rel)
		return nil
	})
	return paths, err
}

func readRepoFile(rel string) (string, error) {
	readMu.Lock()
	defer readMu.Unlock()
	if s, ok := readFiles[rel]; ok {
		return s, nil
	}
	b, err := os.ReadFile(filepath.Join(root, rel))
	if err != nil {
		return "", err
	}
	readFiles[rel] = string(b)
	return string(b), nil
}

// Every repository path a doc names exists (a glob matches something).
func TestDocsNameExistingPaths(t *testing.T) {
	checked := 0
	defer func() { atLeast(t, "paths", checked, 50) }()
	for _, d := range docs(t) {
		for _, span := range d.spans {
			for _, word := range strings.Fields(span) {
				p := strings.TrimRight(word, ".,;:)")
				p, _, _ = strings.Cut(p, "#")
				if i := strings.LastIndex(p, ":"); i > 0 && strings.Trim(p[i+1:], "0123456789-") == "" {
					p = p[:i]
				}
				p = strings.TrimPrefix(p, "./")
				if !slices.ContainsFunc(topLevel, func(tl string) bool { return strings.HasPrefix(p, tl) }) && !slices.Contains(rootFiles, p) {
					continue
				}
				if strings.ContainsAny(p, "<>${}=") {
					continue // a placeholder or an assignment, not a path
				}
				p = strings.TrimSuffix(strings.TrimSuffix(p, "..."), "/")
				checked++
				matches, err := filepath.Glob(filepath.Join(root, p))
				if err != nil || len(matches) == 0 {
					t.Errorf("%s names %s, which does not exist", d.path, p)
				}
			}
		}
	}
}

// Every Go test and benchmark a doc names is a function of some _test.go file, and every
// Python test (module.Class or module.Class.method) is in that module.
func TestDocsNameExistingTests(t *testing.T) {
	goFuncs := map[string]bool{}
	for _, src := range sources(t, func(p string) bool { return strings.HasSuffix(p, "_test.go") }) {
		for _, m := range regexp.MustCompile(`(?m)^func ((?:Test|Benchmark)\w+)\(`).FindAllStringSubmatch(src, -1) {
			goFuncs[m[1]] = true
		}
	}
	py := sources(t, func(p string) bool { return strings.HasSuffix(p, ".py") })
	checked := 0
	defer func() { atLeast(t, "tests", checked, 30) }()
	for _, d := range docs(t) {
		for _, span := range d.spans {
			for _, name := range goTest.FindAllString(span, -1) {
				checked++
				if !goFuncs[name] {
					t.Errorf("%s names %s, which no _test.go declares", d.path, name)
				}
			}
			for _, m := range pyTest.FindAllStringSubmatch(span, -1) {
				checked++
				found := false
				for p, src := range py {
					if filepath.Base(p) == m[1]+".py" && strings.Contains(src, "class "+m[2]) && (m[3] == "" || strings.Contains(src, "def "+m[3]+"(")) {
						found = true
					}
				}
				if !found {
					t.Errorf("%s names %s, which no Python test module declares", d.path, m[0])
				}
			}
		}
	}
}

// Every command-line flag a doc names is defined or used somewhere in the repository's code,
// scripts or manifests: ours are defined there, vLLM's are rendered there, tools' are used
// there.
func TestDocsNameExistingFlags(t *testing.T) {
	var code strings.Builder
	for _, src := range sources(t, func(p string) bool {
		ext := filepath.Ext(p)
		return ext == ".go" || ext == ".py" || ext == ".sh" || ext == ".yaml" || ext == ".tpl" || filepath.Base(p) == "Makefile" || p == ".ci/run"
	}) {
		code.WriteString(src)
		code.WriteByte('\n')
	}
	all := code.String()
	// vLLM's flags the design notes discuss that nothing here renders (yet).
	for _, name := range []string{"data-parallel-external-lb"} {
		all += "\n--" + name
	}
	checked := 0
	defer func() { atLeast(t, "flags", checked, 30) }()
	for _, d := range docs(t) {
		for _, span := range d.spans {
			for _, m := range flag.FindAllStringSubmatch(span, -1) {
				checked++
				name := strings.TrimPrefix(m[1], "--")
				if !strings.Contains(all, "--"+name) && !strings.Contains(all, `"`+name+`"`) {
					t.Errorf("%s names the flag --%s, which nothing in the repository defines or uses", d.path, name)
				}
			}
		}
	}
}

// Every pdcluster_* metric a doc names is declared by a package: a shipped one, or the stand-in
// engine's transfer engine (test/sim), whose metrics the docs of the sandbox describe
// (histograms with their _bucket, _sum and _count series).
func TestDocsNameExportedMetrics(t *testing.T) {
	exported := map[string]bool{}
	for _, src := range sources(t, func(p string) bool { return strings.HasSuffix(p, ".go") && !strings.HasSuffix(p, "_test.go") }) {
		for _, m := range metricDef.FindAllStringSubmatch(src, -1) {
			exported[m[1]] = true
		}
	}
	if !exported["pdcluster_router_requests_total"] {
		t.Fatalf("the grep found too little: %v", exported)
	}
	checked := 0
	defer func() { atLeast(t, "metrics", checked, 20) }()
	for _, d := range docs(t) {
		for _, span := range d.spans {
			for _, loc := range metric.FindAllStringIndex(span, -1) {
				m := span[loc[0]:loc[1]]
				if partOfPath(span, loc) {
					continue // controllers/pdcluster_controller.go
				}
				checked++
				base := m
				for _, suffix := range []string{"_bucket", "_sum", "_count"} {
					if b, ok := strings.CutSuffix(m, suffix); ok && exported[b] {
						base = b
					}
				}
				if !exported[base] && !strings.HasSuffix(m, "_") { // a prefix: pdcluster_router_*
					t.Errorf("%s names the metric %s, which no package declares", d.path, m)
				}
			}
		}
	}
}

// Every pdcluster_* metric a shipped package exports is named in the docs: in full, or as a
// `_suffix` in a paragraph or table row that names its prefix (the docs' shorthand:
// `pdcluster_router_retries_total`, `_ejections_total`). The other way round from TestDocsNameExportedMetrics: a metric added
// without a word for whoever reads the dashboards fails here.
func TestExportedMetricsAreDocumented(t *testing.T) {
	shipped := func(p string) bool {
		return strings.HasSuffix(p, ".go") && !strings.HasSuffix(p, "_test.go") &&
			slices.ContainsFunc([]string{"api/", "controllers/", "connector/", "internal/", "cmd/"}, func(dir string) bool { return strings.HasPrefix(p, dir) })
	}
	declared := map[string]bool{}
	for _, src := range sources(t, shipped) {
		for _, m := range metricDef.FindAllStringSubmatch(src, -1) {
			declared[m[1]] = true
		}
	}
	var paragraphs []string
	for _, d := range docs(t) {
		paragraphs = append(paragraphs, strings.Split(d.text, "\n\n")...)
	}
	atLeast(t, "exported metrics", len(declared), 40)
	for m := range declared {
		if !documented(m, paragraphs) {
			t.Errorf("the metric %s is exported and no doc names it (docs/observability.md lists the metrics)", m)
		}
	}
}

// documented reports whether a paragraph names metric m in full or as a `_suffix` after its
// prefix.
func documented(m string, paragraphs []string) bool {
	for _, l := range paragraphs {
		if strings.Contains(l, m) {
			return true
		}
		for i := len("pdcluster"); i < len(m); i++ {
			if m[i] == '_' && strings.Contains(l, "`"+m[i:]+"`") && strings.Contains(l, m[:i]+"_") {
				return true
			}
		}
	}
	return false
}

var (
	goFlagLine    = regexp.MustCompile(`^  -([a-z][a-z0-9-]*)(?: (.+))?$`)
	cobraFlagLine = regexp.MustCompile(`^ +(?:-[a-z], )?--([a-z][a-z0-9-]*)(?: ([a-zA-Z0-9]+))?(?: {2,}|$)`)
	flagTypes     = []string{"string", "int", "int32", "int64", "uint", "uint64", "float", "float64", "duration", "value", "strings", "stringArray"}
)

// Every flag in docs/binaries.md (each binary's own -h) shows its type, or none for a boolean:
// the flag package takes a back-quoted word of the help text for the argument's name, so a
// usage that quotes a command in back quotes tells the user the flag takes that command
// (connector's --control-listen said "-control-listen connector drain").
func TestBinaryFlagsShowTheirType(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(root, "docs", "binaries.md"))
	if err != nil {
		t.Fatal(err)
	}
	checked := 0
	for _, l := range strings.Split(string(b), "\n") {
		m := goFlagLine.FindStringSubmatch(l)
		if m == nil {
			m = cobraFlagLine.FindStringSubmatch(l)
		}
		if m == nil {
			continue
		}
		checked++
		if m[2] != "" && !slices.Contains(flagTypes, m[2]) {
			t.Errorf("docs/binaries.md: the flag --%s shows %q where its type goes: a back-quoted word in its usage?", m[1], m[2])
		}
	}
	atLeast(t, "flags in docs/binaries.md", checked, 60)
}

// atLeast fails a check that found fewer names than the docs hold: a pattern that stopped
// matching would otherwise pass with nothing checked.
func atLeast(t *testing.T, what string, n, want int) {
	t.Helper()
	if n < want {
		t.Errorf("checked %d %s in the docs, want at least %d: does the pattern still match?", n, what, want)
	}
	t.Logf("checked %d %s", n, what)
}

// notPDClusterFields are spec. and status. paths the docs name that are not a PDCluster's: other
// kinds' fields, a misspelling shown as one, fields named as removed.
var notPDClusterFields = map[string]string{
	"spec.clusterIP":              "a Service's",
	"spec.replicas":               "a Deployment's and a PoolScale's",
	"spec.prefil":                 "the misspelling pdctl validate refuses",
	"spec.connector.blockBytes":   "named as removed",
	"spec.connector.bufferBlocks": "named as removed",
	"status.hpaPodSelector":       "a LeaderWorkerSet's",
}

var fieldPath = regexp.MustCompile(`\b(?:spec|status)\.[A-Za-z][A-Za-z0-9_.<>-]*[A-Za-z0-9>]`)

// Every spec. and status. field the docs name is in the schema of the PDCluster or the
// PoolScale CRD (`<pool>` stands for prefill and decode).
func TestDocsNameExistingFields(t *testing.T) {
	var tops []*apiextensionsv1.JSONSchemaProps
	for _, f := range []string{"serving.pdcluster.dev_pdclusters.yaml", "serving.pdcluster.dev_poolscales.yaml"} {
		b, err := os.ReadFile(filepath.Join(root, "config/crd/bases", f))
		if err != nil {
			t.Fatal(err)
		}
		var crd apiextensionsv1.CustomResourceDefinition
		if err := yaml.Unmarshal(b, &crd); err != nil {
			t.Fatal(err)
		}
		tops = append(tops, crd.Spec.Versions[0].Schema.OpenAPIV3Schema)
	}
	exists := func(path string) bool {
		return slices.ContainsFunc(tops, func(top *apiextensionsv1.JSONSchemaProps) bool { return inSchema(top, path) })
	}
	checked := 0
	for _, d := range docs(t) {
		b, err := os.ReadFile(filepath.Join(root, d.path))
		if err != nil {
			t.Fatal(err)
		}
		for _, loc := range fieldPath.FindAllStringIndex(string(b), -1) {
			path := string(b)[loc[0]:loc[1]]
			if partOfPath(string(b), loc) {
				continue // controllers/status.go
			}
			if _, ok := notPDClusterFields[path]; ok {
				continue
			}
			checked++
			for _, p := range []string{strings.ReplaceAll(path, "<pool>", "prefill"), strings.ReplaceAll(path, "<pool>", "decode")} {
				if !exists(p) {
					t.Errorf("%s names %s, which neither the PDCluster nor the PoolScale CRD has", d.path, p)
					break
				}
			}
		}
	}
	atLeast(t, "fields", checked, 60)
}

// inSchema reports whether path (dot-separated field names) is in the schema below top.
func inSchema(top *apiextensionsv1.JSONSchemaProps, path string) bool {
	s := top
	for _, name := range strings.Split(path, ".") {
		for s.Items != nil && s.Items.Schema != nil { // a list's elements
			s = s.Items.Schema
		}
		next, ok := s.Properties[name]
		if !ok {
			if s.AdditionalProperties == nil || s.AdditionalProperties.Schema == nil {
				return false
			}
			next = *s.AdditionalProperties.Schema // a map's values
		}
		s = &next
	}
	return true
}

var makeTarget = regexp.MustCompile(`^make ([a-z][a-z-]*)`)

// Every `make TARGET` the docs name is a target of the Makefile.
func TestDocsNameExistingMakeTargets(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(root, "Makefile"))
	if err != nil {
		t.Fatal(err)
	}
	targets := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^([a-z][a-z-]*):`).FindAllStringSubmatch(string(b), -1) {
		targets[m[1]] = true
	}
	checked := 0
	for _, d := range docs(t) {
		for _, span := range d.spans {
			if m := makeTarget.FindStringSubmatch(span); m != nil {
				checked++
				if !targets[m[1]] {
					t.Errorf("%s names `make %s`, which the Makefile does not define", d.path, m[1])
				}
			}
		}
	}
	atLeast(t, "make targets", checked, 20)
}

// partOfPath reports whether the match at loc in text is part of a repository path: it follows
// a slash or ends in a source file's extension.
func partOfPath(text string, loc []int) bool {
	if loc[0] > 0 && text[loc[0]-1] == '/' {
		return true
	}
	m := text[loc[0]:loc[1]]
	for _, ext := range []string{".go", ".md", ".py", ".yaml", ".sh"} {
		if strings.HasSuffix(m, ext) || strings.HasPrefix(text[loc[1]:], ext) {
			return true
		}
	}
	return false
}
