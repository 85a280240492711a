// Package realengine runs what the operator renders for a PDCluster on real vLLM engines, as
// processes on loopback: each rendered pod's containers (vLLM's CPU build as the engine, the
// connector sidecar beside it) and the router in front. The tests beside it (build tag
// realengine, run by make test after the Go suites) prove the P/D path and the completion gate
// on vLLM itself.
package realengine

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	"pdcluster.dev/pdcluster-operator/test/wrappers"
)

// podIP is what the kubelet would give the pod: every pod of the harness is on loopback.
const podIP = "127.0.0.1"

// podLayout is one rendered pod laid out on loopback as a kubelet would run it: its volumes in a
// directory of its own (a root with a link per mount, so paths under a mount's parent resolve
// too), and its declared container ports renumbered, since every pod shares one address.
type podLayout struct {
	root    string
	ports   map[int32]int
	mounts  []string // the pod's mount paths and their parents, longest first
	volumes map[string]string
	// rewrites are value's path and port rewrites, compiled once from mounts and ports.
	rewrites []rewrite
}

// rewrite replaces what re matches in a value.
type rewrite struct {
	re   *regexp.Regexp
	with func(match string) string
}

// newPodLayout materialises spec's volumes under dir: a ConfigMap's data as files (from
// configMaps, by name), an emptyDir as a directory, a hostPath as itself. Other sources are
// refused: nothing rendered for these tests uses them.
func newPodLayout(dir string, spec corev1.PodSpec, configMaps map[string]*corev1.ConfigMap, ports map[int32]int) (*podLayout, error) {
	l := &podLayout{root: filepath.Join(dir, "root"), ports: ports, volumes: map[string]string{}}
	for _, v := range spec.Volumes {
		switch {
		case v.ConfigMap != nil:
			cm, ok := configMaps[v.ConfigMap.Name]
			if !ok {
				return nil, fmt.Errorf("volume %s: ConfigMap %s is not rendered", v.Name, v.ConfigMap.Name)
			}
			path := filepath.Join(dir, "volumes", v.Name)
			if err := os.MkdirAll(path, 0o755); err != nil {
				return nil, err
			}
			files := map[string]string{} // key -> file, all keys unless items pick some
			for key := range cm.Data {
				files[key] = key
			}
			if len(v.ConfigMap.Items) > 0 {
				files = map[string]string{}
				for _, item := range v.ConfigMap.Items {
					files[item.Key] = item.Path
				}
			}
			for key, file := range files {
				if err := os.WriteFile(filepath.Join(path, file), []byte(cm.Data[key]), 0o644); err != nil {
					return nil, err
				}
			}
			l.volumes[v.Name] = path
		case v.EmptyDir != nil:
			path := filepath.Join(dir, "volumes", v.Name)
			if err := os.MkdirAll(path, 0o755); err != nil {
				return nil, err
			}
			l.volumes[v.Name] = path
		case v.HostPath != nil:
			l.volumes[v.Name] = v.HostPath.Path
		default:
			return nil, fmt.Errorf("volume %s: only ConfigMap, emptyDir and hostPath volumes run on loopback", v.Name)
		}
	}
	for _, c := range append(append([]corev1.Container(nil), spec.InitContainers...), spec.Containers...) {
		for _, m := range c.VolumeMounts {
			src, ok := l.volumes[m.Name]
			if !ok {
				return nil, fmt.Errorf("container %s mounts volume %s, which the pod does not have", c.Name, m.Name)
			}
			src = filepath.Join(src, m.SubPath)
			link := filepath.Join(l.root, m.MountPath)
			if err := os.MkdirAll(filepath.Dir(link), 0o755); err != nil {
				return nil, err
			}
			if err := os.Symlink(src, link); err != nil && !os.IsExist(err) {
				return nil, err
			}
			for p := m.MountPath; p != "/" && p != "."; p = filepath.Dir(p) {
				if !slices.Contains(l.mounts, p) {
					l.mounts = append(l.mounts, p)
				}
			}
		}
	}
	slices.SortFunc(l.mounts, func(a, b string) int { return len(b) - len(a) })
	for _, m := range l.mounts {
		re := regexp.MustCompile(`(^|[=:/])` + regexp.QuoteMeta(m) + `(/|:|$)`)
		to := filepath.Join(l.root, m)
		l.rewrites = append(l.rewrites, rewrite{re, func(match string) string { return re.ReplaceAllString(match, "${1}"+to+"${2}") }})
	}
	l.rewrites = append(l.rewrites, rewrite{regexp.MustCompile(regexp.QuoteMeta("0.0.0.0")), func(string) string { return podIP }})
	for from, to := range l.ports {
		p := strconv.Itoa(int(from))
		// A port alone (a flag's or a variable's value) or after a host (":8190", "h:8000/x",
		// and in JSON, "tcp://*:5557").
		l.rewrites = append(l.rewrites, rewrite{regexp.MustCompile(`(^|:)` + p + `(/|"|$)`), func(match string) string {
			return strings.Replace(match, p, strconv.Itoa(to), 1)
		}})
	}
	return l, nil
}

// value is one argument or environment value as the pod's process sees it on loopback: paths
// under a mount moved under the pod's root, the pod's declared ports renumbered, and the
// wildcard address narrowed to loopback.
func (l *podLayout) value(s string) string {
	for _, r := range l.rewrites {
		s = r.re.ReplaceAllStringFunc(s, r.with)
	}
	// A listen address without a host binds every interface in a pod; here, loopback.
	if strings.HasPrefix(s, ":") {
		s = podIP + s
	}
	if i := strings.Index(s, "=:"); i >= 0 && strings.HasPrefix(s, "--") {
		s = s[:i+1] + podIP + s[i+1:]
	}
	return s
}

// env is c's environment as the kubelet sets it (values, then $(VAR) references to earlier
// variables, the pod IP from the downward API), laid out for loopback.
func (l *podLayout) env(c corev1.Container) ([]string, map[string]string, error) {
	vars := map[string]string{}
	var out []string
	for _, e := range c.Env {
		v := e.Value
		switch {
		case e.ValueFrom == nil:
			v = l.value(expand(v, vars))
		case e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "status.podIP":
			v = podIP
		case e.ValueFrom.ResourceFieldRef != nil:
			var err error
			if v, err = resourceValue(c, e.ValueFrom.ResourceFieldRef); err != nil {
				return nil, nil, fmt.Errorf("container %s: env %s: %w", c.Name, e.Name, err)
			}
		default:
			return nil, nil, fmt.Errorf("container %s: env %s: only the pod IP and the container's resources come from the downward API on loopback", c.Name, e.Name)
		}
		vars[e.Name] = v
		out = append(out, e.Name+"="+v)
	}
	return out, vars, nil
}

// resourceValue is the downward API's value of ref for c: its limit or request over the
// divisor. A memory limit c does not set is the node's memory, as the kubelet gives it.
func resourceValue(c corev1.Container, ref *corev1.ResourceFieldSelector) (string, error) {
	var node corev1.ResourceList
	if ref.Resource == "limits.memory" {
		b, err := os.ReadFile("/proc/meminfo")
		var kib int64
		if err == nil {
			_, err = fmt.Sscanf(string(b), "MemTotal: %d kB", &kib)
		}
		if err != nil {
			return "", fmt.Errorf("the node's memory for %s: %w", ref.Resource, err)
		}
		node = corev1.ResourceList{corev1.ResourceMemory: *resource.NewQuantity(kib<<10, resource.BinarySI)}
	}
	v, ok := wrappers.ResourceFieldValue(c, ref, node)
	if !ok {
		return "", fmt.Errorf("%s is not set and has no stand-in on loopback", ref.Resource)
	}
	return v, nil
}

// args are c's command and arguments, $(VAR) expanded as the kubelet does and laid out.
func (l *podLayout) args(c corev1.Container, vars map[string]string) []string {
	var out []string
	for _, a := range append(append([]string(nil), c.Command...), c.Args...) {
		out = append(out, l.value(expand(a, vars)))
	}
	return out
}

var varRef = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

// expand replaces $(NAME) with a defined variable, and leaves an undefined one as it is, as
// the kubelet does.
func expand(s string, vars map[string]string) string {
	return varRef.ReplaceAllStringFunc(s, func(ref string) string {
		if v, ok := vars[ref[2:len(ref)-1]]; ok {
			return v
		}
		return ref
	})
}
