package agent

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

const (
	metaFile      = "vm.json"
	corruptSuffix = ".corrupt"
	metaVersion   = 1
	// trashPrefix marks a VM directory being deleted: it is renamed first
	// (atomic), then removed, so a crash halfway never leaves a half VM.
	trashPrefix = ".trash-"
)

// vmRecord is the durable metadata of one VM, <state-dir>/vms/<id>/vm.json.
type vmRecord struct {
	Version     int       `json:"version"`
	ID          string    `json:"id"`
	Image       string    `json:"image"`
	VCPUs       int64     `json:"vcpus"`
	MemoryMiB   int64     `json:"memory_mib"`
	DiskMiB     int64     `json:"disk_mib"`
	State       string    `json:"state"`
	Reason      string    `json:"reason,omitempty"`
	StartedFrom string    `json:"started_from"`
	CreatedAt   time.Time `json:"created_at"`
	Process     Process   `json:"process"`
	// Disk is the disk file the VM writes to (Machine.Disk); a snapshot
	// changes it. Empty: the driver's first disk file.
	Disk string `json:"disk,omitempty"`
	// Snapshot is the snapshot the VM was started from: its disk sits on
	// that snapshot's frozen disk, so the snapshot stays while the VM does.
	Snapshot string `json:"snapshot,omitempty"`
	// NICs are the VM's network interfaces, with the host ports the driver
	// chose; GuestNICs the source's NICs of a VM started from a snapshot
	// (Machine.GuestNICs).
	NICs      []agentapi.NIC `json:"nics,omitempty"`
	GuestNICs []agentapi.NIC `json:"guest_nics,omitempty"`
	// AskedMACs are the MACs the create asked for, by NIC, when the VM
	// runs with others: a warm pool VM keeps the MAC it booted with
	// (pool_acquire.go). An idempotent create compares against these.
	AskedMACs []string `json:"asked_macs,omitempty"`
	// Seed is the VM's NoCloud seed (guest.go), built into seed.iso in its
	// directory and attached at every boot; nil: no seed disk.
	Seed *agentapi.SeedSpec `json:"seed,omitempty"`
	// GuestAgent: the VM has the QEMU guest agent channel (guest.go).
	GuestAgent bool `json:"guest_agent,omitempty"`
	// Volumes are the volumes attached to the VM (volume_attach.go).
	Volumes []vmVolume `json:"volumes,omitempty"`
	// Firmware is what the VM boots with, fixed at its create (a record
	// of an older agent has none: bios); SecureBoot says Secure Boot is on.
	Firmware   string `json:"firmware,omitempty"`
	SecureBoot bool   `json:"secure_boot,omitempty"`
	// Incoming is set on a VM prepared here for a migration from another
	// agent until its source commits it (migrate_incoming.go); Migration
	// is the last migration of this VM to another agent
	// (migrate_source.go).
	Incoming  *incomingRecord     `json:"incoming,omitempty"`
	Migration *agentapi.Migration `json:"migration,omitempty"`
}

// firmware is the VM's firmware, bios for a record that names none.
func (r *vmRecord) firmware() string {
	if r.Firmware == "" {
		return agentapi.FirmwareBIOS
	}
	return r.Firmware
}

func (r *vmRecord) wire() agentapi.VM {
	return agentapi.VM{
		ID: r.ID, Image: r.Image, VCPUs: r.VCPUs, MemoryMiB: r.MemoryMiB, DiskMiB: r.DiskMiB,
		State: r.State, Reason: r.Reason, StartedFrom: r.StartedFrom, PID: r.Process.PID,
		NICs: cloneNICs(r.NICs), CreatedAt: r.CreatedAt, GuestAgent: r.GuestAgent, Volumes: wireVolumes(r.Volumes),
		Firmware: r.firmware(), SecureBoot: r.SecureBoot,
	}
}

func (r *vmRecord) validate(dirName string) error {
	switch {
	case r.Version != metaVersion:
		return fmt.Errorf("version %d, want %d", r.Version, metaVersion)
	case r.ID != dirName:
		return fmt.Errorf("id %q does not match its directory %q", r.ID, dirName)
	case r.Image == "" || r.VCPUs < 1 || r.MemoryMiB < 1 || r.DiskMiB < 0:
		return errors.New("image or shape missing")
	}
	switch r.State {
	case agentapi.StateCreating, agentapi.StateRunning, agentapi.StatePaused, agentapi.StateStopped, agentapi.StateError,
		agentapi.StateIncoming, agentapi.StateMigrated, agentapi.StateFailed:
		return nil
	}
	return fmt.Errorf("unknown state %q", r.State)
}

// writeFileAtomic writes data to path through a temporary file in the same
// directory, synced, then renamed over path, then the directory synced: a
// reader (or a crash) sees the old file or the new one, never a mix.
func writeFileAtomic(path string, data []byte, sync bool) error {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer func() { _ = os.Remove(tmp) }() // no-op after the rename
	if _, err := f.Write(data); err != nil {
		_ = f.Close()
		return err
	}
	if sync {
		if err := f.Sync(); err != nil {
			_ = f.Close()
			return err
		}
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		return err
	}
	if sync {
		d, err := os.Open(dir)
		if err != nil {
			return err
		}
		defer func() { _ = d.Close() }()
		return d.Sync()
	}
	return nil
}

func (a *Agent) vmsDir() string            { return filepath.Join(a.cfg.StateDir, "vms") }
func (a *Agent) vmDir(id string) string    { return filepath.Join(a.vmsDir(), id) }
func (a *Agent) metaPath(id string) string { return filepath.Join(a.vmDir(id), metaFile) }

func (a *Agent) saveRecord(r *vmRecord) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	if err := writeFileAtomic(a.metaPath(r.ID), b, !a.cfg.NoSync); err != nil {
		return fmt.Errorf("write metadata of vm %s: %w", r.ID, err)
	}
	return nil
}

// loadedVM is what start-up finds in one VM directory.
type loadedVM struct {
	id      string
	rec     *vmRecord // nil when the metadata is corrupt
	corrupt string    // why, when rec is nil
}

// loadRecords reads every VM directory. A corrupt metadata file is moved
// aside to vm.json.corrupt and reported; it never stops the others.
func (a *Agent) loadRecords() ([]loadedVM, error) {
	entries, err := os.ReadDir(a.vmsDir())
	if err != nil {
		return nil, fmt.Errorf("read vm directory %s: %w", a.vmsDir(), err)
	}
	var out []loadedVM
	for _, e := range entries {
		name := e.Name()
		if !e.IsDir() {
			continue
		}
		dir := filepath.Join(a.vmsDir(), name)
		if strings.HasPrefix(name, trashPrefix) {
			if err := os.RemoveAll(dir); err != nil {
				a.log.Warn("remove the rest of a deleted vm", "dir", dir, "err", err)
			}
			continue
		}
		path := filepath.Join(dir, metaFile)
		b, err := os.ReadFile(path)
		if errors.Is(err, os.ErrNotExist) {
			if _, cerr := os.Stat(path + corruptSuffix); cerr == nil {
				out = append(out, loadedVM{id: name, corrupt: "its metadata was found corrupt earlier and moved aside to " + path + corruptSuffix})
				continue
			}
			// A create that crashed before its first metadata write: nothing
			// was started for it, so the directory is garbage.
			a.log.Warn("remove a vm directory without metadata", "dir", dir)
			if err := os.RemoveAll(dir); err != nil {
				a.log.Warn("remove vm directory", "dir", dir, "err", err)
			}
			continue
		}
		var rec vmRecord
		if err == nil {
			err = json.Unmarshal(b, &rec)
		}
		if err == nil {
			err = rec.validate(name)
		}
		if err != nil {
			reason := fmt.Sprintf("metadata %s is corrupt (%v)", path, err)
			if rerr := os.Rename(path, path+corruptSuffix); rerr != nil {
				reason += fmt.Sprintf("; moving it aside failed: %v", rerr)
			} else {
				reason += "; moved aside to " + path + corruptSuffix
			}
			a.log.Error("corrupt vm metadata", "vm", name, "reason", reason)
			out = append(out, loadedVM{id: name, corrupt: reason})
			continue
		}
		out = append(out, loadedVM{id: name, rec: &rec})
	}
	return out, nil
}

// askedNICs are the NICs the VM's create asked for: its NICs with the MACs
// of AskedMACs where the agent gave others.
func (r vmRecord) askedNICs() []agentapi.NIC {
	if len(r.AskedMACs) == 0 {
		return r.NICs
	}
	nics := cloneNICs(r.NICs)
	for i, mac := range r.AskedMACs {
		if i < len(nics) && mac != "" {
			nics[i].MACAddress = mac
		}
	}
	return nics
}
