package control

import (
	"context"
	"errors"
	"fmt"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// diskGrowth is a disk growth reserved on the VM's host and recorded on its
// row (reserveDiskGrowth), not yet applied by the agent (growDisk) or given
// back (undo).
type diskGrowth struct {
	vm       store.VM
	from, to int64
}

// reserveDiskGrowth checks and reserves the growth of a VM's disk to diskMiB:
// the growth is reserved on its host atomically, like a placement, before
// the PATCH changes anything else, so a refusal (a shrink, no room) leaves
// the VM as it was. Nil when the disk has that size already. Disks never
// shrink.
func (s *Service) reserveDiskGrowth(ctx context.Context, vm store.VM, diskMiB int64) (*diskGrowth, error) {
	from := vm.Resources.DiskMiB
	switch {
	case diskMiB == from:
		return nil, nil
	case diskMiB < from:
		return nil, invalidf("disk_mib %d is smaller than VM %s's %d MiB disk: disks grow, never shrink; create a new VM for a smaller disk", diskMiB, vm.ID, from)
	case api.Gone(vm.ObservedState):
		return nil, conflictf("VM %s is %s on host %s; delete it and create it again", vm.ID, vm.ObservedState, vm.HostName)
	}
	if err := validateSize("disk_mib", diskMiB, 64<<20, "MiB"); err != nil {
		return nil, err
	}
	if _, alive, _ := s.view.agent(vm.HostName); !alive {
		return nil, unavailable(nil, "host %s of VM %s does not answer; retry when it is back", vm.HostName, vm.ID)
	}
	err := s.store.GrowVMDisk(ctx, vm.ID, vm.HostName, from, diskMiB)
	switch {
	case errors.Is(err, store.ErrNoRoom):
		s.refreshHost(ctx, vm.HostName)
		return nil, &Error{Code: api.CodeNoCapacity, Err: err,
			Message: fmt.Sprintf("host %s has no room for %d MiB more disk for VM %s", vm.HostName, diskMiB-from, vm.ID)}
	case errors.Is(err, store.ErrNotFound):
		return nil, conflictf("VM %s changed while its disk was being grown; read it and retry", vm.ID)
	case err != nil:
		return nil, internal(err, "reserve disk of vm "+vm.ID)
	}
	s.refreshHost(ctx, vm.HostName)
	return &diskGrowth{vm: vm, from: from, to: diskMiB}, nil
}

// undo gives a reserved growth back (a later step of the PATCH failed, or
// the agent could not grow the disk).
func (g *diskGrowth) undo(ctx context.Context, s *Service) {
	if err := s.store.UndoGrowVMDisk(ctx, g.vm.ID, g.vm.HostName, g.from, g.to); err != nil {
		s.log.Error("give back a disk growth that was not applied", "vm", g.vm.ID, "err", err)
	}
	s.refreshHost(ctx, g.vm.HostName)
}

// growDisk has the agent grow the reserved disk (qemu-img resize when
// stopped, QMP block_resize while running); a failure gives the
// reservation back.
func (s *Service) growDisk(ctx context.Context, g *diskGrowth) error {
	vm := g.vm
	address, alive, _ := s.view.agent(vm.HostName)
	if !alive {
		g.undo(ctx, s)
		return unavailable(nil, "host %s of VM %s does not answer; retry when it is back", vm.HostName, vm.ID)
	}
	if _, err := s.agents.resizeDisk(ctx, s.agents.client(address), vm.ID, g.to); err != nil {
		g.undo(ctx, s)
		return fromAgent(err, vm.HostName, fmt.Sprintf("grow the disk of VM %s to %d MiB", vm.ID, g.to))
	}
	s.log.Info("vm disk grown", "vm", vm.ID, "host", vm.HostName, "from_mib", g.from, "to_mib", g.to)
	return nil
}

func (p *agentPool) resizeDisk(ctx context.Context, c *agentapi.Client, id string, diskMiB int64) (agentapi.VM, error) {
	var out agentapi.VM
	err := p.call("resize_disk", func() (err error) { out, err = c.ResizeDisk(ctx, id, agentapi.VMDisk{DiskMiB: diskMiB}); return err })
	return out, err
}
