package control_test

import (
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/glebarez/sqlite"
	"gorm.io/driver/postgres"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// gauge reads one series of a metric family of the control's registry
// (-1 when it is not there).
func gauge(t *testing.T, c *testenv.Control, name, host string) float64 {
	t.Helper()
	families, err := c.Service.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "host" && l.GetValue() == host {
					if m.GetGauge() != nil {
						return m.GetGauge().GetValue()
					}
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return -1
}

// The host monitor's volume sweep: a volume the agent has whose row was
// deleted on purpose is deleted there after the orphan grace (logged and
// counted); one whose row vanished without a delete (removed by hand, or
// lost by the database) is kept with its data and counted for an
// operator; a ready volume the agent lost becomes state error with a
// reason that says what happened, and is not made again; once its agent
// has it again (a restored state directory) it is ready again.
func TestVolumeReconcileOrphansAndLostVolumes(t *testing.T) {
	eachDatabase(t, func(t *testing.T, databaseURL string) {
		ctx := ctxT(t)
		dataDir := t.TempDir()
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: databaseURL, DataDir: dataDir, NoMonitor: true, OrphanGrace: time.Millisecond})
		a := testenv.StartAgent(t, testenv.AgentOptions{})
		c.RegisterHost(t, "h1", a.Address)
		c.Service.SyncNow(ctx)

		mk := func(name string) api.Volume {
			t.Helper()
			v, err := c.Client.CreateVolume(ctx, api.VolumeCreate{Name: name, SizeMiB: 100, Host: "h1"})
			if err != nil {
				t.Fatal(err)
			}
			return v
		}
		undone, byHand, lost, kept := mk("undone"), mk("by-hand"), mk("lost"), mk("kept")

		// undone: its row released as a delete does (a tombstone), while
		// the agent keeps the volume (its delete's answer was lost).
		if _, _, err := c.Store.DeleteVolume(ctx, undone.ID); err != nil {
			t.Fatal(err)
		}
		// by-hand: the row removed outside the control plane, capacity
		// given back by hand too: no tombstone.
		removeVolumeRowByHand(t, databaseURL, dataDir, byHand)
		// lost: the agent's state lost the volume.
		if err := a.Client.DeleteVolume(ctx, lost.ID); err != nil {
			t.Fatal(err)
		}
		time.Sleep(5 * time.Millisecond) // let the millisecond grace pass; no timing is asserted
		c.Service.SyncNow(ctx)

		if got, want := a.VolumeIDs(t), sortedIDs(byHand.ID, kept.ID); !slices.Equal(got, want) {
			t.Errorf("agent has %v, want %v (the volume deleted on purpose gone, the one removed by hand kept)", got, want)
		}
		if got := gauge(t, c, "kvmd_volumes_without_row", "h1"); got != 1 {
			t.Errorf("kvmd_volumes_without_row{host=h1} = %v, want 1", got)
		}
		if got := gauge(t, c, "kvmd_orphan_volumes_deleted_total", "h1"); got != 1 {
			t.Errorf("kvmd_orphan_volumes_deleted_total{host=h1} = %v, want 1", got)
		}
		got, err := c.Client.GetVolume(ctx, lost.ID)
		if err != nil {
			t.Fatal(err)
		}
		if got.State != api.VolumeError || !strings.Contains(got.Reason, "h1") || !strings.Contains(got.Reason, "not recreated") ||
			!strings.Contains(got.Reason, "DELETE /v1/volumes/"+lost.ID) {
			t.Errorf("lost volume: state %q reason %q; want error with a reason naming the host and what to do", got.State, got.Reason)
		}
		if gauge(t, c, "kvmd_volumes_lost_total", "h1") != 1 {
			t.Errorf("kvmd_volumes_lost_total{host=h1} is not 1")
		}
		c.Service.SyncNow(ctx) // a second round changes nothing and makes nothing again
		if ids := a.VolumeIDs(t); slices.Contains(ids, lost.ID) {
			t.Errorf("the lost volume %s was made again on the agent", lost.ID)
		}
		checkLedger(t, c.Store)
		// Its agent's state directory is restored: it is ready again.
		if _, err := a.Client.CreateVolume(ctx, lost.ID, agentapi.VolumeSpec{SizeMiB: lost.SizeMiB}); err != nil {
			t.Fatal(err)
		}
		c.Service.SyncNow(ctx)
		if got, err := c.Client.GetVolume(ctx, lost.ID); err != nil || got.State != api.VolumeReady || got.Reason != "" {
			t.Errorf("lost volume back on its agent: %+v, %v; want ready", got, err)
		}
		// The owner deletes it: its capacity goes.
		if err := c.Client.DeleteVolume(ctx, lost.ID); err != nil {
			t.Fatalf("delete the lost volume: %v", err)
		}
		if got := hostAllocated(t, c, "h1"); got != (api.Resources{DiskMiB: 100}) {
			t.Errorf("h1 allocates %+v, want the 100 MiB of volume kept", got)
		}
		checkLedger(t, c.Store)
	})
}

// A growth left half done is finished by the host monitor: the row and
// the host reserved it, the agent never grew the volume (its replica died
// before the call, or the answer was lost).
func TestVolumeReconcileFinishesAGrowth(t *testing.T) {
	eachDatabase(t, func(t *testing.T, databaseURL string) {
		ctx := ctxT(t)
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: databaseURL, NoMonitor: true, CreateGrace: time.Millisecond})
		a := testenv.StartAgent(t, testenv.AgentOptions{})
		c.RegisterHost(t, "h1", a.Address)
		c.Service.SyncNow(ctx)
		v, err := c.Client.CreateVolume(ctx, api.VolumeCreate{Name: "data", SizeMiB: 100, Host: "h1"})
		if err != nil {
			t.Fatal(err)
		}
		if err := c.Store.GrowVolume(ctx, v.ID, 100, 300); err != nil {
			t.Fatal(err)
		}
		time.Sleep(5 * time.Millisecond)
		c.Service.SyncNow(ctx)
		onAgent, err := a.Client.GetVolume(ctx, v.ID)
		if err != nil {
			t.Fatal(err)
		}
		if onAgent.SizeMiB != 300 {
			t.Errorf("agent has volume %s at %d MiB, want the 300 MiB its row reserved", v.ID, onAgent.SizeMiB)
		}
		if got := hostAllocated(t, c, "h1"); got != (api.Resources{DiskMiB: 300}) {
			t.Errorf("h1 allocates %+v, want 300 MiB", got)
		}
		checkLedger(t, c.Store)
	})
}

// removeVolumeRowByHand deletes volume v's row the way an operator's SQL
// would (its own connection to the database), giving its capacity back
// too, with no tombstone.
func removeVolumeRowByHand(t *testing.T, databaseURL, dataDir string, v api.Volume) {
	t.Helper()
	dial := sqlite.Open(filepath.Join(dataDir, "kvmd.db") + "?_pragma=busy_timeout(10000)")
	if databaseURL != "" {
		dial = postgres.Open(databaseURL)
	}
	db, err := gorm.Open(dial, &gorm.Config{Logger: logger.Discard})
	if err != nil {
		t.Fatal(err)
	}
	if sqlDB, err := db.DB(); err == nil {
		defer func() { _ = sqlDB.Close() }()
	}
	err = db.Transaction(func(tx *gorm.DB) error {
		for _, q := range []struct {
			sql  string
			args []any
		}{
			{"DELETE FROM volumes WHERE id = ?", []any{v.ID}},
			{"UPDATE hosts SET alloc_disk_mib = alloc_disk_mib - ? WHERE name = ?", []any{v.SizeMiB, v.Host}},
			{"UPDATE projects SET used_disk_mib = used_disk_mib - ? WHERE name = ?", []any{v.SizeMiB, v.Project}},
		} {
			if err := tx.Exec(q.sql, q.args...).Error; err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("remove the row of volume %s by hand: %v", v.ID, err)
	}
}

func sortedIDs(ids ...string) []string {
	slices.Sort(ids)
	return ids
}
