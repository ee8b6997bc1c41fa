package control_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// A power loss with --sqlite-sync normal can roll back the last commits,
// an acknowledged create's among them: the VM runs on its agent, the
// database has no row. Here the SQLite files are put back to a copy taken
// before the create (what such a rollback leaves). The host monitor must
// not delete that VM, whose create was answered 201: it keeps it and
// counts it for an operator (kvmd_vms_without_row). A VM whose row the
// control plane deleted on purpose is still removed from its agent.
func TestOrphanSweepKeepsAnAcknowledgedCreateTheDatabaseLost(t *testing.T) {
	ctx := ctxT(t)
	dir := t.TempDir()
	ag := testenv.StartAgent(t, testenv.AgentOptions{})
	opts := testenv.ControlOptions{DataDir: dir, NoMonitor: true, OrphanGrace: time.Millisecond}
	c := testenv.StartControl(t, opts)
	c.RegisterHost(t, "h1", ag.Address)
	c.Service.SyncNow(ctx)
	c.Stop()
	backup := t.TempDir()
	copyDB(t, dir, backup)

	c = testenv.StartControl(t, opts)
	acked, err := c.Client.CreateVM(ctx, smallVM("acked"), "")
	if err != nil {
		t.Fatal(err)
	}
	c.Stop()
	copyDB(t, backup, dir) // the power loss: the create's commits are gone

	c = testenv.StartControl(t, opts)
	dropped, err := c.Client.CreateVM(ctx, smallVM("dropped"), "")
	if err != nil {
		t.Fatal(err)
	}
	// A row deleted on purpose while its agent keeps the VM (as a failed
	// create's cleanup does when the agent is slow).
	if _, _, err := c.Store.DeleteVM(ctx, dropped.ID); err != nil {
		t.Fatal(err)
	}
	time.Sleep(5 * time.Millisecond) // let the millisecond grace pass; no timing is asserted
	c.Service.SyncNow(ctx)

	onAgent := map[string]bool{}
	list, err := ag.Client.ListVMs(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range list {
		onAgent[v.ID] = true
	}
	if !onAgent[acked.ID] {
		t.Errorf("the orphan sweep deleted VM %s, whose create was acknowledged before the database lost it", acked.ID)
	}
	if onAgent[dropped.ID] {
		t.Errorf("VM %s, whose row was deleted on purpose, still runs on its agent", dropped.ID)
	}
	got := -1.0
	families, err := c.Service.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != "kvmd_vms_without_row" {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "host" && l.GetValue() == "h1" {
					got = m.GetGauge().GetValue()
				}
			}
		}
	}
	if got != 1 {
		t.Errorf("kvmd_vms_without_row{host=\"h1\"} = %v, want 1 (the acknowledged VM kept for an operator)", got)
	}
}

// copyDB replaces the SQLite files (kvmd.db and its WAL) in to with from's.
func copyDB(t *testing.T, from, to string) {
	t.Helper()
	old, _ := filepath.Glob(filepath.Join(to, "kvmd.db*"))
	for _, f := range old {
		if err := os.Remove(f); err != nil {
			t.Fatal(err)
		}
	}
	files, _ := filepath.Glob(filepath.Join(from, "kvmd.db*"))
	for _, f := range files {
		if !strings.HasPrefix(filepath.Base(f), "kvmd.db") {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(to, filepath.Base(f)), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
}
