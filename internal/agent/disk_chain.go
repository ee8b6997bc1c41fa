package agent

// A VM's disk chain stays short.
//
// Each snapshot of a VM freezes the file its disk writes to and puts a new
// overlay on it (the QEMU driver's snapshot.go), so a VM forked again and
// again would sit on one file per snapshot: every read of a block the
// newest file lacks walks down the chain, and every snapshot, so every
// pull of one, lists the whole chain. Past Config.DiskChainDepth files the
// driver flattens the chain (DiskFlattener): in the background after a
// snapshot, and before one if that has not happened yet, so no snapshot
// lists more disk files than the depth, and a pull refuses one that does
// (snapshot_pull.go) before it moves a byte.

import (
	"context"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// DefaultDiskChainDepth is Config.DiskChainDepth when none is given.
const DefaultDiskChainDepth = 8

// flattenTimeout bounds one flatten: it copies what the VM wrote since its
// last flatten, at disk speed.
const flattenTimeout = 30 * time.Minute

// DiskFlattener is a Driver that can shorten a VM's disk chain.
type DiskFlattener interface {
	// FlattenDisk makes the chain of m's own disk files (those in m.Dir
	// its disk sits on, not its image's or a snapshot's) at most depth
	// files long when it is longer, with the guest's view of its disk
	// unchanged, whether m runs, is paused or is stopped. Files that leave
	// the chain leave m.Dir; a snapshot that froze them has links of its
	// own. It returns the chain's length before and after. The caller
	// holds the VM.
	FlattenDisk(ctx context.Context, m *Machine, depth int) (before, after int, err error)
}

// flattenLocked bounds the disk chain of VM r, whose entry the caller
// holds; a VM in a migration, or of a driver that cannot, is left alone.
func (a *Agent) flattenLocked(ctx context.Context, r vmRecord) error {
	f, ok := a.cfg.Driver.(DiskFlattener)
	if !ok || r.DiskMiB == 0 || r.Migration != nil {
		return nil
	}
	switch r.State {
	case agentapi.StateRunning, agentapi.StatePaused, agentapi.StateStopped:
	default:
		return nil
	}
	start := time.Now()
	before, after, err := f.FlattenDisk(ctx, machineOf(a, r), a.cfg.DiskChainDepth)
	if err != nil {
		return err
	}
	if after != before {
		a.log.Info("vm disk chain flattened", "vm", r.ID, "state", r.State, "files_before", before, "files_after", after,
			"depth", a.cfg.DiskChainDepth, "ms", time.Since(start).Milliseconds())
	}
	return nil
}

// flattenLater bounds the disk chain of VM id in the background, once its
// other work lets go of it: called after a snapshot that left the chain
// longer than the depth. Close stops the wait and the flatten's watch
// (a block job QEMU runs goes on; the next flatten waits for it).
func (a *Agent) flattenLater(id string) {
	if _, ok := a.cfg.Driver.(DiskFlattener); !ok {
		return
	}
	a.syncs.Go(func() {
		ctx, cancel := context.WithTimeout(context.Background(), flattenTimeout)
		defer cancel()
		// Ends with the flatten (cancel above).
		go func() {
			select {
			case <-a.closing:
				cancel()
			case <-ctx.Done():
			}
		}()
		e, err := a.lockVM(ctx, id, "have its disk chain flattened")
		if err != nil {
			a.log.Debug("no disk chain flatten", "vm", id, "err", err)
			return
		}
		defer e.unlock()
		// The state as recorded: the driver looks at the files, and asks
		// QEMU only when there is something to flatten.
		r, _, _ := e.state()
		if err := a.flattenLocked(ctx, r); err != nil {
			// The next snapshot of the VM flattens first, or tries again.
			a.log.Warn("flatten the disk chain of a vm", "vm", id, "err", err)
		}
	})
}
