package agent

import (
	"context"
	"fmt"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// ResizeVM gives VM id a new number of vCPUs and amount of memory, keeping
// its disk. The change is a cold restart, not a hot-plug: QEMU's memory and
// vCPU hot-plug need a machine with DIMM slots and hot-pluggable CPUs
// declared at boot (microvm has neither) and a guest that onlines what is
// added, while a restart on the VM's own disk works for every image, both
// accelerators, warm VMs and fork children alike.
//
// A running VM is shut down (ACPI, then quit after the stop timeout),
// its new shape is recorded, and it boots again from its own disk: a fork
// child from its overlay on the snapshot's frozen disk, with fresh RAM
// rather than the snapshot's RAM image. A paused VM comes back paused (its
// vCPUs stopped before the guest runs), a stopped or failed VM only takes
// the shape, which its next start uses. The same shape again changes
// nothing, so a retried call is harmless.
func (a *Agent) ResizeVM(ctx context.Context, id string, shape agentapi.VMShape) (agentapi.VM, error) {
	if err := checkID(id); err != nil {
		return agentapi.VM{}, err
	}
	e, err := a.lockVM(ctx, id, "be resized")
	if err != nil {
		return agentapi.VM{}, err
	}
	defer e.unlock()
	r := a.refreshLocked(ctx, e)
	if r.VCPUs == shape.VCPUs && r.MemoryMiB == shape.MemoryMiB {
		return r.wire(), nil
	}
	if r.State == agentapi.StateCreating {
		return agentapi.VM{}, errConflict("vm %s is still being created; resize it once it is up", id)
	}
	spec := agentapi.VMSpec{Image: r.Image, VCPUs: shape.VCPUs, MemoryMiB: shape.MemoryMiB, DiskMiB: r.DiskMiB,
		Firmware: r.firmware(), SecureBoot: r.SecureBoot}
	if err := a.checkShape(spec); err != nil {
		return agentapi.VM{}, err
	}
	old := r
	// The filler waits until the change is done: a growth may need the
	// warm VMs' share (makeRoom below).
	defer a.pool.userCreating()()
	d := a.cfg.Driver
	m := machineOf(a, r)
	wasUp := r.State == agentapi.StateRunning || r.State == agentapi.StatePaused
	if wasUp {
		if err := d.Shutdown(ctx, m, a.cfg.StopTimeout); err != nil {
			a.refreshLocked(ctx, e)
			return agentapi.VM{}, fmt.Errorf("resize vm %s: stop it: %w", id, err)
		}
	} else if r.State == agentapi.StateError {
		if err := d.Kill(ctx, m); err != nil { // whatever is left of it
			return agentapi.VM{}, fmt.Errorf("resize vm %s: end what is left of it: %w", id, err)
		}
	}
	// The new shape is durable before the VM boots with it: after a crash
	// here the agent reports a stopped VM with the new shape, never a VM
	// whose shape differs from its record.
	r.VCPUs, r.MemoryMiB = shape.VCPUs, shape.MemoryMiB
	r.State, r.Reason, r.Process = agentapi.StateStopped, "", Process{}
	if err := a.saveRecord(&r); err != nil {
		// Nothing recorded: the old shape stands. Bring the VM back in it.
		a.restartAfterFailedResize(ctx, e, old, wasUp)
		return agentapi.VM{}, fmt.Errorf("resize vm %s: record the new shape: %w", id, err)
	}
	if wasUp {
		// Until the boot is done, listings show the new shape in the state
		// the VM is coming back to: a stopped VM for the few seconds of a
		// restart would read as drift and be recorded by the control plane.
		shown := r
		shown.State = old.State
		e.set(shown)
		// A growth boots into room the warm VMs give up, as a create does.
		a.pool.makeRoom(id)
		m = machineOf(a, r)
		if err := a.ensureSeed(r); err != nil {
			return agentapi.VM{}, a.failedRestart(ctx, e, r, err)
		}
		if err := d.Create(ctx, m); err != nil {
			return agentapi.VM{}, a.failedRestart(ctx, e, r, err)
		}
		if err := d.Boot(ctx, m, BootOptions{Paused: old.State == agentapi.StatePaused}); err != nil {
			return agentapi.VM{}, a.failedRestart(ctx, e, r, err)
		}
		r.State, r.Process = old.State, m.Process
		if err := a.saveRecord(&r); err != nil {
			return agentapi.VM{}, fmt.Errorf("resize vm %s: record the restarted vm: %w", id, err)
		}
		e.set(r)
	} else {
		// A stopped VM keeps its reservation in its new shape.
		e.set(r)
		a.pool.makeRoom(id)
	}
	a.log.Info("vm resized", "vm", id, "vcpus", r.VCPUs, "memory_mib", r.MemoryMiB,
		"was_vcpus", old.VCPUs, "was_memory_mib", old.MemoryMiB, "state", r.State, "pid", r.Process.PID)
	return r.wire(), nil
}

// checkShape validates a new shape of an existing VM like a create's.
func (a *Agent) checkShape(spec agentapi.VMSpec) error {
	switch {
	case spec.VCPUs < 1 || spec.VCPUs > 255:
		return errInvalid("vcpus must be between 1 and 255, got %d", spec.VCPUs)
	case spec.MemoryMiB < 1 || spec.MemoryMiB > 16<<20:
		return errInvalid("memory_mib must be between 1 and %d, got %d", 16<<20, spec.MemoryMiB)
	}
	// An image that went away is no reason to refuse: the boot reports
	// what it misses.
	if img, err := a.cfg.Driver.Image(spec.Image); err == nil {
		return a.cfg.Driver.CheckSpec(spec, img)
	}
	return nil
}

// failedRestart records a VM whose boot in its new shape failed: it stays
// stopped in the new shape (which its record holds), with the reason, so
// a start retries it and the control plane sees which shape it has.
func (a *Agent) failedRestart(ctx context.Context, e *vmEntry, r vmRecord, err error) error {
	_ = a.cfg.Driver.Kill(ctx, machineOf(a, r))
	r.State, r.Process = agentapi.StateStopped, Process{}
	r.Reason = fmt.Sprintf("boot in the new shape (%d vcpus, %d MiB) failed: %v; start the vm to retry", r.VCPUs, r.MemoryMiB, err)
	if serr := a.saveRecord(&r); serr != nil {
		a.log.Error("save vm after a failed resize", "vm", r.ID, "err", serr)
	}
	e.set(r)
	return fmt.Errorf("resize vm %s: boot it with %d vcpus and %d MiB: %w", r.ID, r.VCPUs, r.MemoryMiB, err)
}

// restartAfterFailedResize boots a VM again in its old shape after the new
// one could not be recorded.
func (a *Agent) restartAfterFailedResize(ctx context.Context, e *vmEntry, old vmRecord, wasUp bool) {
	if !wasUp {
		return
	}
	m := machineOf(a, old)
	err := a.cfg.Driver.Boot(ctx, m, BootOptions{Paused: old.State == agentapi.StatePaused})
	if err != nil {
		a.log.Error("restart vm in its old shape after a failed resize", "vm", old.ID, "err", err)
		a.refreshLocked(ctx, e)
		return
	}
	old.Process = m.Process
	e.set(old)
	if err := a.saveRecord(&old); err != nil {
		a.log.Error("save vm restarted in its old shape", "vm", old.ID, "err", err)
	}
}
