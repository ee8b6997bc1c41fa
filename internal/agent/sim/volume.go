package sim

import (
	"context"
	"fmt"
	"io"
	"os"
	"slices"
	"sort"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
)

var _ agent.Volumer = (*Driver)(nil)

// CreateVolumeDisk makes a sparse file of the volume's size: the sim has
// no qcow2, but the agent's files, renames and crash handling are real.
func (d *Driver) CreateVolumeDisk(_ context.Context, path string, sizeMiB int64, _ agent.VolumeFrom) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	if err := f.Truncate(sizeMiB << 20); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}

// ResizeVolumeDisk grows the sparse file.
func (d *Driver) ResizeVolumeDisk(_ context.Context, path string, sizeMiB int64) error {
	return os.Truncate(path, sizeMiB<<20)
}

// AttachVolume records the volume as plugged into the running VM.
func (d *Driver) AttachVolume(_ context.Context, m *agent.Machine, v agent.MachineVolume) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, up := d.state[m.ID]; !up {
		return fmt.Errorf("vm %s is not running", m.ID)
	}
	if d.plugged[m.ID] == nil {
		d.plugged[m.ID] = map[string]bool{}
	}
	d.plugged[m.ID][v.ID] = true
	return nil
}

// DetachVolume records the volume as unplugged.
func (d *Driver) DetachVolume(_ context.Context, m *agent.Machine, v agent.MachineVolume) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(d.plugged[m.ID], v.ID)
	return nil
}

// ResizeAttachedVolume grows the sparse file.
func (d *Driver) ResizeAttachedVolume(ctx context.Context, _ *agent.Machine, v agent.MachineVolume, sizeMiB int64) error {
	return d.ResizeVolumeDisk(ctx, v.Path, sizeMiB)
}

// Plugged lists the volumes plugged into VM id's simulated VMM (attached
// at boot or hot), sorted.
func (d *Driver) Plugged(id string) []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []string
	for v := range d.plugged[id] {
		out = append(out, v)
	}
	sort.Strings(out)
	return slices.Clip(out)
}

// ExportVolumeDisk copies the volume's file.
func (d *Driver) ExportVolumeDisk(_ context.Context, v agent.MachineVolume, dst string) error {
	in, err := os.Open(v.Path)
	if err != nil {
		return err
	}
	defer func() { _ = in.Close() }()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		_ = out.Close()
		return err
	}
	return out.Close()
}

// Writing is the file the simulated VMM of a running VM writes for volume
// id since the last snapshot moved it ("" when no snapshot did).
func (d *Driver) Writing(id string) string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.writing[id]
}

// FailVolumeSwitch makes the next snapshots fail to move a volume when
// fail returns an error for its id (nil: never), as a VMM that refuses.
func (d *Driver) FailVolumeSwitch(fail func(volume string) error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.failVolumeSwitch = fail
}

// CheckPulledVolumeDisk accepts the sim's plain files.
func (d *Driver) CheckPulledVolumeDisk(context.Context, string) error { return nil }
