package control_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// migvolSetup makes, on h1 of f, a VM named name with two read-write
// volumes (64 and 128 MiB) and a marker written into each (sim files); it
// returns the VM and the volumes' ids with their files' digests.
func migvolSetup(t *testing.T, f migrationFleet, name string) (api.VM, map[string]string) {
	t.Helper()
	ctx := ctxT(t)
	sums := map[string]string{}
	var vols []api.VMVolume
	for _, size := range []int64{64, 128} {
		v, err := f.c.Client.CreateVolume(ctx, api.VolumeCreate{Name: name + "-data-" + time.Now().Format("150405.000000"), SizeMiB: size, Host: "h1"})
		if err != nil {
			t.Fatal(err)
		}
		vols = append(vols, api.VMVolume{Volume: v.ID})
	}
	vm, err := f.c.Client.CreateVM(ctx, api.VMCreate{Name: name, Image: "sim", VCPUs: 2, MemoryMiB: 1024, DiskMiB: 1024, Host: "h1", Volumes: vols}, "")
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range vols {
		sums[v.Volume] = writeMarker(t, f.agents["h1"], v.Volume)
	}
	return vm, sums
}

// migvolCheckOn checks that VM id and its volumes are on host (rows, agent
// copies with the same content), that no other agent has a copy of any of
// them, and that each host holds exactly what its rows add up to.
func migvolCheckOn(t *testing.T, f migrationFleet, id, host string, sums map[string]string) {
	t.Helper()
	ctx := ctxT(t)
	if err := f.oneCopy(ctx, id); err != nil {
		t.Fatal(err)
	}
	vm, err := f.c.Client.GetVM(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if vm.Host != host || len(vm.Volumes) != len(sums) {
		t.Fatalf("vm %s on %s with %d volumes; want on %s with %d", id, vm.Host, len(vm.Volumes), host, len(sums))
	}
	var diskMiB int64
	for vol, sum := range sums {
		v, err := f.c.Client.GetVolume(ctx, vol)
		if err != nil {
			t.Fatal(err)
		}
		if v.Host != host || v.State != "ready" {
			t.Errorf("volume %s: row on %s (%s); want ready on %s with its vm", vol, v.Host, v.State, host)
		}
		diskMiB += v.SizeMiB
		for name, a := range f.agents {
			_, err := a.Client.GetVolume(ctx, vol)
			switch {
			case name == host && err != nil:
				t.Errorf("volume %s: the agent of %s does not have it: %v", vol, name, err)
			case name == host:
				if got := fileSHA256(t, simVolumeFile(a, vol)); got != sum {
					t.Errorf("volume %s on %s has content %s; want %s (the source's, with its marker)", vol, name, got, sum)
				}
			case err == nil:
				t.Errorf("volume %s: the agent of %s still has a copy; only %s should", vol, name, host)
			}
		}
	}
	checkLedger(t, f.c.Store)
	for name := range f.agents {
		want := api.Resources{}
		if name == host {
			want = api.Resources{VCPUs: 2, MemoryMiB: 1024, DiskMiB: 1024 + diskMiB}
		}
		if got := hostAllocated(t, f.c, name); got != want {
			t.Errorf("host %s holds %+v; want %+v", name, got, want)
		}
	}
}

// A running VM with two volumes migrates live and its volumes move with
// it (rows, disk allocations and content); stopped, it migrates back cold
// with them.
func TestMigrateVMWithVolumes(t *testing.T) {
	eachDatabase(t, func(t *testing.T, dbURL string) {
		ctx := ctxT(t)
		f := startMigrationFleet(t, dbURL, 2, 8192, testenv.ControlOptions{})
		vm, sums := migvolSetup(t, f, "db")
		migvolCheckOn(t, f, vm.ID, "h1", sums)

		moved, err := f.c.Client.MigrateVM(ctx, vm.ID, "")
		if err != nil {
			t.Fatalf("migrate %s with its volumes: %v", vm.ID, err)
		}
		if moved.Host != "h2" || moved.ObservedState != api.StateRunning {
			t.Fatalf("after the migration the vm is %s on %s; want running on h2", moved.ObservedState, moved.Host)
		}
		migvolCheckOn(t, f, vm.ID, "h2", sums)

		if _, err := f.c.Client.UpdateVM(ctx, vm.ID, api.VMPatch{PowerState: ptr(api.PowerStopped)}); err != nil {
			t.Fatal(err)
		}
		back, err := f.c.Client.MigrateVM(ctx, vm.ID, "h1")
		if err != nil {
			t.Fatalf("cold migrate %s with its volumes to h1: %v", vm.ID, err)
		}
		if back.Host != "h1" || back.ObservedState != api.StateStopped {
			t.Fatalf("cold migration: vm %s on %s; want stopped on h1", back.ObservedState, back.Host)
		}
		migvolCheckOn(t, f, vm.ID, "h1", sums)
	})
}

// migvolReason is the details.reason of a 409.
func migvolReason(err error) string {
	var e *client.Error
	if !errors.As(err, &e) || e.Code != api.CodeConflict {
		return ""
	}
	r, _ := e.Details["reason"].(string)
	return r
}

// A VM whose volume is shared read-only with another VM is refused (409,
// reason volume, naming the volume); so is one whose volume is attached
// read-only alone. Detached from it, the VM migrates.
func TestMigrateRefusesSharedVolume(t *testing.T) {
	ctx := ctxT(t)
	f := startMigrationFleet(t, "", 2, 8192, testenv.ControlOptions{})
	c := noRetry(f.c)
	shared, err := c.CreateVolume(ctx, api.VolumeCreate{Name: "shared", SizeMiB: 64, Host: "h1"})
	if err != nil {
		t.Fatal(err)
	}
	var vms []api.VM
	for _, name := range []string{"reader-a", "reader-b"} {
		vm, err := c.CreateVM(ctx, api.VMCreate{Name: name, Image: "sim", VCPUs: 1, MemoryMiB: 512, DiskMiB: 1024, Host: "h1",
			Volumes: []api.VMVolume{{Volume: shared.ID, ReadOnly: true}}}, "")
		if err != nil {
			t.Fatal(err)
		}
		vms = append(vms, vm)
	}
	_, err = c.MigrateVM(ctx, vms[0].ID, "h2")
	if migvolReason(err) != "volume" || !strings.Contains(err.Error(), "shared") || !strings.Contains(err.Error(), shared.ID) ||
		!strings.Contains(err.Error(), "Detach") {
		t.Fatalf("migrate a vm with a shared read-only volume: %v; want 409 reason volume naming the volume and what to do", err)
	}
	if err := c.DetachVolume(ctx, vms[1].ID, shared.ID); err != nil {
		t.Fatal(err)
	}
	if _, err = c.MigrateVM(ctx, vms[0].ID, "h2"); migvolReason(err) != "volume" || !strings.Contains(err.Error(), "read-only") {
		t.Fatalf("migrate a vm with a read-only volume: %v; want 409 reason volume", err)
	}
	if err := c.DetachVolume(ctx, vms[0].ID, shared.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := c.MigrateVM(ctx, vms[0].ID, "h2"); err != nil {
		t.Fatalf("migrate after the detach: %v", err)
	}
	got, err := c.GetVolume(ctx, shared.ID)
	if err != nil || got.Host != "h1" {
		t.Fatalf("the detached volume is on %s (%v); want it left on h1", got.Host, err)
	}
	checkLedger(t, f.c.Store)
}

// While a VM migrates its volumes are neither attached, detached nor grown
// (409); a migration stopped at each step is settled by the host monitor
// with the volume rows on the VM's host and one copy of each volume.
func TestMigrationWithVolumesStoppedAtEachStep(t *testing.T) {
	for _, tc := range []struct {
		step     string
		wantHost string
	}{
		{control.MigrationStepReserved, "h1"},
		{control.MigrationStepMoving, "h2"},
		{control.MigrationStepCompleted, "h2"},
		{control.MigrationStepSwitched, "h2"},
	} {
		t.Run(tc.step, func(t *testing.T) {
			ctx := ctxT(t)
			var f migrationFleet
			var vmID, volID string
			var busy []error
			hooks := &control.Hooks{MigrationStep: func(ctx context.Context, _, step string) error {
				if step != tc.step {
					return nil
				}
				c := noRetry(f.c)
				_, err := c.UpdateVolume(ctx, volID, api.VolumePatch{SizeMiB: ptr(int64(256))})
				busy = append(busy, err, c.DetachVolume(ctx, vmID, volID))
				return errors.New("killed at " + step)
			}}
			f = startMigrationFleet(t, "", 2, 8192, testenv.ControlOptions{Hooks: hooks, CreateGrace: time.Second})
			vm, sums := migvolSetup(t, f, "web")
			vmID = vm.ID
			for id := range sums {
				volID = id
			}
			if _, err := noRetry(f.c).MigrateVM(ctx, vm.ID, "h2"); err == nil {
				t.Fatalf("the migration answered success although it was stopped at %s", tc.step)
			}
			for _, err := range busy {
				if apiCode(err) != api.CodeConflict || !strings.Contains(err.Error(), "migrat") {
					t.Errorf("a volume change while its vm migrates: %v; want 409 naming the migration", err)
				}
			}
			eventually(t, "the host monitor settles the migration", func() bool {
				return f.oneCopy(ctx, vm.ID) == nil && migvolSettled(ctx, f, sums)
			})
			migvolCheckOn(t, f, vm.ID, tc.wantHost, sums)
		})
	}
}

// migvolSettled says whether each volume of sums is on exactly one agent.
func migvolSettled(ctx context.Context, f migrationFleet, sums map[string]string) bool {
	for vol := range sums {
		n := 0
		for _, a := range f.agents {
			if _, err := a.Client.GetVolume(ctx, vol); err == nil {
				n++
			}
		}
		if n != 1 {
			return false
		}
	}
	return true
}
