package store_test

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/google/uuid"

	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

func newVolume(host, project string, sizeMiB int64) store.Volume {
	id := uuid.NewString()
	return store.Volume{ID: id, Name: "vol-" + id[:8], Project: project, HostName: host, SizeMiB: sizeMiB}
}

// volumeLedger asserts that each host's disk allocation equals its VM rows
// plus its volume rows that hold capacity, and is within its capacity.
func volumeLedger(t *testing.T, s *store.Store) {
	t.Helper()
	ctx := context.Background()
	hosts, err := s.AllHosts(ctx)
	if err != nil {
		t.Fatal(err)
	}
	vms, err := s.ListVMs(ctx, store.VMFilter{})
	if err != nil {
		t.Fatal(err)
	}
	vols, err := s.ListVolumes(ctx, store.VolumeFilter{})
	if err != nil {
		t.Fatal(err)
	}
	disk := map[string]int64{}
	for _, vm := range vms {
		if vm.HoldsCapacity {
			disk[vm.HostName] += vm.Resources.DiskMiB
		}
	}
	for _, v := range vols {
		if v.HoldsCapacity {
			disk[v.HostName] += v.SizeMiB
		}
	}
	for _, h := range hosts {
		if h.Allocated.DiskMiB != disk[h.Name] {
			t.Errorf("host %s: disk allocated %d MiB, rows of VMs plus volumes add up to %d", h.Name, h.Allocated.DiskMiB, disk[h.Name])
		}
		if h.Allocated.DiskMiB > h.Capacity.DiskMiB {
			t.Errorf("host %s: disk oversubscribed: %d of %d MiB", h.Name, h.Allocated.DiskMiB, h.Capacity.DiskMiB)
		}
	}
}

// Volumes and VMs race for the disk of one host: exactly what fits lands,
// the project's disk usage equals its rows, and deletes give it all back.
func TestVolumeReservationSharesHostDiskWithVMs(t *testing.T) {
	eachDialect(t, func(t *testing.T, s *store.Store) {
		ctx := context.Background()
		addHost(t, s, "h1", store.Resources{VCPUs: 1000, MemoryMiB: 1 << 20, DiskMiB: 1000})
		addProject(t, s, "team", store.Quotas{DiskMiB: quota(800)})
		var (
			wg              sync.WaitGroup
			mu              sync.Mutex
			placed, refused int
			others          []error
			volIDs          []string
		)
		for i := range 40 {
			wg.Go(func() {
				var err error
				if i%2 == 0 {
					v := newVolume("h1", "team", 50)
					if err = s.ReserveAndInsertVolume(ctx, v); err == nil {
						mu.Lock()
						volIDs = append(volIDs, v.ID)
						mu.Unlock()
					}
				} else {
					vm := newVM("h1", store.Resources{VCPUs: 1, MemoryMiB: 1, DiskMiB: 50})
					vm.Project = "team"
					err = s.ReserveAndInsertVM(ctx, vm)
				}
				mu.Lock()
				defer mu.Unlock()
				var qe *store.QuotaError
				switch {
				case err == nil:
					placed++
				case errors.As(err, &qe) && qe.Resource == store.QuotaDiskMiB:
					refused++
				default:
					others = append(others, err)
				}
			})
		}
		wg.Wait()
		if len(others) > 0 {
			t.Fatalf("unexpected errors: %v", others)
		}
		if placed != 16 || refused != 24 {
			t.Fatalf("placed %d, refused for the disk quota %d; want 16 (800 MiB of 50) and 24", placed, refused)
		}
		volumeLedger(t, s)
		p, err := s.GetProject(ctx, "team")
		if err != nil {
			t.Fatal(err)
		}
		if p.Used.DiskMiB != 800 {
			t.Errorf("project disk usage %d MiB, want 800", p.Used.DiskMiB)
		}
		for _, id := range volIDs {
			if _, released, err := s.DeleteVolume(ctx, id); err != nil || !released {
				t.Fatalf("delete volume %s: released %v, %v", id, released, err)
			}
		}
		volumeLedger(t, s)
		if p, _ = s.GetProject(ctx, "team"); p.Used.DiskMiB != int64(placed-len(volIDs))*50 {
			t.Errorf("after the volumes' deletes the project uses %d MiB, want %d", p.Used.DiskMiB, (placed-len(volIDs))*50)
		}
	})
}

func TestVolumeNoRoomAndDuplicateName(t *testing.T) {
	eachDialect(t, func(t *testing.T, s *store.Store) {
		ctx := context.Background()
		addHost(t, s, "h1", store.Resources{VCPUs: 1, MemoryMiB: 1, DiskMiB: 100})
		v := newVolume("h1", "", 60)
		if err := s.ReserveAndInsertVolume(ctx, v); err != nil {
			t.Fatal(err)
		}
		if err := s.ReserveAndInsertVolume(ctx, newVolume("h1", "", 41)); !errors.Is(err, store.ErrNoRoom) {
			t.Fatalf("41 MiB more on a host with 40 free: got %v, want ErrNoRoom", err)
		}
		dup := newVolume("h1", "", 10)
		dup.Name = v.Name
		if err := s.ReserveAndInsertVolume(ctx, dup); !errors.Is(err, store.ErrDuplicateName) {
			t.Fatalf("a second volume named %q: got %v, want ErrDuplicateName", v.Name, err)
		}
		if err := s.ReserveAndInsertVolume(ctx, newVolume("nohost", "", 10)); !errors.Is(err, store.ErrNoRoom) && !errors.Is(err, store.ErrNotFound) {
			t.Fatalf("a volume on an unknown host: got %v", err)
		}
		volumeLedger(t, s)
		if err := s.GrowVolume(ctx, v.ID, 60, 70); !errors.Is(err, store.ErrNotFound) {
			t.Fatalf("growing a volume still creating: got %v, want ErrNotFound", err)
		}
		if err := s.MarkVolumeReady(ctx, v.ID); err != nil {
			t.Fatal(err)
		}
		if err := s.GrowVolume(ctx, v.ID, 60, 101); !errors.Is(err, store.ErrNoRoom) {
			t.Fatalf("growing past the host: got %v, want ErrNoRoom", err)
		}
		if err := s.GrowVolume(ctx, v.ID, 60, 100); err != nil {
			t.Fatal(err)
		}
		volumeLedger(t, s)
		if err := s.UndoGrowVolume(ctx, v.ID, 60, 100); err != nil {
			t.Fatal(err)
		}
		volumeLedger(t, s)
	})
}

// A volume attached read-write goes to one VM only; a VM's delete detaches
// it; an attached volume is not deleted.
func TestVolumeAttachmentsAreExclusive(t *testing.T) {
	eachDialect(t, func(t *testing.T, s *store.Store) {
		ctx := context.Background()
		addHost(t, s, "h1", store.Resources{VCPUs: 10, MemoryMiB: 100, DiskMiB: 1000})
		addHost(t, s, "h2", store.Resources{VCPUs: 10, MemoryMiB: 100, DiskMiB: 1000})
		v := newVolume("h1", "", 10)
		if err := s.ReserveAndInsertVolume(ctx, v); err != nil {
			t.Fatal(err)
		}
		vm1 := newVM("h1", store.Resources{VCPUs: 1, MemoryMiB: 1, DiskMiB: 1})
		vm1.Volumes = []store.VMVolume{{VolumeID: v.ID}}
		if err := s.ReserveAndInsertVM(ctx, vm1); !errors.Is(err, store.ErrVolumeNotReady) {
			t.Fatalf("attach a volume still creating: got %v, want ErrVolumeNotReady", err)
		}
		if err := s.MarkVolumeReady(ctx, v.ID); err != nil {
			t.Fatal(err)
		}
		other := newVM("h2", store.Resources{VCPUs: 1, MemoryMiB: 1, DiskMiB: 1})
		other.Volumes = []store.VMVolume{{VolumeID: v.ID}}
		if err := s.ReserveAndInsertVM(ctx, other); !errors.Is(err, store.ErrVolumeNotReady) {
			t.Fatalf("attach a volume of h1 to a VM on h2: got %v, want ErrVolumeNotReady", err)
		}
		if err := s.ReserveAndInsertVM(ctx, vm1); err != nil {
			t.Fatal(err)
		}
		vm2 := newVM("h1", store.Resources{VCPUs: 1, MemoryMiB: 1, DiskMiB: 1})
		vm2.Volumes = []store.VMVolume{{VolumeID: v.ID, ReadOnly: true}}
		var ae *store.VolumeAttachedError
		if err := s.ReserveAndInsertVM(ctx, vm2); !errors.As(err, &ae) || ae.VM != vm1.ID {
			t.Fatalf("attach a volume attached read-write to %s: got %v, want ErrVolumeAttached naming it", vm1.ID, err)
		}
		if _, err := s.BeginDeleteVolume(ctx, v.ID, "r"); !errors.As(err, &ae) || ae.VM != vm1.ID {
			t.Fatalf("delete an attached volume: got %v, want ErrVolumeAttached naming %s", err, vm1.ID)
		}
		volumeLedger(t, s)
		if _, _, err := s.DeleteVM(ctx, vm1.ID); err != nil {
			t.Fatal(err)
		}
		// Detached: two read-only attachments may share it now.
		vm3 := newVM("h1", store.Resources{VCPUs: 1, MemoryMiB: 1, DiskMiB: 1})
		vm3.Volumes = []store.VMVolume{{VolumeID: v.ID, ReadOnly: true}}
		for _, vm := range []store.VM{vm2, vm3} {
			if err := s.ReserveAndInsertVM(ctx, vm); err != nil {
				t.Fatalf("read-only attach %s: %v", vm.ID, err)
			}
		}
		atts, err := s.VolumeAttachments(ctx, []string{v.ID})
		if err != nil || len(atts[v.ID]) != 2 {
			t.Fatalf("attachments of %s: %v, %v; want two", v.ID, atts, err)
		}
		for _, vm := range []store.VM{vm2, vm3} {
			if _, _, err := s.DeleteVM(ctx, vm.ID); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := s.BeginDeleteVolume(ctx, v.ID, "r"); err != nil {
			t.Fatal(err)
		}
		if _, released, err := s.DeleteVolume(ctx, v.ID); err != nil || !released {
			t.Fatalf("delete volume: released %v, %v", released, err)
		}
		volumeLedger(t, s)
		h, _ := s.GetHost(ctx, "h1")
		if h.Allocated != (store.Resources{}) {
			t.Errorf("host h1 holds %+v after every VM and volume went", h.Allocated)
		}
	})
}

// Ten VMs race to attach one volume read-write: exactly one gets it, the
// others are refused naming it and hold nothing.
func TestVolumeReadWriteAttachRace(t *testing.T) {
	eachDialect(t, func(t *testing.T, s *store.Store) {
		ctx := context.Background()
		addHost(t, s, "h1", store.Resources{VCPUs: 100, MemoryMiB: 1000, DiskMiB: 10000})
		v := newVolume("h1", "", 10)
		if err := s.ReserveAndInsertVolume(ctx, v); err != nil {
			t.Fatal(err)
		}
		if err := s.MarkVolumeReady(ctx, v.ID); err != nil {
			t.Fatal(err)
		}
		var (
			wg      sync.WaitGroup
			mu      sync.Mutex
			won     []string
			refused int
			others  []error
		)
		for range 10 {
			wg.Go(func() {
				vm := newVM("h1", store.Resources{VCPUs: 1, MemoryMiB: 1, DiskMiB: 1})
				vm.Volumes = []store.VMVolume{{VolumeID: v.ID}}
				err := s.ReserveAndInsertVM(ctx, vm)
				mu.Lock()
				defer mu.Unlock()
				switch {
				case err == nil:
					won = append(won, vm.ID)
				case errors.Is(err, store.ErrVolumeAttached):
					refused++
				default:
					others = append(others, err)
				}
			})
		}
		wg.Wait()
		if len(others) > 0 || len(won) != 1 || refused != 9 {
			t.Fatalf("won %v, refused %d, other errors %v; want one winner and 9 refused", won, refused, others)
		}
		got, err := s.GetVolume(ctx, v.ID)
		if err != nil || got.RWVM == nil || *got.RWVM != won[0] {
			t.Fatalf("volume %s read-write VM %v (%v); want %s", v.ID, got.RWVM, err, won[0])
		}
		h, _ := s.GetHost(ctx, "h1")
		if h.Allocated.VCPUs != 1 {
			t.Errorf("h1 allocates %d vCPUs, want 1 (only the winner)", h.Allocated.VCPUs)
		}
		volumeLedger(t, s)
	})
}
