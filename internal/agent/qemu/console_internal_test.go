package qemu

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
)

// A trim keeps the last boot's head and the latest lines within the cap;
// trimming again keeps the same head and one note; a log within the cap
// is left alone.
func TestTrimConsoleKeepsHeadAndTail(t *testing.T) {
	const limit = 64 << 10
	path := filepath.Join(t.TempDir(), "console.log")
	var b strings.Builder
	b.WriteString("old boot line\r\n" + agent.ConsoleBootMarker + "vm-1 at now\r\nfirst line of this boot\r\n")
	for i := range 20000 {
		fmt.Fprintf(&b, "line %d\r\n", i)
	}
	if err := os.WriteFile(path, []byte(b.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	check := func(when string) string {
		t.Helper()
		got, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		s := string(got)
		if len(got) > limit {
			t.Errorf("%s: %d bytes, want at most %d", when, len(got), limit)
		}
		if !strings.HasPrefix(s, agent.ConsoleBootMarker+"vm-1 at now\r\nfirst line of this boot\r\n") {
			t.Errorf("%s: does not start with the boot's head: %q", when, s[:min(len(s), 80)])
		}
		if n := strings.Count(s, consoleTrimmedNote); n != 1 {
			t.Errorf("%s: %d trim notes, want 1", when, n)
		}
		if strings.Contains(s, "old boot line") {
			t.Errorf("%s: an earlier boot's line is kept", when)
		}
		return s
	}
	if cut, err := trimConsole(path, limit); err != nil || !cut {
		t.Fatalf("trim: %v, %v; want cut", cut, err)
	}
	s := check("first trim")
	if !strings.HasSuffix(s, "line 19999\r\n") {
		t.Errorf("first trim lost the latest line: %q", s[len(s)-40:])
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 20000 {
		fmt.Fprintf(f, "more %d\r\n", i)
	}
	_ = f.Close()
	if cut, err := trimConsole(path, limit); err != nil || !cut {
		t.Fatalf("second trim: %v, %v; want cut", cut, err)
	}
	s = check("second trim")
	if !strings.HasSuffix(s, "more 19999\r\n") {
		t.Errorf("second trim lost the latest line")
	}
	if cut, err := trimConsole(path, limit); err != nil || cut {
		t.Errorf("trim of a log within its cap: %v, %v; want left alone", cut, err)
	}
}
