package sim

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

var _ agent.Snapshotter = (*Driver)(nil)

// Snapshot writes two small files that stand for the memory state and the
// frozen disk, so that the agent's metadata, pulls and checksums work as
// with real VMs, and keeps the VM paused when asked.
func (d *Driver) Snapshot(_ context.Context, m *agent.Machine, dir string, opts agent.SnapshotOptions) (agent.SnapshotFiles, error) {
	d.mu.Lock()
	st, ok := d.state[m.ID]
	d.mu.Unlock()
	if !ok {
		return agent.SnapshotFiles{}, fmt.Errorf("snapshot sim vm %s: it is not running", m.ID)
	}
	files := agent.SnapshotFiles{Memory: "memory.state"}
	at := time.Now().UTC().Format(time.RFC3339Nano)
	mem := fmt.Sprintf("sim memory state of vm %s: %d vcpus, %d MiB, %s at %s\n", m.ID, m.VCPUs, m.MemoryMiB, st, at)
	if err := os.WriteFile(filepath.Join(dir, files.Memory), []byte(mem), 0o640); err != nil {
		return files, fmt.Errorf("snapshot sim vm %s: %w", m.ID, err)
	}
	if m.DiskMiB > 0 {
		files.Disk = "disk.img"
		disk := fmt.Sprintf("sim frozen disk of vm %s: %d MiB at %s\n", m.ID, m.DiskMiB, at)
		if err := os.WriteFile(filepath.Join(dir, files.Disk), []byte(disk), 0o444); err != nil {
			return files, fmt.Errorf("snapshot sim vm %s: %w", m.ID, err)
		}
	}
	// The VM's volumes move onto their overlays: the sim's VMM writes
	// nothing, so the move is the check that each overlay exists and the
	// record of the file the VM now uses (Writing).
	for _, sw := range opts.Volumes {
		if _, err := os.Stat(sw.Next); err != nil {
			return files, fmt.Errorf("snapshot sim vm %s: volume %s: %w", m.ID, sw.Volume.ID, err)
		}
		d.mu.Lock()
		fail := d.failVolumeSwitch
		d.mu.Unlock()
		if fail != nil {
			if err := fail(sw.Volume.ID); err != nil {
				return files, fmt.Errorf("snapshot sim vm %s: volume %s: %w", m.ID, sw.Volume.ID, err)
			}
		}
		d.mu.Lock()
		d.writing[sw.Volume.ID] = sw.Next
		d.mu.Unlock()
		files.SwitchedVolumes = append(files.SwitchedVolumes, sw.Volume.ID)
	}
	if opts.KeepPaused {
		d.mu.Lock()
		d.state[m.ID] = agentapi.StatePaused
		d.mu.Unlock()
	}
	return files, nil
}

// AdoptPulled has nothing to check: a sim disk file stands for a disk and
// names no other file.
func (d *Driver) AdoptPulled(context.Context, string, agent.SnapshotFiles, agent.PulledFrom) ([]string, error) {
	return nil, nil
}

// Spawn checks that the snapshot's memory file is there and boots the VM.
func (d *Driver) Spawn(ctx context.Context, m *agent.Machine, dir string, files agent.SnapshotFiles) error {
	if _, err := os.Stat(filepath.Join(dir, files.Memory)); err != nil {
		return fmt.Errorf("start sim vm %s from snapshot: %w", m.ID, err)
	}
	if err := d.Boot(ctx, m, agent.BootOptions{}); err != nil {
		return err
	}
	// A restored guest continues its source's boot: it has not read its
	// own seed (it does at its next boot).
	d.mu.Lock()
	d.booted[m.ID] = time.Time{}
	d.mu.Unlock()
	return nil
}
