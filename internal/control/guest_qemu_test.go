package control_test

import (
	"context"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kdomanski/iso9660"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// waitGuest polls GET /v1/vms/{id}/guest until ok accepts the answer.
func waitGuest(t *testing.T, c *client.Client, id string, within time.Duration, ok func(api.GuestStatus) bool) api.GuestStatus {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		g, err := c.VMGuest(context.Background(), id)
		if err == nil && ok(g) {
			return g
		}
		if time.Now().After(deadline) {
			con, _ := c.VMConsole(context.Background(), id, 4096)
			t.Fatalf("vm %s: guest status %+v (err %v) not reached within %s; console tail:\n%s", id, g, err, within, con)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

func cloudInitDone(g api.GuestStatus) bool { return g.CloudInit == api.CloudInitDone }

// A busybox guest reads the seed the control API gave it: the hostname and
// user-data digest it prints equal what the API applied and reports. The
// seed survives an agent restart and a stop/start (the next boot prints the
// same digest), and a fork child is a new instance: its own instance-id
// and hostname, which its guest takes at its next boot.
func TestQEMUBusyboxGuestReadsItsSeed(t *testing.T) {
	if testing.Short() {
		t.Skip("boots real guests")
	}
	c := testenv.StartControl(t, testenv.ControlOptions{})
	a := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu"})
	c.RegisterHost(t, "h1", a.Address)
	ctx := context.Background()
	userData := "#cloud-config\nwrite_files:\n- path: /etc/motd\n  content: seeded by the control API\n"
	vm, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "Seeded_VM", Image: "busybox", VCPUs: 1, MemoryMiB: 128, DiskMiB: 64,
		UserData: userData, MetaData: map[string]string{"role": "test"}}, "")
	if err != nil {
		t.Fatal(err)
	}
	if vm.Hostname != "seeded-vm" || vm.UserDataSHA256 == "" || vm.StartedFrom != api.StartedCold {
		t.Fatalf("created: %+v", vm)
	}
	same := func(g api.GuestStatus) bool {
		return cloudInitDone(g) && g.Hostname == vm.Hostname && g.UserDataSHA256 == vm.UserDataSHA256
	}
	waitGuest(t, c.Client, vm.ID, 3*time.Minute, cloudInitDone)
	if g := waitGuest(t, c.Client, vm.ID, time.Second, cloudInitDone); !same(g) {
		t.Fatalf("guest reports %+v; the API applied hostname %s and user data %s", g, vm.Hostname, vm.UserDataSHA256)
	}

	// An agent restart re-adopts the running guest; its seed and what it
	// printed this boot stay.
	a.Restart(t)
	if g := waitGuest(t, c.Client, vm.ID, 30*time.Second, func(api.GuestStatus) bool { return true }); !same(g) {
		t.Fatalf("after an agent restart: %+v", g)
	}

	// Stop and start: the next boot reads the same seed again.
	stopped, running := api.PowerStopped, api.PowerRunning
	if _, err := c.Client.UpdateVM(ctx, vm.ID, api.VMPatch{PowerState: &stopped}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Client.UpdateVM(ctx, vm.ID, api.VMPatch{PowerState: &running}); err != nil {
		t.Fatal(err)
	}
	if g := waitGuest(t, c.Client, vm.ID, 3*time.Minute, cloudInitDone); !same(g) {
		t.Fatalf("after stop/start: %+v", g)
	}
	con, err := c.Client.VMConsole(ctx, vm.ID, 0)
	if err != nil || strings.Count(con, "kvm-guest-userdata-sha256 "+vm.UserDataSHA256) != 2 {
		t.Fatalf("want the digest printed by two boots; console (%v):\n%s", err, con)
	}

	// A fork child: restored from the snapshot it continues the source's
	// boot; its own seed (instance-id its id) is read at its next boot.
	f, err := c.Client.CreateFork(ctx, api.ForkCreate{SourceVMID: vm.ID, Count: 1}, "")
	if err != nil || len(f.Children) != 1 {
		t.Fatalf("fork: %+v %v", f, err)
	}
	child := f.Children[0]
	if child.Hostname == vm.Hostname || child.UserDataSHA256 != vm.UserDataSHA256 {
		t.Fatalf("child %+v: want its own hostname and the source's user data", child)
	}
	label, files := readSeedISO(t, filepath.Join(a.StateDir, "vms", child.ID, "seed.iso"))
	var meta map[string]any
	if err := json.Unmarshal(files["meta-data"], &meta); err != nil || label != "cidata" || meta["instance-id"] != child.ID ||
		meta["local-hostname"] != child.Hostname || meta["role"] != "test" {
		t.Fatalf("child's seed (label %q) meta-data %s (%v): want instance-id %s, hostname %s", label, files["meta-data"], err, child.ID, child.Hostname)
	}
	if g, err := c.Client.VMGuest(ctx, child.ID); err != nil || g.CloudInit != api.CloudInitNone {
		t.Errorf("restored child: %+v %v, want none until its next boot", g, err)
	}
	if _, err := c.Client.UpdateVM(ctx, child.ID, api.VMPatch{PowerState: &stopped}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Client.UpdateVM(ctx, child.ID, api.VMPatch{PowerState: &running}); err != nil {
		t.Fatal(err)
	}
	g := waitGuest(t, c.Client, child.ID, 3*time.Minute, cloudInitDone)
	if g.Hostname != child.Hostname || g.UserDataSHA256 != vm.UserDataSHA256 {
		t.Fatalf("child after its next boot: %+v, want hostname %s", g, child.Hostname)
	}
	// The source still runs as it did.
	if g := waitGuest(t, c.Client, vm.ID, time.Second, cloudInitDone); !same(g) {
		t.Errorf("source after the fork: %+v", g)
	}

	// A VM without guest configuration has no seed: its guest prints none
	// of the seed's lines, and its status stays none. (The others go first:
	// the host's memory is the machine's.)
	if err := c.Client.DeleteFork(ctx, f.ID); err != nil {
		t.Fatal(err)
	}
	if err := c.Client.DeleteVM(ctx, vm.ID); err != nil {
		t.Fatal(err)
	}
	plain, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "plain", Image: "busybox", VCPUs: 1, MemoryMiB: 128, DiskMiB: 64}, "")
	if err != nil {
		t.Fatal(err)
	}
	out := waitConsoleCount(t, a, plain.ID, `(?m)^tick 1\r?$`, 1, 3*time.Minute)
	if strings.Contains(out, "kvm-guest-hostname") || strings.Contains(out, "kvm-guest-userdata-sha256") || strings.Contains(out, "Cloud-init") {
		t.Errorf("a guest without a seed printed seed lines:\n%s", out)
	}
	if g, err := c.Client.VMGuest(ctx, plain.ID); err != nil || g.CloudInit != api.CloudInitNone || g.Hostname != "" || g.UserDataSHA256 != "" {
		t.Errorf("plain guest: %+v %v", g, err)
	}
	if err := c.Client.DeleteVM(ctx, plain.ID); err != nil {
		t.Fatal(err)
	}

	// User data that is a script runs, as under cloud-init: one that fails
	// makes the status error; one that never ends keeps it running while
	// the guest goes on (its ticks).
	failing, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "failing", Image: "busybox", VCPUs: 1, MemoryMiB: 128, DiskMiB: 64,
		UserData: "#!/bin/sh\necho kvm-test-script-ran\nexit 3\n"}, "")
	if err != nil {
		t.Fatal(err)
	}
	blocking, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "blocking", Image: "busybox", VCPUs: 1, MemoryMiB: 128, DiskMiB: 64,
		UserData: "#!/bin/sh\necho kvm-test-script-blocks\nsleep 100000\n"}, "")
	if err != nil {
		t.Fatal(err)
	}
	g = waitGuest(t, c.Client, failing.ID, 3*time.Minute, func(g api.GuestStatus) bool { return g.CloudInit == api.CloudInitError })
	// The control API passes on the line that made it an error.
	if len(g.CloudInitErrors) != 1 || !strings.HasSuffix(g.CloudInitErrors[0], "util.py[WARNING]: Failed running /tmp/user-data [3]") {
		t.Errorf("failing script: guest %+v, want the script's failure line in cloud_init_errors", g)
	}
	if con, err := c.Client.VMConsole(ctx, failing.ID, 0); err != nil || !strings.Contains(con, "kvm-test-script-ran") {
		t.Errorf("failing script's output not on the console (%v):\n%s", err, con)
	}
	waitConsoleCount(t, a, blocking.ID, `(?m)^tick 3\r?$`, 1, 3*time.Minute)
	con, err = c.Client.VMConsole(ctx, blocking.ID, 0)
	if err != nil || !strings.Contains(con, "kvm-test-script-blocks") || strings.Contains(con, "finished at") {
		t.Errorf("blocking script: console (%v):\n%s", err, con)
	}
	if g, err := c.Client.VMGuest(ctx, blocking.ID); err != nil || g.CloudInit != api.CloudInitRunning {
		t.Errorf("blocking script: guest %+v %v, want running", g, err)
	}
}

// readSeedISO reads a seed ISO the way any ISO 9660 reader does (the
// control plane's tests do not import the agent's packages).
func readSeedISO(t *testing.T, path string) (string, map[string][]byte) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	img, err := iso9660.OpenImage(f)
	if err != nil {
		t.Fatal(err)
	}
	label, err := img.Label()
	if err != nil {
		t.Fatal(err)
	}
	root, err := img.RootDir()
	if err != nil {
		t.Fatal(err)
	}
	children, err := root.GetChildren()
	if err != nil {
		t.Fatal(err)
	}
	files := map[string][]byte{}
	for _, c := range children {
		b, err := io.ReadAll(c.Reader())
		if err != nil {
			t.Fatal(err)
		}
		files[c.Name()] = b
	}
	return label, files
}
