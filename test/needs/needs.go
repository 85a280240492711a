// Package needs skips a test whose tool or asset this machine lacks, except in CI: there a
// skip would let a suite pass without running (`make test` and .ci/run provide everything), so
// the test fails and says what is missing.
package needs

import (
	"fmt"
	"os"
	"testing"
)

// Skip skips t with why, or fails it when CI is set.
func Skip(t testing.TB, format string, args ...any) {
	t.Helper()
	why := fmt.Sprintf(format, args...)
	if os.Getenv("CI") != "" {
		t.Fatalf("%s; CI is set, so this fails instead of skipping (make test provides it)", why)
	}
	t.Skip(why)
}
