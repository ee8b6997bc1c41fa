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
	// prepare checks the snapshot against the spec and makes the child's
	// directory, record and seed; it returns the machine to start.
	prepare := func(rec *snapshotRecord) (*Machine, error) {
		if rec.Image != spec.Image || rec.VCPUs != spec.VCPUs || rec.MemoryMiB != spec.MemoryMiB || rec.DiskMiB != spec.DiskMiB {
			return nil, errInvalid("snapshot %s is of a vm with image %s, %d vcpus, %d MiB memory, %d MiB disk: a vm started from it must have that shape",
				src.ID, rec.Image, rec.VCPUs, rec.MemoryMiB, rec.DiskMiB)
		}
		if err := checkChildNICs(src.ID, rec.NICs, spec.NICs); err != nil {
			return nil, err
		}
		// The child's devices must match the snapshot's: a seed disk exactly
		// when its source had one. The child's seed is its own (its id, its
		// hostname); the running guest reads it at its next boot.
		switch {
		case rec.SeedDisk && r.Seed == nil:
			r.Seed = &agentapi.SeedSpec{InstanceID: e.id}
		case !rec.SeedDisk && r.Seed != nil:
			return nil, errInvalid("snapshot %s is of a vm without a seed disk: a vm started from it cannot have one (its devices must match the saved state); start it without a seed", src.ID)
		}
		// Likewise the guest agent channel: the child has it exactly when
		// its source had it, whatever the create asked.
		r.GuestAgent = rec.GuestAgent
		// The firmware too: the child continues a guest that runs on its
		// source's firmware, with a copy of its variables.
		switch {
		case spec.Firmware != "" && spec.Firmware != rec.firmware():
			return nil, errInvalid("snapshot %s is of a vm with firmware %s: a vm started from it boots with that firmware, not %s", src.ID, rec.firmware(), spec.Firmware)
		case spec.SecureBoot && !rec.SecureBoot:
			return nil, errInvalid("snapshot %s is of a vm without secure boot: a vm started from it cannot have it", src.ID)
		}
		r.Firmware, r.SecureBoot = rec.firmware(), rec.SecureBoot
		r.GuestNICs = cloneNICs(rec.NICs)
		// And the volumes: one for each of the source's, in its slot
		// (volume_fork.go), claimed like a boot's.
		if len(rec.Volumes) > 0 || len(spec.Volumes) > 0 {
			held, vols, err := a.claimChildVolumes(ctx, e.id, src.ID, rec.Volumes, spec.Volumes)
			if err != nil {
				return nil, err
			}
			r.Volumes = vols
			e.set(r)
			held.unlock()
		}
		e.set(r)
		a.pool.makeRoom(e.id)
		if err := os.MkdirAll(a.vmDir(e.id), 0o750); err != nil {
			return nil, err
		}
		if err := a.saveRecord(&r); err != nil {
			return nil, err
		}
		if err := a.ensureSeed(r); err != nil {
			return nil, err
		}
		return machineOf(a, r), nil
	}
	// A child of a snapshot pulled from another agent starts while the
	// RAM image arrives (EarlySpawner): its overlay and its QEMU are made
	// once the disk files are here, by the pull this child makes or by
	// one that another child of the snapshot made; it loads its state only
	// after the whole snapshot is verified and in place. Should that early
	// start fail, or the pull it used, the child starts as without it.
	var early *earlySpawn
	var rec *snapshotRecord
	es, canEarly := sn.(EarlySpawner)
	if canEarly && from != nil {
		pulls, stop := a.awaitPull(src.ID)
		got := make(chan struct{})
		go func() {
			defer close(got)
			rec, err = a.ensureSnapshot(ctx, src.ID, from, nil)
		}()
		for waiting := true; waiting; {
			select {
			case w := <-pulls:
				if early == nil && a.joinPull(w) {
					early = &earlySpawn{w: w, done: make(chan struct{})}
					early.start(ctx, a, es, prepare, src.ID)
				}
			case <-got:
				waiting = false
			}
		}
		stop()
	} else {
		rec, err = a.ensureSnapshot(ctx, src.ID, from, nil)
	}
	pulled := time.Since(start)
	if early != nil && err == nil && early.prepErr == nil {
		<-early.done
		if early.err != nil || !a.pullOK(early.w) {
			if early.p != nil {
				early.p.Abort()
			}
			// The start without it attaches the NICs afresh.
			if rerr := a.releaseNetwork(context.WithoutCancel(ctx), early.m); rerr != nil {
				return fail(rerr)
			}
			a.log.Warn("early start of a child failed, starting it without", "vm", e.id, "snapshot", src.ID, "err", early.err)
			early = nil
		}
	}
	var m *Machine
	switch {
	case early != nil:
		<-early.done
		switch {
		case err != nil:
			if early.p != nil {
				early.p.Abort()
			}
			return fail(err)
		case early.prepErr != nil:
			return fail(early.prepErr)
		}
		m = early.m
		if err := early.p.Finish(ctx); err != nil {
			return fail(err)
		}
	case err != nil:
		return fail(err)
	default:
		if m, err = prepare(rec); err != nil {
			return fail(err)
		}
		if err := sn.Spawn(ctx, m, a.snapDir(src.ID), rec.files()); err != nil {
			return fail(err)
		}
	}
	r.State, r.Process, r.Disk, r.NICs = agentapi.StateRunning, m.Process, m.Disk, m.NICs
	if err := a.saveRecord(&r); err != nil {
		return fail(err)
	}
	e.set(r)
	a.log.Info("vm started from snapshot", "vm", e.id, "snapshot", src.ID, "pid", r.Process.PID, "early", early != nil,
		"snapshot_ready_ms", pulled.Milliseconds(), "total_ms", time.Since(start).Milliseconds())
	return r.wire(), nil
}

// earlySpawn is a child started from the files of pull w while it is
// under way: done is closed once StartSpawn returned p or err (or prepare
// failed, prepErr).
type earlySpawn struct {
	w       *pullWatch
	done    chan struct{}
	m       *Machine
	p       PendingSpawn
	prepErr error
	err     error
}

// start prepares the child (on the caller's goroutine) and starts its
// process (on another); the child has joined the pull.
func (s *earlySpawn) start(ctx context.Context, a *Agent, es EarlySpawner, prepare func(*snapshotRecord) (*Machine, error), id string) {
	s.m, s.prepErr = prepare(&s.w.rec)
	if s.prepErr != nil {
		a.leavePull(s.w)
		close(s.done)
		return
	}
	files, m, w := s.w.rec.files(), s.m, s.w
	go func() {
		defer close(s.done)
		defer a.leavePull(w)
		s.p, s.err = es.StartSpawn(ctx, m, a.snapDir(id), w.at, files)
	}()
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
		if (guest[i].Mode == agentapi.NetworkNAT || guest[i].Mode == agentapi.NetworkOverlay) && guest[i].CIDR != child[i].CIDR {
			return errInvalid("snapshot %s: nics[%d] of its vm is on %s, the child's on %s: a child keeps its guest's network",
				id, i, guest[i].CIDR, child[i].CIDR)
		}
	}
	return nil
}
