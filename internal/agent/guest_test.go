package agent_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
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
