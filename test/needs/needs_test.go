package needs

import (
	"os"
	"os/exec"
	"strings"
	"testing"
)

// Run as a child with CI set or not, a test that needs what it lacks fails or skips.
func TestSkipFailsInCI(t *testing.T) {
	if os.Getenv("NEEDS_CHILD") != "" {
		Skip(t, "lua5.9 is not installed")
		return
	}
	for _, tc := range []struct {
		ci   string
		fail bool
		want string
	}{
		{"", false, "--- SKIP: TestSkipFailsInCI"},
		{"true", true, "lua5.9 is not installed; CI is set, so this fails instead of skipping"},
	} {
		cmd := exec.Command(os.Args[0], "-test.run=^TestSkipFailsInCI$", "-test.v")
		cmd.Env = append(os.Environ(), "NEEDS_CHILD=1", "CI="+tc.ci)
		out, err := cmd.CombinedOutput()
		if (err != nil) != tc.fail || !strings.Contains(string(out), tc.want) {
			t.Errorf("CI=%q: err %v, output:\n%s\nwant failed %v and %q", tc.ci, err, out, tc.fail, tc.want)
		}
	}
}
