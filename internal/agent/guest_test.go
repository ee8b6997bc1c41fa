package agent_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/seed"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// A VM with a seed gets seed.iso in its own directory (instance-id its id),
// kept across an agent restart and a stop/start, rebuilt the same when it
// went missing; the sim reports what the seed holds, as simulated.
func TestSeedIsBuiltKeptAndReported(t *testing.T) {
	dir := t.TempDir()
	h := startHarness(t, dir, 0)
	ctx := context.Background()
	userData := "#cloud-config\nhostname: ignored\n"
	s := spec
	s.NICs = []agentapi.NIC{{Network: "default", Mode: agentapi.NetworkUser, MACAddress: "52:54:00:00:00:01"}}
	s.Seed = &agentapi.SeedSpec{InstanceID: "seeded", Hostname: "web-1", UserData: userData,
		MetaData: map[string]string{"role": "web"}}
	if _, err := h.client.CreateVM(ctx, "seeded", s); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "vms", "seeded", agent.SeedFileName)
	files, label, err := seed.Read(path)
	if err != nil || label != seed.VolumeLabel {
		t.Fatalf("seed: %v, label %q", err, label)
	}
	if string(files[seed.FileUserData]) != userData {
		t.Errorf("user-data %q", files[seed.FileUserData])
	}
	sum := sha256.Sum256([]byte(userData))
	want := hex.EncodeToString(sum[:])
	check := func(when string) {
		t.Helper()
		g, err := h.client.Guest(ctx, "seeded")
		if err != nil {
			t.Fatalf("%s: guest: %v", when, err)
		}
		if g.CloudInit != agentapi.CloudInitDone || g.Hostname != "web-1" || g.UserDataSHA256 != want {
			t.Errorf("%s: guest %+v, want done, web-1, %s", when, g, want)
		}
	}
	check("after create")
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	// An agent restart keeps the seed (same file) and the report.
	h.stop()
	h = startHarness(t, dir, 0)
	check("after an agent restart")
	if fi2, err := os.Stat(path); err != nil || !fi2.ModTime().Equal(fi.ModTime()) {
		t.Errorf("seed rebuilt by the restart: %v %v", fi2, err)
	}
	// Stop/start keeps it; a seed lost meanwhile is built again, same files.
	if _, err := h.client.Action(ctx, "seeded", agentapi.ActionStop); err != nil {
		t.Fatal(err)
	}
	if g, err := h.client.Guest(ctx, "seeded"); err != nil || g.CloudInit != agentapi.CloudInitNone {
		t.Errorf("stopped vm: guest %+v %v, want none", g, err)
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if _, err := h.client.Action(ctx, "seeded", agentapi.ActionStart); err != nil {
		t.Fatal(err)
	}
	check("after stop, seed removed, start")
	again, _, err := seed.Read(path)
	if err != nil || string(again[seed.FileMetaData]) != string(files[seed.FileMetaData]) ||
		string(again[seed.FileNetworkConfig]) != string(files[seed.FileNetworkConfig]) {
		t.Errorf("rebuilt seed differs: %q vs %q (%v)", again[seed.FileMetaData], files[seed.FileMetaData], err)
	}
	// A VM without a seed has none, and reports none.
	if _, err := h.client.CreateVM(ctx, "plain", spec); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "vms", "plain", agent.SeedFileName)); !os.IsNotExist(err) {
		t.Errorf("plain vm has a seed: %v", err)
	}
	if g, err := h.client.Guest(ctx, "plain"); err != nil || g.CloudInit != agentapi.CloudInitNone || g.Hostname != "" {
		t.Errorf("plain vm: guest %+v %v", g, err)
	}
	// A seed the seed package refuses is a 400.
	bad := spec
	bad.Seed = &agentapi.SeedSpec{InstanceID: "bad", MetaData: map[string]string{"instance-id": "x"}}
	if _, err := h.client.CreateVM(ctx, "bad", bad); statusOf(err) != 400 {
		t.Errorf("bad seed: %v, want 400", err)
	}
}

// A snapshot records that its source had a seed disk, also when another
// agent pulls it: a child started there gets a seed of its own (its id),
// and a child without a seed spec still gets one, so the devices match. A
// seed on a child of a source without one is refused.
func TestSnapshotOfASeededVMGivesChildrenSeeds(t *testing.T) {
	a := startSnapAgent(t, t.TempDir())
	b := startSnapAgent(t, t.TempDir())
	ctx := context.Background()
	src := spec
	src.Seed = &agentapi.SeedSpec{InstanceID: "src", Hostname: "src", UserData: "#cloud-config\n{}\n"}
	if _, err := a.client.CreateVM(ctx, "src", src); err != nil {
		t.Fatal(err)
	}
	snap, err := a.client.CreateSnapshot(ctx, "fork-s", agentapi.SnapshotSpec{VMID: "src"})
	if err != nil || !snap.SeedDisk {
		t.Fatalf("snapshot of a seeded vm: %+v %v, want seed_disk", snap, err)
	}
	if err := a.agent.AllowAddress(a.srv.URL); err != nil {
		t.Fatal(err)
	}
	from := &agentapi.SnapshotSource{ID: "fork-s", Address: a.srv.URL, PublicKey: agentapi.EncodeKey(a.agent.PublicKey())}
	child := spec
	child.Snapshot = from
	child.Seed = &agentapi.SeedSpec{InstanceID: "child-0", Hostname: "child-0", UserData: "#cloud-config\n{}\n"}
	if _, err := b.client.CreateVM(ctx, "child-0", child); err != nil {
		t.Fatal(err)
	}
	files, _, err := seed.Read(filepath.Join(b.dir, "vms", "child-0", agent.SeedFileName))
	if err != nil || !strings.Contains(string(files[seed.FileMetaData]), `"instance-id": "child-0"`) ||
		!strings.Contains(string(files[seed.FileMetaData]), `"local-hostname": "child-0"`) {
		t.Fatalf("child's seed: %s %v", files[seed.FileMetaData], err)
	}
	if pulled, err := b.client.GetSnapshot(ctx, "fork-s"); err != nil || !pulled.SeedDisk {
		t.Errorf("pulled snapshot: %+v %v, want seed_disk", pulled, err)
	}
	bare := spec
	bare.Snapshot = from
	if _, err := b.client.CreateVM(ctx, "child-1", bare); err != nil {
		t.Fatal(err)
	}
	files, _, err = seed.Read(filepath.Join(b.dir, "vms", "child-1", agent.SeedFileName))
	if err != nil || !strings.Contains(string(files[seed.FileMetaData]), `"instance-id": "child-1"`) {
		t.Fatalf("child without a seed spec: seed %s %v, want one with its own instance-id", files[seed.FileMetaData], err)
	}
	// A source without a seed: its children cannot have one.
	if _, err := a.client.CreateVM(ctx, "plain", spec); err != nil {
		t.Fatal(err)
	}
	if _, err := a.client.CreateSnapshot(ctx, "fork-p", agentapi.SnapshotSpec{VMID: "plain"}); err != nil {
		t.Fatal(err)
	}
	seeded := spec
	seeded.Snapshot = &agentapi.SnapshotSource{ID: "fork-p"}
	seeded.Seed = &agentapi.SeedSpec{InstanceID: "child-p", Hostname: "child-p"}
	if _, err := a.client.CreateVM(ctx, "child-p", seeded); statusOf(err) != 400 || !strings.Contains(err.Error(), "without a seed disk") {
		t.Errorf("seeded child of an unseeded source: %v, want 400", err)
	}
}
