package release

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestReadmeDemoLinePromisesWhatDemoDoes: the README's set-up line for make
// demo promises only what scripts/demo.sh does on a fresh machine. The demo
// logs in over SSH only to the Debian guest, which it does not build (make
// image-debian or make test does, minutes of mmdebstrap); without it the
// guest is busybox, which has no SSH server. So a line that promises an SSH
// login must say when, and what the demo does otherwise.
func TestReadmeDemoLinePromisesWhatDemoDoes(t *testing.T) {
	root := filepath.Join("..", "..")
	readme, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	demo, err := os.ReadFile(filepath.Join(root, "scripts", "demo.sh"))
	if err != nil {
		t.Fatal(err)
	}
	var line string
	for _, l := range strings.Split(string(readme), "\n") {
		if strings.HasPrefix(l, "make demo ") {
			line = l
			break
		}
	}
	if line == "" {
		t.Fatal("README.md has no `make demo   # ...` set-up line")
	}
	// The demo's busybox branch: no SSH login there.
	busyboxBranch := strings.Contains(string(demo), "\nbusybox)\n") && strings.Contains(string(demo), "it has no SSH server to log in to")
	buildsDebian := strings.Contains(string(demo), "make image-debian") && !strings.Contains(string(demo), `-f "$debian_cache/image.json"`)
	if strings.Contains(line, "over SSH") && busyboxBranch && !buildsDebian {
		for _, want := range []string{"make image-debian", "busybox"} {
			if !strings.Contains(line, want) {
				t.Errorf("README's make demo line promises an SSH login, but scripts/demo.sh logs in only to a Debian guest built beforehand "+
					"and checks the busybox guest's report otherwise; the line does not name %q:\n%s", want, line)
			}
		}
	}
}
