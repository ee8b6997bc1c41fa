package image_test

import (
	"context"
	"fmt"
	"path/filepath"
	"regexp"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// A real QEMU guest boots from an image the agent fetched: the busybox
// guest as a kernel bundle served on 127.0.0.1. A second VM of it on the
// same host starts without a second download.
func TestQEMUBootsFetchedBundle(t *testing.T) {
	if testing.Short() {
		t.Skip("boots real guests")
	}
	served := t.TempDir()
	sha := testenv.BundleImage(t, filepath.Join(testenv.GuestImageDir(t), "busybox"), filepath.Join(served, "busybox.tar"))
	srv := testenv.StartImageServer(t, served)
	a := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu", ImageDir: t.TempDir()})
	src := agentapi.ImageSource{Name: "busybox", SHA256: sha, SourceURL: srv.FileURL("busybox.tar"), Format: agentapi.ImageFormatKernel}
	ctx := context.Background()
	for i, id := range []string{"fetched-1", "fetched-2"} {
		spec := agentapi.VMSpec{Image: "busybox", VCPUs: 1, MemoryMiB: 128, DiskMiB: 64, ImageSource: &src}
		if _, err := a.Client.CreateVM(ctx, id, spec); err != nil {
			t.Fatalf("create %s: %v", id, err)
		}
		waitFor(t, a, id, `(?m)^kvm-guest-ready\r?$`)
		waitFor(t, a, id, fmt.Sprintf(`(?m)^disk vda %d\r?$`, int64(64)<<20))
		if n := srv.Downloads(); n != 1 {
			t.Fatalf("downloads after vm %d = %d, want 1", i+1, n)
		}
	}
}

func waitFor(t *testing.T, a *testenv.Agent, id, pattern string) {
	t.Helper()
	re := regexp.MustCompile(pattern)
	deadline := time.Now().Add(3 * time.Minute)
	for {
		con, err := a.Client.Console(context.Background(), id)
		if err == nil && re.MatchString(con) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("vm %s: no %q on the console; it shows:\n%s", id, pattern, con)
		}
		time.Sleep(200 * time.Millisecond)
	}
}
