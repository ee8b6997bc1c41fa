package agent

// Snapshots (docs/guides/architecture.md): the memory and disk of a running VM taken
// in one paused window, children started from them, and pulls of a snapshot
// from another agent so that a child can start on another host.
//
// A snapshot lives in <state>/snapshots/<id>/: the files its driver made
// (for QEMU memory.state and the frozen disk chain, hard-linked from the
// source VM, so that taking it copies no disk data) and snapshot.json, its
// metadata with the size and sha256 of every file. Work in progress is done
// in a <state>/snapshots/.partial-* or .pull-* directory that is renamed
// into place whole, so a snapshot directory either is complete or does not
// exist; start-up removes what a crash left of such work.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"path/filepath"
	"regexp"
	"slices"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

const (
	snapshotMetaFile = "snapshot.json"
	snapshotVersion  = 1
	partialPrefix    = ".partial-"
	pullPrefix       = ".pull-"
	// snapshotTimeout and pullTimeout bound taking a snapshot and pulling
	// one. Both go on when the caller gives up (a retry then waits for
	// them and finds the snapshot), so that a client timeout never costs a
	// second pause of the source or a second transfer.
	snapshotTimeout = 10 * time.Minute
	pullTimeout     = 10 * time.Minute
	// maxSnapshotDepth bounds a chain of parent snapshots (a fork of a
	// fork of ...) that one pull follows.
	maxSnapshotDepth = 16
)

// Snapshotter is a Driver that can snapshot a VM and start VMs from a
// snapshot. The agent owns the snapshot directories and their metadata; the
// driver makes and reads the files in them.
type Snapshotter interface {
	// Snapshot saves m's memory and device state and freezes its disk, both
	// at one point in time, into dir: an empty directory on the same
	// filesystem as m.Dir. The VM is paused meanwhile and continued at the
	// end unless opts.KeepPaused. A VM with a disk goes on writing to a new
	// overlay on the frozen disk: Snapshot calls opts.RecordDisk with its
	// name before the VM writes to it, and sets m.Disk. Files in dir are
	// never written again.
	Snapshot(ctx context.Context, m *Machine, dir string, opts SnapshotOptions) (SnapshotFiles, error)
	// Spawn makes m's disk, an overlay of its own on the frozen disk in
	// dir, and starts m running from the memory state, with a new identity
	// (vmgenid). m.Process is set as by Boot.
	Spawn(ctx context.Context, m *Machine, dir string, files SnapshotFiles) error
	// AdoptPulled checks the disk chain of a snapshot pulled from another
	// agent into dir before anything opens it: each disk file may name as
	// its backing file only another file of the snapshot, a file of its
	// parent snapshot (from.ParentDir) or the base disk of its image on
	// this agent, and the driver rewrites every name to this agent's own
	// file. Anything else is refused: a peer must not make this host's
	// VMs read files of its choosing. It returns the files it rewrote.
	AdoptPulled(ctx context.Context, dir string, files SnapshotFiles, from PulledFrom) ([]string, error)
}

// EarlySpawner is a Snapshotter that can start a child's process while
// the snapshot it starts from is still being pulled, so that the start
// overlaps the transfer of the RAM image (snapshot_spawn.go).
type EarlySpawner interface {
	// StartSpawn is Spawn up to the point where the child's memory would be
	// loaded: it makes m's disk, an overlay that names the frozen disk in
	// dir (where the snapshot will be), and starts m's process waiting for
	// its state, with the snapshot's files opened in at (where they are
	// now, at == dir once the snapshot is in place). In at, the disk chain
	// is complete and adopted (AdoptPulled); the RAM image exists at its
	// full size but may still be written: StartSpawn may map it, never
	// read it. Nothing reads the device state or the RAM image before
	// Finish, which the caller calls only once every file is verified and
	// in dir. m.Process is set as by Boot. On error, no process is left
	// (m's disk and NICs may be).
	StartSpawn(ctx context.Context, m *Machine, dir, at string, files SnapshotFiles) (PendingSpawn, error)
}

// PendingSpawn is a child started by EarlySpawner.StartSpawn.
type PendingSpawn interface {
	// Finish loads the child's state from the snapshot, now verified and
	// in place, and continues it. On error no process is left.
	Finish(ctx context.Context) error
	// Abort ends the child's process.
	Abort()
}

// PulledFrom is what AdoptPulled may let a pulled snapshot's disks sit on.
type PulledFrom struct {
	Image string // the snapshot's image, on this agent
	// ParentDir and ParentFiles are the parent snapshot, already here
	// (ParentDir "" without one).
	ParentDir   string
	ParentFiles SnapshotFiles
}

// SnapshotOptions tunes Snapshotter.Snapshot.
type SnapshotOptions struct {
	// KeepPaused leaves the VM paused after the snapshot.
	KeepPaused bool
	// RecordDisk durably records the disk file the VM is about to write
	// to. An error stops the snapshot before the VM is switched.
	RecordDisk func(disk string) error
	// Volumes are the VM's read-write volumes to freeze in the paused
	// window, after its disk: each moves onto its Next overlay, recorded
	// already (volume_fork.go). The driver lists those it moved in
	// SnapshotFiles.SwitchedVolumes, also when it fails later.
	Volumes []VolumeSwitch
}

// SnapshotFiles names the files of a snapshot in its directory.
type SnapshotFiles struct {
	Memory string // device state, and the RAM when RAM is ""
	// RAM is the guest's RAM image, which children map copy-on-write
	// instead of loading it; RAMDigest is its SparseDigest (NewRAMHash),
	// which the driver computed while writing it ("" lets the agent
	// compute it).
	RAM, RAMDigest string
	Disk           string   // frozen disk that children's overlays sit on; "" without a disk
	Backing        []string // files below Disk in its backing chain, also in the directory
	// FSFrozen: the guest's file systems were frozen through the guest
	// agent while the snapshot was taken, so the saved guest is frozen
	// too and a VM started from it is thawed by the driver.
	FSFrozen bool
	// Vars is a uefi VM's UEFI variable store as it was at the snapshot;
	// each child starts with a copy of its own. "" for a bios VM.
	Vars string
	// SwitchedVolumes are the ids of the SnapshotOptions.Volumes that the
	// driver moved onto their Next overlay (not files of the directory).
	SwitchedVolumes []string
}

// ErrSnapshotConflict is what a driver returns when the VM is in a state in
// which it cannot be snapshotted (a 409 with the message).
func ErrSnapshotConflict(format string, args ...any) error { return errConflict(format, args...) }

// snapshotRecord is the durable metadata of one snapshot,
// <state>/snapshots/<id>/snapshot.json.
type snapshotRecord struct {
	Version   int                     `json:"version"`
	ID        string                  `json:"id"`
	VMID      string                  `json:"vm_id"`
	Image     string                  `json:"image"`
	VCPUs     int64                   `json:"vcpus"`
	MemoryMiB int64                   `json:"memory_mib"`
	DiskMiB   int64                   `json:"disk_mib"`
	Files     []agentapi.SnapshotFile `json:"files"`
	Parent    string                  `json:"parent,omitempty"`
	// Origin is the agent the snapshot was pulled from; empty when taken here.
	Origin string `json:"origin,omitempty"`
	// Unsynced says that the files may not have reached the disk yet
	// (snapshot_sync.go): a background sync clears it, and an agent that
	// starts and finds it set checks every file against its digest.
	Unsynced  bool      `json:"unsynced,omitempty"`
	CreatedAt time.Time `json:"created_at"`
	// NICs are the source's NICs as its guest sees them: a VM started
	// from the snapshot keeps that view inside (Machine.GuestNICs).
	NICs []agentapi.NIC `json:"nics,omitempty"`
	// SeedDisk says the source VM ran with a seed disk (guest.go).
	SeedDisk bool `json:"seed_disk,omitempty"`
	// GuestAgent: the source VM had the guest agent channel; FSFrozen: its
	// file systems were frozen for the snapshot (SnapshotFiles.FSFrozen).
	GuestAgent bool `json:"guest_agent,omitempty"`
	FSFrozen   bool `json:"fs_frozen,omitempty"`
	// Firmware and SecureBoot are the source VM's, which its children
	// boot with ("" from an older agent: bios).
	Firmware   string `json:"firmware,omitempty"`
	SecureBoot bool   `json:"secure_boot,omitempty"`
	// Volumes are the source VM's volumes (volume_fork.go).
	Volumes []snapshotVolume `json:"volumes,omitempty"`
}

// firmware is the snapshot's firmware, bios when it names none.
func (r *snapshotRecord) firmware() string {
	if r.Firmware == "" {
		return agentapi.FirmwareBIOS
	}
	return r.Firmware
}

func (r *snapshotRecord) wire() agentapi.Snapshot {
	s := agentapi.Snapshot{
		ID: r.ID, VMID: r.VMID, Image: r.Image, VCPUs: r.VCPUs, MemoryMiB: r.MemoryMiB, DiskMiB: r.DiskMiB,
		CreatedAt: r.CreatedAt, Files: slices.Clone(r.Files), Parent: r.Parent, NICs: cloneNICs(r.NICs),
		SeedDisk: r.SeedDisk, GuestAgent: r.GuestAgent, FSFrozen: r.FSFrozen, Firmware: r.firmware(), SecureBoot: r.SecureBoot,
		Volumes: wireSnapshotVolumes(r.Volumes),
	}
	h := sha256.New()
	for _, f := range r.Files {
		s.SizeBytes += f.SizeBytes
		_, sum := ramHash(f)
		fmt.Fprintf(h, "%s %s %d %s\n", f.Kind, f.Name, f.SizeBytes, sum)
	}
	s.SHA256 = hex.EncodeToString(h.Sum(nil))
	return s
}

func (r *snapshotRecord) files() SnapshotFiles {
	out := SnapshotFiles{FSFrozen: r.FSFrozen}
	for _, f := range r.Files {
		switch f.Kind {
		case agentapi.SnapshotFileMemory:
			out.Memory = f.Name
		case agentapi.SnapshotFileRAM:
			out.RAM = f.Name
		case agentapi.SnapshotFileDisk:
			out.Disk = f.Name
		case agentapi.SnapshotFileBacking:
			out.Backing = append(out.Backing, f.Name)
		case agentapi.SnapshotFileVars:
			out.Vars = f.Name
		}
	}
	return out
}

var (
	fileNamePattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)
	sha256Pattern   = regexp.MustCompile(`^[0-9a-f]{64}$`) // a sha256 or blake3 digest
)

// validate checks metadata read from disk or sent by another agent: its
// file names become paths here, so they must be plain names.
func (r *snapshotRecord) validate(id string) error {
	switch {
	case r.Version != snapshotVersion:
		return fmt.Errorf("version %d, want %d", r.Version, snapshotVersion)
	case r.ID != id:
		return fmt.Errorf("id %q, want %q", r.ID, id)
	case r.Image == "" || r.VCPUs < 1 || r.MemoryMiB < 1 || r.DiskMiB < 0:
		return errors.New("image or shape missing")
	case r.Parent != "" && checkSnapshotID(r.Parent) != nil:
		return fmt.Errorf("parent %q is not a valid snapshot id", r.Parent)
	}
	seen := map[string]bool{snapshotMetaFile: true}
	kinds := map[string]int{}
	for _, f := range r.Files {
		if !fileNamePattern.MatchString(f.Name) || seen[f.Name] {
			return fmt.Errorf("file name %q is not a plain name or is listed twice", f.Name)
		}
		seen[f.Name] = true
		// One digest a file: a RAM image's blake3 (or the sha256 of one
		// recorded before), any other file's sha256.
		digests := 0
		for _, d := range []string{f.SHA256, f.BLAKE3} {
			if d != "" {
				digests++
				if !sha256Pattern.MatchString(d) {
					return fmt.Errorf("file %s: digest %q is not 64 hex digits", f.Name, d)
				}
			}
		}
		if f.SizeBytes < 0 || digests != 1 || (f.BLAKE3 != "" && f.Kind != agentapi.SnapshotFileRAM) {
			return fmt.Errorf("file %s: bad size or digest (want size_bytes >= 0 and one digest: blake3 for a ram file, or sha256)", f.Name)
		}
		switch f.Kind {
		case agentapi.SnapshotFileMemory, agentapi.SnapshotFileRAM, agentapi.SnapshotFileDisk, agentapi.SnapshotFileBacking,
			agentapi.SnapshotFileVars:
			kinds[f.Kind]++
		default:
			return fmt.Errorf("file %s: unknown kind %q", f.Name, f.Kind)
		}
	}
	switch {
	case kinds[agentapi.SnapshotFileMemory] != 1:
		return errors.New("want exactly one memory file")
	case kinds[agentapi.SnapshotFileRAM] > 1:
		return errors.New("more than one ram file")
	case kinds[agentapi.SnapshotFileDisk] > 1:
		return errors.New("more than one frozen disk")
	case kinds[agentapi.SnapshotFileBacking] > 0 && kinds[agentapi.SnapshotFileDisk] == 0:
		return errors.New("backing files without a frozen disk")
	case kinds[agentapi.SnapshotFileVars] > 1:
		return errors.New("more than one uefi variable store")
	case r.Firmware != "" && r.Firmware != agentapi.FirmwareBIOS && r.Firmware != agentapi.FirmwareUEFI:
		return fmt.Errorf("firmware %q: want bios or uefi", r.Firmware)
	case (kinds[agentapi.SnapshotFileVars] == 1) != (r.Firmware == agentapi.FirmwareUEFI):
		return errors.New("a uefi snapshot has one uefi variable store, a bios one none")
	}
	return validateSnapshotVolumes(r.Volumes)
}

func checkSnapshotID(id string) *Error {
	if !idPattern.MatchString(id) {
		return errInvalid("snapshot id %q is not valid: use 1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit", id)
	}
	return nil
}

func errSnapshotNotFound(id string) *Error {
	return &Error{Status: http.StatusNotFound, Code: CodeNotFound,
		Message: fmt.Sprintf("snapshot %s does not exist on this agent", id), Details: map[string]any{"id": id}}
}

func (a *Agent) snapsDir() string         { return filepath.Join(a.cfg.StateDir, "snapshots") }
func (a *Agent) snapDir(id string) string { return filepath.Join(a.snapsDir(), id) }

func (a *Agent) snapshotter() (Snapshotter, error) {
	sn, ok := a.cfg.Driver.(Snapshotter)
	if !ok {
		return nil, errConflict("the %s driver of this agent cannot take snapshots or start vms from them", a.cfg.Driver.Name())
	}
	return sn, nil
}
