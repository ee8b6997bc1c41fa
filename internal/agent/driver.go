package agent

import (
	"context"
	"errors"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// Driver is the VMM behind an agent: qemu (real guests) or sim (simulated
// VMs for scale tests). The agent owns the registry, the metadata files and
// the locking: a driver is called for one VM at a time per id, and never for
// an id whose operation is still running.
//
// A driver that can snapshot VMs and start VMs from snapshots also
// implements Snapshotter (snapshot.go).
type Driver interface {
	// Name is the driver's name in /v1/info: "qemu" or "sim".
	Name() string
	// Accel is the accelerator the driver uses (kvm, tcg or sim) and why it
	// was chosen.
	Accel() (accel, note string)
	// Images lists the images a VM can be created from, sorted.
	Images() []string
	// Image returns one image; ErrUnknownImage when there is none by that name.
	Image(name string) (Image, error)
	// CheckSpec rejects a shape the driver cannot run (an *Error with
	// CodeInvalid), e.g. too little memory for a kernel.
	CheckSpec(spec agentapi.VMSpec, img Image) error

	// Create makes the VM's files in m.Dir (the disk overlay). It is
	// idempotent: files that already exist are kept.
	Create(ctx context.Context, m *Machine) error
	// Boot starts the VM and sets m.Process. It returns once the VMM
	// answers, not when the guest is up.
	Boot(ctx context.Context, m *Machine, opts BootOptions) error
	// Shutdown asks the guest to power off (ACPI) and waits up to grace,
	// then ends the VMM. The VM's files stay.
	Shutdown(ctx context.Context, m *Machine, grace time.Duration) error
	// Kill ends the VMM at once (delete), also a process that m.Process
	// does not name (found e.g. by its command line), so that a VM whose
	// metadata is corrupt or behind still ends. No process is not an error.
	Kill(ctx context.Context, m *Machine) error
	// Pause and Resume stop and continue the vCPUs.
	Pause(ctx context.Context, m *Machine) error
	Resume(ctx context.Context, m *Machine) error
	// Observe reports the VM's state as it is now. last is the state the
	// agent last recorded (after a restart: the one in the metadata), so that
	// a vanished process is reported with a useful reason.
	Observe(ctx context.Context, m *Machine, last string) Observed
	// Console returns at most max bytes of the end of the serial console log.
	Console(m *Machine, max int64) ([]byte, error)
}

// Machine is one VM as a driver sees it.
type Machine struct {
	ID        string
	Dir       string // the VM's own directory; the driver keeps its files here
	Image     string
	VCPUs     int64
	MemoryMiB int64
	DiskMiB   int64
	// Disk is the file in Dir the VM writes its disk to; empty means the
	// driver's first disk file. A snapshot moves the VM onto a new overlay.
	Disk string
	// Process is the driver's durable handle of the running VM. The agent
	// saves it in the VM's metadata, so that a new agent re-adopts the VM.
	Process Process
	// NICs are the VM's network interfaces (see NetworkDriver). Boot and
	// Spawn fill the host ports of port forwards; the agent saves them.
	NICs []agentapi.NIC
	// GuestNICs are the NICs as the guest sees them when they differ from
	// NICs: a VM started from a snapshot keeps its source's MACs and
	// addresses inside, and is reached at its own NICs' from outside.
	GuestNICs []agentapi.NIC
	// Seed is the VM's NoCloud seed ISO, a file in Dir (SeedFileName), or
	// "" for none. A driver attaches it read-only as a disk after the VM's
	// own, at every boot and restore: a VM started from a snapshot of a VM
	// with a seed has one too, so its devices match.
	Seed string
	// GuestAgent: the VM has the QEMU guest agent channel (a driver that
	// implements GuestAgentDriver talks to the guest through it).
	GuestAgent bool
	// Volumes are the volumes attached to the VM (Volumer): a driver
	// attaches them at every boot, after the seed, with their serials.
	Volumes []MachineVolume
	// Firmware boots the VM: agentapi.FirmwareBIOS or FirmwareUEFI, ""
	// for the image's. A uefi VM keeps its own UEFI variable store in Dir
	// (VarsFileName). SecureBoot enforces Secure Boot (uefi only).
	Firmware   string
	SecureBoot bool
}

// VarsFileName is a uefi VM's UEFI variable store in its directory: a
// copy of the firmware's template made at its first boot, which moves
// with the VM (a warm VM handed over, a snapshot's children).
const VarsFileName = "efivars.fd"

// Process identifies a VMM process. StartTime (field 22 of /proc/<pid>/stat)
// tells a reused pid from the VM's own process.
type Process struct {
	PID       int    `json:"pid,omitempty"`
	StartTime uint64 `json:"start_time,omitempty"`
	// LaunchDir is the directory the process was started in when the VM's
	// files moved since (a warm pool VM handed to a new id, pool.go): its
	// command line names that directory, not Machine.Dir.
	LaunchDir string `json:"launch_dir,omitempty"`
}

// BootOptions changes how a VM boots.
type BootOptions struct {
	// Paused boots the VM with its vCPUs stopped.
	Paused bool
	// Incoming is a memory state file (see Snapshotter) to start the VM
	// from instead of booting it; the VM is then paused until resumed.
	Incoming string
	// Nice, when above 0, is the nice value the VMM starts at instead of
	// the driver's for user VMs: the warm pool boots below them.
	Nice int
}

// Observed is a VM's state as a driver sees it.
type Observed struct {
	State  string // one of agentapi.StateRunning, StatePaused, StateStopped, StateError
	Reason string // why, when the VM is stopped or in error unexpectedly
	// Process, when set, is the VM's process as found now; it replaces the
	// recorded one (e.g. an agent that crashed between starting QEMU and
	// writing its pid: the next agent finds the process and adopts it).
	Process Process
}

// Image is one image a VM boots from.
type Image struct {
	Name string
	Kind string // ImageKernel or ImageDisk
	// BaseDiskMiB is the size of the image's disk (0 when it has none): a
	// VM's disk cannot be smaller.
	BaseDiskMiB int64
	// Firmware is what the image boots with unless a VM says otherwise
	// (agentapi.FirmwareBIOS or FirmwareUEFI).
	Firmware string
}

// Image kinds.
const (
	ImageKernel = "kernel" // direct kernel + initrd boot
	ImageDisk   = "disk"   // a bootable qcow2 disk, firmware boot
)

// ErrUnknownImage is returned by Driver.Image for a name it does not have.
var ErrUnknownImage = errors.New("unknown image")
