// Small helpers shared by the files of this package.

package render

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"sort"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
)

// defaulted is a copy of pdc with every default applied, for the exported builders to read
// plain values from; pdc itself is never changed.
func defaulted(pdc *v1alpha1.PDCluster) *v1alpha1.PDCluster {
	out := pdc.DeepCopy()
	out.SetDefaults()
	return out
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// mergeBy is base with over's items over it: an item whose key base has replaces it in place,
// the others are appended in order.
func mergeBy[T any](base, over []T, key func(T) string) []T {
	for _, o := range over {
		if i := slices.IndexFunc(base, func(b T) bool { return key(b) == key(o) }); i >= 0 {
			base[i] = o
		} else {
			base = append(base, o)
		}
	}
	return base
}

// mergeMaps is a copy of base with over's keys over it; nil when both are empty.
func mergeMaps[K comparable, V any](base, over map[K]V) map[K]V {
	if len(base) == 0 && len(over) == 0 {
		return nil
	}
	out := maps.Clone(base)
	if out == nil {
		out = make(map[K]V, len(over))
	}
	maps.Copy(out, over)
	return out
}

func hashOf(v any) (string, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return "", fmt.Errorf("hash pod template inputs: %w", err)
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:8]), nil
}
