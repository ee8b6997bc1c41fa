package control

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// resizeVM changes a VM's vCPUs and memory in place, settled like a create:
//
//  1. reserve (DB): the row records the pending shape and its host's
//     allocation takes the growth in one transaction, with placement's
//     conditional UPDATE; no room is 409 no_capacity and nothing changes;
//  2. agent PUT /v1/vms/{id}/shape: a cold restart on the VM's own disk;
//  3. settle (DB): the row takes the shape the agent reports and the host
//     gives back what the other shape held.
//
// A crash between 1 and 3 leaves the pending shape on the row; the host
// monitor settles it from the shape the agent reports (settleResize).
func (s *Service) resizeVM(ctx context.Context, vm store.VM, want store.Shape) error {
	if p, pending := vm.Pending(); pending {
		return conflictf("VM %s is being resized to %d vCPUs and %d MiB already; retry once that has settled", vm.ID, p.VCPUs, p.MemoryMiB)
	}
	if vm.Resources.VCPUs == want.VCPUs && vm.Resources.MemoryMiB == want.MemoryMiB {
		return nil
	}
	switch vm.ObservedState {
	case api.StateMissing, api.StateLost:
		return conflictf("VM %s is %s on host %s; delete it and create it again", vm.ID, vm.ObservedState, vm.HostName)
	case api.StateCreating:
		return conflictf("VM %s is still being created; resize it once it is up", vm.ID)
	}
	address, alive, _ := s.view.agent(vm.HostName)
	if !alive {
		return unavailable(nil, "host %s of VM %s does not answer; retry the resize when it is back", vm.HostName, vm.ID)
	}
	if _, err := s.store.BeginResizeOwned(ctx, vm.ID, want, &s.replicaID); err != nil {
		if errors.Is(err, store.ErrNoRoom) {
			s.refreshHost(ctx, vm.HostName)
			return s.noRoomToGrow(ctx, vm, want, err)
		}
		if errors.Is(err, store.ErrResizing) {
			return conflictf("VM %s is being resized by another request; retry once that has settled", vm.ID)
		}
		return fromStore(err, "reserve resize of vm "+vm.ID)
	}
	s.refreshHost(ctx, vm.HostName)
	log := s.log.With("vm", vm.ID, "host", vm.HostName)
	if hook := s.hooks.AfterResizeReserve; hook != nil {
		if err := hook(ctx, vm.ID); err != nil {
			// Stopped on the spot, like a process dying: the monitor settles it.
			return internal(err, "resize vm "+vm.ID)
		}
	}
	agent := s.agents.client(address)
	got, err := s.agents.resizeVM(ctx, agent, vm.ID, agentapi.VMShape{VCPUs: want.VCPUs, MemoryMiB: want.MemoryMiB})
	if err != nil {
		return s.failResize(ctx, vm, want, agent, err)
	}
	if hook := s.hooks.AfterAgentResize; hook != nil {
		if err := hook(ctx, vm.ID); err != nil {
			return internal(err, "resize vm "+vm.ID)
		}
	}
	if err := s.settleResizeTo(ctx, vm, got); err != nil {
		return err
	}
	log.Info("vm resized", "vcpus", got.VCPUs, "memory_mib", got.MemoryMiB,
		"was_vcpus", vm.Resources.VCPUs, "was_memory_mib", vm.Resources.MemoryMiB, "state", got.State)
	return nil
}

// failResize settles a resize whose agent call failed. A refusal (4xx)
// changed nothing there, so the growth goes back; otherwise the agent is
// asked which shape the VM has now, and if it cannot say, the resize stays
// pending for the host monitor.
func (s *Service) failResize(ctx context.Context, vm store.VM, want store.Shape, agent *agentapi.Client, cause error) error {
	what := fmt.Sprintf("resize VM %s to %d vCPUs and %d MiB", vm.ID, want.VCPUs, want.MemoryMiB)
	if !errors.Is(cause, agentapi.ErrUnavailable) {
		if _, _, err := s.store.FinishResize(ctx, vm.ID, false); err != nil {
			s.log.Error("release refused resize", "vm", vm.ID, "err", err)
		}
		s.refreshHost(ctx, vm.HostName)
		return fromAgent(cause, vm.HostName, what)
	}
	now, err := s.agents.getVM(ctx, agent, vm.ID)
	if err != nil {
		s.log.Warn("resize outcome unknown; the host monitor settles it", "vm", vm.ID, "host", vm.HostName, "err", err)
		return unavailable(cause, "%s: host %s did not confirm the change, so the VM's shape is settled by the next sync of that host (GET the VM to see it)", what, vm.HostName)
	}
	if err := s.settleResizeTo(ctx, vm, now); err != nil {
		return err
	}
	if now.VCPUs == want.VCPUs && now.MemoryMiB == want.MemoryMiB {
		return fromAgent(cause, vm.HostName, what+" (the new shape is recorded, but the VM did not boot in it; start it to retry)")
	}
	return fromAgent(cause, vm.HostName, what)
}

// settleResizeTo settles vm's pending resize to the shape the agent reports
// in a, and records the VM's state there.
func (s *Service) settleResizeTo(ctx context.Context, vm store.VM, a agentapi.VM) error {
	p, ok := vm.Pending()
	if !ok {
		// vm is the row from before the reservation: the pending shape is
		// what was asked, read it back.
		row, err := s.store.GetVM(ctx, vm.ID)
		if err != nil {
			return fromStore(err, "read vm "+vm.ID)
		}
		if p, ok = row.Pending(); !ok {
			return nil // settled meanwhile (the host monitor)
		}
	}
	applied := a.VCPUs == p.VCPUs && a.MemoryMiB == p.MemoryMiB
	if !applied && (a.VCPUs != vm.Resources.VCPUs || a.MemoryMiB != vm.Resources.MemoryMiB) {
		return internal(fmt.Errorf("agent reports %d vCPUs and %d MiB, neither the old shape nor the new", a.VCPUs, a.MemoryMiB),
			"settle resize of vm "+vm.ID)
	}
	if _, _, err := s.store.FinishResize(ctx, vm.ID, applied); err != nil {
		return fromStore(err, "settle resize of vm "+vm.ID)
	}
	s.refreshHost(ctx, vm.HostName)
	if err := s.store.SetVMState(ctx, vm.ID, a.State, a.Reason, ""); err != nil {
		return fromStore(err, "record state of vm "+vm.ID)
	}
	return nil
}

// settleResize is the host monitor's end of a resize whose request died
// (its replica was killed between the reservation and the agent's answer):
// the agent's shape decides. The new shape settles at once (the agent
// records it before it boots the VM in it); the old shape only once the
// replica that runs the resize is gone (its lease lapsed; without an owner,
// after CreateGrace), since the request may still be on its way to the agent.
func (s *Service) settleResize(ctx context.Context, host string, row store.VM, a agentapi.VM, l leases) store.VM {
	p, _ := row.Pending()
	applied := a.VCPUs == p.VCPUs && a.MemoryMiB == p.MemoryMiB
	old := a.VCPUs == row.Resources.VCPUs && a.MemoryMiB == row.Resources.MemoryMiB
	if !applied && (!old || !s.abandoned(l, row, store.ResizeAge(row))) {
		return row
	}
	settled, ok, err := s.store.FinishResize(ctx, row.ID, applied)
	if err != nil {
		if !errors.Is(err, store.ErrNotFound) {
			s.log.Error("host monitor: settle resize", "vm", row.ID, "host", host, "err", err)
		}
		return row
	}
	if ok {
		s.log.Warn("vm resize had not finished; settled to the shape its agent reports", "vm", row.ID, "host", host,
			"vcpus", a.VCPUs, "memory_mib", a.MemoryMiB, "applied", applied)
		s.refreshHost(ctx, host)
	}
	return settled
}

// noRoomToGrow is the 409 of a growth that its host cannot take: it names
// the host and, per resource, how much more the VM asked for and how much
// is free.
func (s *Service) noRoomToGrow(ctx context.Context, vm store.VM, want store.Shape, cause error) error {
	msg := fmt.Sprintf("host %s has no room to grow VM %s from %d to %d vCPUs and %d to %d MiB", vm.HostName, vm.ID,
		vm.Resources.VCPUs, want.VCPUs, vm.Resources.MemoryMiB, want.MemoryMiB)
	details := map[string]any{"host": vm.HostName, "vm_id": vm.ID}
	h, err := s.store.GetHost(ctx, vm.HostName)
	if err == nil {
		var short []string
		growV, growM := want.VCPUs-vm.Resources.VCPUs, want.MemoryMiB-vm.Resources.MemoryMiB
		freeV, freeM := h.Capacity.VCPUs-h.Allocated.VCPUs, h.Capacity.MemoryMiB-h.Allocated.MemoryMiB
		if !h.Alive {
			short = append(short, "the host is not alive")
		}
		if growV > freeV {
			short = append(short, fmt.Sprintf("cpu: %d more vCPUs asked, %d free", growV, max(0, freeV)))
			details["vcpus_short"] = growV - max(0, freeV)
		}
		if growM > freeM {
			short = append(short, fmt.Sprintf("memory: %d MiB more asked, %d MiB free", growM, max(0, freeM)))
			details["memory_mib_short"] = growM - max(0, freeM)
		}
		if len(short) > 0 {
			msg += " (" + strings.Join(short, "; ") + ")"
		}
	}
	msg += "; the VM keeps running in its current shape. Ask for less, free capacity on that host, or create a larger VM elsewhere"
	return &Error{Code: api.CodeNoCapacity, Message: msg, Details: details, Err: cause}
}

// renameVM gives a VM a new name; the unique index on names decides.
func (s *Service) renameVM(ctx context.Context, vm store.VM, name string) error {
	if vm.Name == name {
		return nil
	}
	if vm.ForkID != nil {
		return conflictf("VM %s is child %s of fork %s and keeps that name: a fork's children have the fixed names <fork>-<slot>", vm.ID, vm.Name, *vm.ForkID)
	}
	if err := s.store.RenameVM(ctx, vm.ID, name); err != nil {
		if errors.Is(err, store.ErrDuplicateName) {
			return s.nameTaken(ctx, vm.Project, name, err)
		}
		return fromStore(err, "rename vm "+vm.ID)
	}
	s.log.Info("vm renamed", "vm", vm.ID, "name", name, "was", vm.Name)
	return nil
}
