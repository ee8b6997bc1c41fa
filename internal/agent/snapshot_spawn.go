package agent

// Starting a VM from a snapshot.

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// checkSnapshotSource validates the snapshot part of a VM spec.
func checkSnapshotSource(spec agentapi.VMSpec) error {
	if err := checkSnapshotID(spec.Snapshot.ID); err != nil {
		return err
	}
	if spec.Stopped {
		return errInvalid("a vm started from a snapshot cannot be created stopped: it continues the snapshot's running guest")
	}
	if _, err := peerOf(spec.Snapshot); err != nil {
		return err
	}
	return nil
}

// spawnLocked creates VM e from a snapshot: the snapshot is made local
// (pulled from spec.Snapshot.Address when it is not here), then the driver
// starts the VM from it. The caller holds e's operation lock.
func (a *Agent) spawnLocked(ctx context.Context, e *vmEntry, spec agentapi.VMSpec) (agentapi.VM, error) {
	src := *spec.Snapshot
	r := vmRecord{
		Version: metaVersion, ID: e.id, Image: spec.Image, VCPUs: spec.VCPUs, MemoryMiB: spec.MemoryMiB,
		DiskMiB: spec.DiskMiB, State: agentapi.StateCreating, StartedFrom: agentapi.StartedSnapshot,
		Snapshot: src.ID, CreatedAt: time.Now().UTC().Truncate(time.Millisecond), NICs: requestedNICs(spec.NICs),
		Seed: spec.Seed,
	}
	// Set before the snapshot is looked at, so that from here on a delete
	// of the snapshot sees this VM and refuses.
	e.set(r)
	fail := func(err error) (agentapi.VM, error) {
		return a.abandonCreate(ctx, e, r, fmt.Errorf("create vm %s from snapshot %s: %w", e.id, src.ID, err))
	}
	sn, err := a.snapshotter()
	if err != nil {
		return fail(err)
	}
	start := time.Now()
	from, err := peerOf(&src)
	if err != nil {
		return fail(err)
	}
	rec, err := a.ensureSnapshot(ctx, src.ID, from, nil)
	if err != nil {
		return fail(err)
	}
	pulled := time.Since(start)
	if rec.Image != spec.Image || rec.VCPUs != spec.VCPUs || rec.MemoryMiB != spec.MemoryMiB || rec.DiskMiB != spec.DiskMiB {
		return fail(errInvalid("snapshot %s is of a vm with image %s, %d vcpus, %d MiB memory, %d MiB disk: a vm started from it must have that shape",
			src.ID, rec.Image, rec.VCPUs, rec.MemoryMiB, rec.DiskMiB))
	}
	if err := checkChildNICs(src.ID, rec.NICs, spec.NICs); err != nil {
		return fail(err)
	}
	// The child's devices must match the snapshot's: a seed disk exactly
	// when its source had one. The child's seed is its own (its id, its
	// hostname); the running guest reads it at its next boot.
	switch {
	case rec.SeedDisk && r.Seed == nil:
		r.Seed = &agentapi.SeedSpec{InstanceID: e.id}
	case !rec.SeedDisk && r.Seed != nil:
		return fail(errInvalid("snapshot %s is of a vm without a seed disk: a vm started from it cannot have one (its devices must match the saved state); start it without a seed", src.ID))
	}
	r.GuestNICs = cloneNICs(rec.NICs)
	e.set(r)
	a.pool.makeRoom(e.id)
	if err := os.MkdirAll(a.vmDir(e.id), 0o750); err != nil {
		return fail(err)
	}
	if err := a.saveRecord(&r); err != nil {
		return fail(err)
	}
	if err := a.ensureSeed(r); err != nil {
		return fail(err)
	}
	m := machineOf(a, r)
	if err := sn.Spawn(ctx, m, a.snapDir(src.ID), rec.files()); err != nil {
		return fail(err)
	}
	r.State, r.Process, r.Disk, r.NICs = agentapi.StateRunning, m.Process, m.Disk, m.NICs
	if err := a.saveRecord(&r); err != nil {
		return fail(err)
	}
	e.set(r)
	a.log.Info("vm started from snapshot", "vm", e.id, "snapshot", src.ID, "pid", r.Process.PID,
		"snapshot_ready_ms", pulled.Milliseconds(), "total_ms", time.Since(start).Milliseconds())
	return r.wire(), nil
}

// guestView is a VM's NICs as its guest sees them.
func guestView(r vmRecord) []agentapi.NIC {
	if len(r.GuestNICs) > 0 {
		return cloneNICs(r.GuestNICs)
	}
	return requestedNICs(r.NICs)
}

// checkChildNICs checks that a VM started from snapshot id has a NIC of
// the same network and mode for each NIC of the snapshot's guest: the
// guest's devices come back from the memory state, only their host side is
// the child's own.
func checkChildNICs(id string, guest, child []agentapi.NIC) error {
	if len(guest) != len(child) {
		return errInvalid("snapshot %s is of a vm with %d nics: a vm started from it needs %d nics (on the same networks), got %d",
			id, len(guest), len(guest), len(child))
	}
	for i := range guest {
		if guest[i].Network != child[i].Network || guest[i].Mode != child[i].Mode {
			return errInvalid("snapshot %s: nics[%d] of its vm is on network %s (mode %s): the child's nics[%d] must be too, got %s (mode %s)",
				id, i, guest[i].Network, guest[i].Mode, i, child[i].Network, child[i].Mode)
		}
		if guest[i].Mode == agentapi.NetworkNAT && guest[i].CIDR != child[i].CIDR {
			return errInvalid("snapshot %s: nics[%d] of its vm is on %s, the child's on %s: a child keeps its guest's network",
				id, i, guest[i].CIDR, child[i].CIDR)
		}
	}
	return nil
}
