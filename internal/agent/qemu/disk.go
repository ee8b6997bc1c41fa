package qemu

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"strconv"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
)

var _ agent.DiskResizer = (*Driver)(nil)

// ResizeDisk grows the VM's disk overlay: QMP block_resize on the running
// QEMU (the guest's virtio disk sees the new capacity at once), else
// qemu-img resize on the file.
func (d *Driver) ResizeDisk(ctx context.Context, m *agent.Machine, online bool, diskMiB int64) error {
	bytesSize := diskMiB << 20
	if online {
		if err := d.withMonitor(ctx, m, func(q *monitor) error { return q.blockResize(ctx, driveID, bytesSize) }); err != nil {
			return fmt.Errorf("qmp block_resize: %w", err)
		}
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, d.qemuImg, "resize", "-q", diskPath(m), strconv.FormatInt(bytesSize, 10)).CombinedOutput()
	if err != nil {
		return fmt.Errorf("qemu-img resize %s: %w: %s", diskPath(m), err, bytes.TrimSpace(out))
	}
	return nil
}
