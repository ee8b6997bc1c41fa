package testenv

import (
	"fmt"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
)

// BuildProvider builds this tree's provider into dir/terraform-provider-kvm
// for the real CLI, which finds it there through DevOverridesConfig.
func BuildProvider(t testing.TB, dir string) {
	t.Helper()
	build := exec.Command("go", "build", "-o", filepath.Join(dir, "terraform-provider-kvm"), "./provider")
	build.Dir = moduleRoot()
	if b, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building the provider (./provider) into %s: %v\n%s", dir, err, b)
	}
}

// DevOverridesConfig is a CLI configuration (TF_CLI_CONFIG_FILE) that
// points the given provider sources (e.g. "kvmfleet/kvm") at local
// directories with dev_overrides: the CLI runs the binary it finds there,
// skips `init` for them, and needs no registry.
func DevOverridesConfig(overrides map[string]string) string {
	sources := make([]string, 0, len(overrides))
	for s := range overrides {
		sources = append(sources, s)
	}
	sort.Strings(sources)
	var b strings.Builder
	b.WriteString("provider_installation {\n  dev_overrides {\n")
	for _, s := range sources {
		fmt.Fprintf(&b, "    %q = %q\n", s, overrides[s])
	}
	b.WriteString("  }\n  direct {}\n}\n")
	return b.String()
}
