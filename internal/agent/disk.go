package agent

import (
	"context"
	"fmt"
	"net/http"

	"github.com/labstack/echo/v4"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// DiskResizer is a driver that can grow a VM's disk: online (the VM runs
// or is paused) or offline (stopped).
type DiskResizer interface {
	ResizeDisk(ctx context.Context, m *Machine, online bool, diskMiB int64) error
}

// DiskOverhead is a driver whose VMs take host disk beside their disk_mib
// (the qemu driver: each VM's console log, up to its cap). The agent counts
// it per VM, user and warm, in the disk it reports allocated and free and
// in the warm pool's room.
type DiskOverhead interface {
	VMDiskOverheadMiB() int64
}

// vmDiskMiB is the host disk a VM of disk_mib diskMiB takes.
func (a *Agent) vmDiskMiB(diskMiB int64) int64 {
	if o, ok := a.cfg.Driver.(DiskOverhead); ok {
		return diskMiB + o.VMDiskOverheadMiB()
	}
	return diskMiB
}

// ResizeDisk grows VM id's disk to diskMiB in place. A smaller size is
// refused; the same size changes nothing.
func (a *Agent) ResizeDisk(ctx context.Context, id string, diskMiB int64) (agentapi.VM, error) {
	e, err := a.lockVM(ctx, id, "grow its disk")
	if err != nil {
		return agentapi.VM{}, err
	}
	defer e.unlock()
	r := a.refreshLocked(ctx, e)
	switch {
	case diskMiB == r.DiskMiB:
		return r.wire(), nil
	case diskMiB < r.DiskMiB:
		return agentapi.VM{}, errInvalid("disk_mib %d is smaller than vm %s's %d MiB disk: disks grow, never shrink", diskMiB, id, r.DiskMiB)
	case diskMiB > 64<<20:
		return agentapi.VM{}, errInvalid("disk_mib must be at most %d, got %d", 64<<20, diskMiB)
	case r.DiskMiB == 0:
		return agentapi.VM{}, errInvalid("vm %s has no disk to grow (it was created with disk_mib 0)", id)
	}
	rd, ok := a.cfg.Driver.(DiskResizer)
	if !ok {
		return agentapi.VM{}, errInvalid("the %s driver cannot grow disks", a.cfg.Driver.Name())
	}
	online := r.State == agentapi.StateRunning || r.State == agentapi.StatePaused
	defer a.pool.userCreating()()
	if err := rd.ResizeDisk(ctx, machineOf(a, r), online, diskMiB); err != nil {
		return agentapi.VM{}, fmt.Errorf("grow the disk of vm %s to %d MiB: %w", id, diskMiB, err)
	}
	from := r.DiskMiB
	r.DiskMiB = diskMiB
	if err := a.saveRecord(&r); err != nil {
		return agentapi.VM{}, err
	}
	e.set(r)
	// The grown disk takes room the warm VMs give up, as a create does.
	a.pool.makeRoom(id)
	a.log.Info("vm disk grown", "vm", id, "from_mib", from, "to_mib", diskMiB, "online", online)
	return r.wire(), nil
}

func (a *Agent) putDisk(c echo.Context) error {
	var in agentapi.VMDisk
	if err := bindJSON(c, &in); err != nil {
		return err
	}
	vm, err := a.ResizeDisk(c.Request().Context(), c.Param("id"), in.DiskMiB)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, vm)
}
