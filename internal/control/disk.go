package control

import (
	"context"
	"errors"
	"fmt"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// growDisk grows a VM's disk in place: the growth is reserved on its host
// first (atomically, like a placement), then the agent grows the disk
// (qemu-img resize when stopped, QMP block_resize while running); an agent
// failure gives the reservation back. Disks never shrink.
func (s *Service) growDisk(ctx context.Context, vm store.VM, diskMiB int64) error {
	from := vm.Resources.DiskMiB
	switch {
	case diskMiB == from:
		return nil
	case diskMiB < from:
		return invalidf("disk_mib %d is smaller than VM %s's %d MiB disk: disks grow, never shrink; create a new VM for a smaller disk", diskMiB, vm.ID, from)
	case vm.ObservedState == api.StateMissing:
		return conflictf("VM %s is missing on host %s; delete it and create it again", vm.ID, vm.HostName)
	}
	if err := validateSize("disk_mib", diskMiB, 64<<20, "MiB"); err != nil {
		return err
	}
	address, alive, _ := s.view.agent(vm.HostName)
	if !alive {
		return unavailable(nil, "host %s of VM %s does not answer; retry when it is back", vm.HostName, vm.ID)
	}
	err := s.store.GrowVMDisk(ctx, vm.ID, vm.HostName, from, diskMiB)
	switch {
	case errors.Is(err, store.ErrNoRoom):
		s.refreshHost(ctx, vm.HostName)
		return &Error{Code: api.CodeNoCapacity, Err: err,
			Message: fmt.Sprintf("host %s has no room for %d MiB more disk for VM %s", vm.HostName, diskMiB-from, vm.ID)}
	case errors.Is(err, store.ErrNotFound):
		return conflictf("VM %s changed while its disk was being grown; read it and retry", vm.ID)
	case err != nil:
		return internal(err, "reserve disk of vm "+vm.ID)
	}
	s.refreshHost(ctx, vm.HostName)
	_, err = s.agents.resizeDisk(ctx, s.agents.client(address), vm.ID, diskMiB)
	if err != nil {
		if uerr := s.store.UndoGrowVMDisk(ctx, vm.ID, vm.HostName, from, diskMiB); uerr != nil {
			s.log.Error("give back a disk growth that failed", "vm", vm.ID, "err", uerr)
		}
		s.refreshHost(ctx, vm.HostName)
		return fromAgent(err, vm.HostName, fmt.Sprintf("grow the disk of VM %s to %d MiB", vm.ID, diskMiB))
	}
	s.log.Info("vm disk grown", "vm", vm.ID, "host", vm.HostName, "from_mib", from, "to_mib", diskMiB)
	return nil
}

func (p *agentPool) resizeDisk(ctx context.Context, c *agentapi.Client, id string, diskMiB int64) (agentapi.VM, error) {
	var out agentapi.VM
	err := p.call("resize_disk", func() (err error) { out, err = c.ResizeDisk(ctx, id, agentapi.VMDisk{DiskMiB: diskMiB}); return err })
	return out, err
}
