// Package agentapi holds the wire types of the host agent API (v1) and its
// typed client. The control plane talks to agents only through this package.
package agentapi

import "time"

// VM states on an agent.
const (
	StateCreating = "creating"
	StateRunning  = "running"
	StatePaused   = "paused"
	StateStopped  = "stopped"
	StateError    = "error"
)

// How a VM was started.
const (
	StartedCold     = "cold"
	StartedWarm     = "warm"
	StartedSnapshot = "snapshot"
)

// Power actions of POST /v1/vms/{id}/{action}.
const (
	ActionStart  = "start"
	ActionStop   = "stop"
	ActionPause  = "pause"
	ActionResume = "resume"
)

// CodeVersionSkew is the error code of a call that an agent refuses because
// the caller's kvmd is outside its skew contract (internal/version): the
// message names both versions.
const CodeVersionSkew = "version_skew"

// Resources is an amount of capacity (MiB, whole vCPUs).
type Resources struct {
	VCPUs     int64 `json:"vcpus"`
	MemoryMiB int64 `json:"memory_mib"`
	DiskMiB   int64 `json:"disk_mib"`
}

// Info is the answer of GET /v1/info.
type Info struct {
	// Release and APILevel are the agent's kvmd (internal/version); an
	// agent of a release before them sends neither (level 1).
	Release   string    `json:"release,omitempty"`
	APILevel  int       `json:"api_level,omitempty"`
	Hostname  string    `json:"hostname"`
	Capacity  Resources `json:"capacity"`
	Allocated Resources `json:"allocated"`
	// Warm is what the warm pool holds (ready and booting warm VMs). Free
	// is capacity less allocated and warm; a create that needs the warm
	// VMs' share evicts them (they are never counted twice).
	Warm Resources `json:"warm"`
	Free Resources `json:"free"`
	// Isolation says how each VM is held to its shape: "cgroup v2 ..." or
	// "none: <why>" (the agent not root, no cgroup2 controllers, the sim
	// driver).
	Isolation  string       `json:"isolation,omitempty"`
	Accel      string       `json:"accel"`
	Driver     string       `json:"driver"`
	Images     []string     `json:"images"`
	VMCount    int          `json:"vm_count"`
	Pool       []PoolStatus `json:"pool"`
	AccelNote  string       `json:"accel_note,omitempty"`
	AgentStart time.Time    `json:"agent_start"`
	// ImageCache is the agent's content-addressed image cache: every image
	// it holds, fetches or failed to fetch (image.go).
	ImageCache []ImageStatus `json:"image_cache,omitempty"`
	// UnderlayAddress is the IPv4 address this agent's VXLAN tunnels of
	// overlay networks start from (--underlay-address; "" without one),
	// UnderlayMTU the MTU of the interface that holds it.
	UnderlayAddress string `json:"underlay_address,omitempty"`
	UnderlayMTU     int    `json:"underlay_mtu,omitempty"`
}

// SnapshotSource tells an agent where to find the snapshot a VM starts from.
// Address is empty when the snapshot is local; otherwise the agent pulls it
// from that agent (same agent token) before it starts the VM. PublicKey is
// then that agent's identity key as the control plane pinned it
// (EncodeKey): the pulling agent challenges the address and sends its
// token there only when the key signs.
type SnapshotSource struct {
	ID        string `json:"id"`
	Address   string `json:"address,omitempty"`
	PublicKey string `json:"public_key,omitempty"`
}

// VMSpec is the body of PUT /v1/vms/{id}: create a VM with that id. A second
// PUT with the same id returns the existing VM and starts nothing.
type VMSpec struct {
	Image     string          `json:"image"`
	VCPUs     int64           `json:"vcpus"`
	MemoryMiB int64           `json:"memory_mib"`
	DiskMiB   int64           `json:"disk_mib"`
	Stopped   bool            `json:"stopped,omitempty"`
	Snapshot  *SnapshotSource `json:"snapshot,omitempty"`
	// NoWarm asks for a cold boot even when a warm VM matches.
	NoWarm bool `json:"no_warm,omitempty"`
	// HostCapacity is the host's capacity as the control plane places by it
	// (total less reserved memory): the agent keeps its VMs and warm VMs
	// within it (and within its own), evicting warm VMs for this VM. It
	// is not part of the VM's shape.
	HostCapacity *Resources `json:"host_capacity,omitempty"`
	// NICs are the VM's network interfaces in order (none: no NIC).
	NICs []NIC `json:"nics,omitempty"`
	// ImageSource, when set, is a registered image: the agent fetches it
	// into its cache (from a peer, else the source) before it boots the VM,
	// and Image is only its name.
	ImageSource *ImageSource `json:"image_source,omitempty"`
	// Seed, when set, is the VM's NoCloud seed: the agent builds seed.iso in
	// the VM's directory and attaches it read-only as a virtio disk after
	// the VM's own disk. Nil: no seed disk.
	Seed *SeedSpec `json:"seed,omitempty"`
	// Volumes are attached before the guest boots, as virtio-blk disks
	// after the seed with serial VolumeSerial(id), in order.
	Volumes []VolumeAttachment `json:"volumes,omitempty"`
	// GuestAgent adds the QEMU guest agent channel (a virtio-serial port
	// named org.qemu.guest_agent.0): when the guest runs qemu-guest-agent,
	// the agent reads the guest's addresses through it, stops the guest
	// through it and freezes its file systems around a snapshot. Part of
	// the VM's shape: a warm VM (booted without it) never serves it.
	GuestAgent bool `json:"guest_agent,omitempty"`
	// Firmware boots the VM's disk: FirmwareBIOS or FirmwareUEFI; ""
	// takes the image's (its image.json; bios when it says none). The
	// control plane sets it from a registered image. A VM started from a
	// snapshot has its source's firmware.
	Firmware string `json:"firmware,omitempty"`
	// SecureBoot boots a uefi VM with Secure Boot enforced, with the
	// Microsoft keys enrolled (OVMF's .ms variables).
	SecureBoot bool `json:"secure_boot,omitempty"`
}

// Firmware of a VM (VMSpec.Firmware).
const (
	FirmwareBIOS = "bios"
	FirmwareUEFI = "uefi"
)

// SeedSpec is what goes into a VM's NoCloud seed (internal/agent/seed).
type SeedSpec struct {
	// InstanceID is the VM id (a fork child: the child's id).
	InstanceID        string            `json:"instance_id"`
	Hostname          string            `json:"hostname"`
	UserData          string            `json:"user_data,omitempty"`
	SSHAuthorizedKeys []string          `json:"ssh_authorized_keys,omitempty"`
	MetaData          map[string]string `json:"meta_data,omitempty"`
	// NetworkConfig is used as given; "" generates it from the VM's NICs.
	NetworkConfig string `json:"network_config,omitempty"`
}

// Cloud-init states of GuestStatus.
const (
	CloudInitNone    = "none"
	CloudInitRunning = "running"
	CloudInitDone    = "done"
	CloudInitError   = "error"
)

// GuestStatus is the answer of GET /v1/vms/{id}/guest: what the guest
// reported on its serial console during its current boot.
type GuestStatus struct {
	CloudInit string `json:"cloud_init"`
	// CloudInitErrors are the console lines that made CloudInit error (the
	// first few, shortened), so that an error can say what failed.
	CloudInitErrors []string `json:"cloud_init_errors,omitempty"`
	IPv4Addresses   []string `json:"ipv4_addresses"`
	Hostname        string   `json:"hostname,omitempty"`
	UserDataSHA256  string   `json:"user_data_sha256,omitempty"`
	// GuestAgent is the QEMU guest agent's state: none (the VM has no
	// channel), waiting (it does not answer, yet) or ready (it answered;
	// IPv4Addresses then holds what it reports too).
	GuestAgent string `json:"guest_agent"`
}

// States of GuestStatus.GuestAgent.
const (
	GuestAgentNone    = "none"
	GuestAgentWaiting = "waiting"
	GuestAgentReady   = "ready"
)

// Network modes of a NIC (the control API's network modes).
const (
	NetworkUser   = "user"
	NetworkNAT    = "nat"
	NetworkBridge = "bridge"
	// NetworkOverlay is one L2 segment across hosts: a per-host bridge
	// with a VXLAN port (overlay.go), IPAM and egress NAT as nat.
	NetworkOverlay = "overlay"
)

// NIC is one network interface of a VM: what the control plane decided
// (MAC, address from its IPAM, the network's shape) and, in answers, what
// the agent chose (host ports of forwards).
type NIC struct {
	Network    string `json:"network"`
	Mode       string `json:"mode"`
	MACAddress string `json:"mac_address"`
	// CIDR and Gateway describe the network (nat; bridge when it has a CIDR).
	CIDR    string `json:"cidr,omitempty"`
	Gateway string `json:"gateway,omitempty"`
	// DHCP asks the agent to serve IPv4Address to MACAddress by DHCP.
	DHCP bool `json:"dhcp,omitempty"`
	// Bridge is the operator's bridge (bridge mode).
	Bridge string `json:"bridge,omitempty"`
	// IPv4Address is the address the VM has on this network ("" when the
	// control plane does not assign one).
	IPv4Address  string        `json:"ipv4_address,omitempty"`
	PortForwards []PortForward `json:"port_forwards,omitempty"`
	// IPv4Addresses, in answers only, are the addresses the guest reports
	// on this NIC (matched by MAC) through the QEMU guest agent, for a VM
	// with guest_agent whose guest agent answers; empty otherwise.
	IPv4Addresses []string `json:"ipv4_addresses,omitempty"`
	// Allow is what the guests of a nat network may reach beyond their
	// own network and the outside: names of other nat networks and IPv4
	// CIDRs (private ranges included). Everything else of the host's
	// networks is fenced off.
	Allow []string `json:"allow,omitempty"`
	// VNI is the overlay network's VXLAN network identifier (overlay).
	VNI int `json:"vni,omitempty"`
	// MTU is the network's MTU on the bridge, the taps and in the guest
	// (DHCP option 26, network-config); 0: the mode's default (1450 for
	// overlay, the link's for the others).
	MTU int `json:"mtu,omitempty"`
}

// PortForward maps 127.0.0.1:HostPort (chosen by the agent) to GuestPort.
type PortForward struct {
	GuestPort   int    `json:"guest_port"`
	HostAddress string `json:"host_address,omitempty"`
	HostPort    int    `json:"host_port,omitempty"`
}

// VMShape is the body of PUT /v1/vms/{id}/shape: the VM's new vCPUs and
// memory. The agent applies it with a cold restart on the VM's own disk (a
// running VM is stopped and booted again, a paused one comes back paused, a
// stopped one takes the shape at its next start). The same shape again
// changes nothing.
type VMShape struct {
	VCPUs     int64 `json:"vcpus"`
	MemoryMiB int64 `json:"memory_mib"`
}

// VM is one VM on an agent.
type VM struct {
	ID          string    `json:"id"`
	Image       string    `json:"image"`
	VCPUs       int64     `json:"vcpus"`
	MemoryMiB   int64     `json:"memory_mib"`
	DiskMiB     int64     `json:"disk_mib"`
	State       string    `json:"state"`
	Reason      string    `json:"reason,omitempty"`
	StartedFrom string    `json:"started_from"`
	PID         int       `json:"pid,omitempty"`
	NICs        []NIC     `json:"nics,omitempty"`
	CreatedAt   time.Time `json:"created_at"`
	// GuestAgent says the VM has the QEMU guest agent channel.
	GuestAgent bool `json:"guest_agent,omitempty"`
	// Volumes are the volumes attached to the VM.
	Volumes []VolumeAttachment `json:"volumes,omitempty"`
	// Firmware is what the VM boots with (bios or uefi); SecureBoot says
	// that Secure Boot is on.
	Firmware   string `json:"firmware,omitempty"`
	SecureBoot bool   `json:"secure_boot,omitempty"`
}

// VMList is the answer of GET /v1/vms: every VM on the agent.
type VMList struct {
	Items []VM `json:"items"`
}

// SnapshotSpec is the body of PUT /v1/snapshots/{id}.
type SnapshotSpec struct {
	VMID        string `json:"vm_id"`
	PauseSource bool   `json:"pause_source"`
}

// Snapshot is a memory + disk snapshot of one VM at one point in time.
// SizeBytes is the sum of its files' sizes; SHA256 is the digest of its file
// list (one "kind name size sha256" line per file, in order).
type Snapshot struct {
	ID        string    `json:"id"`
	VMID      string    `json:"vm_id"`
	Image     string    `json:"image"`
	VCPUs     int64     `json:"vcpus"`
	MemoryMiB int64     `json:"memory_mib"`
	DiskMiB   int64     `json:"disk_mib"`
	SizeBytes int64     `json:"size_bytes"`
	SHA256    string    `json:"sha256"`
	CreatedAt time.Time `json:"created_at"`
	// Files are the files GET /v1/snapshots/{id}/files/{name} serves.
	Files []SnapshotFile `json:"files"`
	// Parent is the snapshot the source VM was itself started from: the
	// frozen disk sits on that snapshot's disk, so an agent needs both.
	Parent string `json:"parent,omitempty"`
	// NICs are the source VM's NICs as its guest sees them (MACs,
	// addresses): a VM started from the snapshot keeps that view inside
	// and needs a NIC on the same network for each.
	NICs []NIC `json:"nics,omitempty"`
	// SeedDisk says the source VM ran with a seed disk (a NoCloud
	// seed.iso): a VM started from the snapshot must have one too, at the
	// same place, for its devices to match the saved state.
	SeedDisk bool `json:"seed_disk,omitempty"`
	// GuestAgent says the source VM had the guest agent channel: a VM
	// started from the snapshot has it too (its devices must match).
	// FSFrozen says the guest's file systems were frozen through it for
	// the snapshot: the disk is consistent on its own, and a VM started
	// from it thaws them first thing.
	GuestAgent bool `json:"guest_agent,omitempty"`
	FSFrozen   bool `json:"fs_frozen,omitempty"`
	// Firmware and SecureBoot are the source VM's: a VM started from the
	// snapshot boots with the same (its devices must match the saved
	// state), with its own copy of the snapshot's UEFI variables.
	Firmware   string `json:"firmware,omitempty"`
	SecureBoot bool   `json:"secure_boot,omitempty"`
	// Volumes are the volumes the VM had attached, in its order: a VM
	// started from the snapshot attaches one for each, in the same slot
	// (a clone of the frozen point of a read-write one, the same volume
	// read-only for a read-only one).
	Volumes []SnapshotVolume `json:"volumes,omitempty"`
}

// Kinds of snapshot files.
const (
	SnapshotFileMemory = "memory" // the device state, and the RAM when no ram file holds it (a QEMU migration stream)
	// SnapshotFileRAM is the guest's RAM image, which children map
	// copy-on-write. Its size_bytes is the image's size; it is sent, and
	// its digest taken, in the sparse form of the agent package
	// (sparse.go): blake3, or sha256 for an image recorded before.
	SnapshotFileRAM     = "ram"
	SnapshotFileDisk    = "disk"    // the frozen disk a child's overlay sits on
	SnapshotFileBacking = "backing" // a file below the frozen disk in its backing chain
	// SnapshotFileVars is a uefi VM's UEFI variable store at the snapshot:
	// each child starts with a copy of its own.
	SnapshotFileVars = "vars"
)

// SnapshotFile is one file of a snapshot, with its digest: SHA256 (hex),
// or for a RAM image BLAKE3 (hex, 32 bytes) of its sparse form.
type SnapshotFile struct {
	Name      string `json:"name"`
	Kind      string `json:"kind"`
	SizeBytes int64  `json:"size_bytes"`
	SHA256    string `json:"sha256,omitempty"`
	BLAKE3    string `json:"blake3,omitempty"`
}

// PoolShape is one warm pool shape and its target size.
type PoolShape struct {
	VCPUs     int64 `json:"vcpus"`
	MemoryMiB int64 `json:"memory_mib"`
	DiskMiB   int64 `json:"disk_mib"`
	Size      int   `json:"size"`
}

// PoolPut is the body of PUT /v1/pool/{image}: the shapes to keep warm for
// that image (an empty list empties the pool of that image).
type PoolPut struct {
	Shapes []PoolShape `json:"shapes"`
}

// PoolStatus is the warm pool of one image and shape.
type PoolStatus struct {
	Image     string `json:"image"`
	VCPUs     int64  `json:"vcpus"`
	MemoryMiB int64  `json:"memory_mib"`
	DiskMiB   int64  `json:"disk_mib"`
	Size      int    `json:"size"`
	Ready     int    `json:"ready"`
	Booting   int    `json:"booting"`
}

// PoolList is the answer of GET /v1/pool.
type PoolList struct {
	Items []PoolStatus `json:"items"`
}

// ErrorBody is the error envelope, the same shape as the control API's.
type ErrorBody struct {
	Error ErrorDetail `json:"error"`
}

// ErrorDetail is the content of the envelope.
type ErrorDetail struct {
	Code    string         `json:"code"`
	Message string         `json:"message"`
	Details map[string]any `json:"details,omitempty"`
}

// Image formats of a registered image.
const (
	ImageFormatQCOW2  = "qcow2"
	ImageFormatRaw    = "raw"
	ImageFormatKernel = "kernel" // a tar of an image folder: image.json and the files it names
)

// Image cache states.
const (
	ImageReady    = "ready"
	ImageFetching = "fetching"
	ImageFailed   = "failed"
)

// ImageSource says where an agent gets a registered image and how it checks
// it: the body of PUT /v1/images/{sha256} (prefetch) and VMSpec.ImageSource.
type ImageSource struct {
	Name      string `json:"name"`
	SHA256    string `json:"sha256"`
	SourceURL string `json:"source_url"`
	Format    string `json:"format"`
	// Peers are agents that hold the image ready: the agent asks them, in
	// order, before the source URL, each only after it proved the identity
	// key the control plane pinned for it (as for a snapshot pull).
	Peers []ImagePeer `json:"peers,omitempty"`
}

// ImagePeer is an agent an image can be pulled from: its address
// (http(s)://host:port) and its identity key as the control plane pinned
// it (EncodeKey). The pulling agent sends its token only to an agent that
// signs a challenge with that key.
type ImagePeer struct {
	Address   string `json:"address"`
	PublicKey string `json:"public_key"`
}

// ImageStatus is one image of an agent's cache.
type ImageStatus struct {
	SHA256         string `json:"sha256"`
	Name           string `json:"name,omitempty"`
	Format         string `json:"format"`
	Status         string `json:"status"`
	Reason         string `json:"reason,omitempty"`
	SizeBytes      int64  `json:"size_bytes"`
	VirtualSizeMiB int64  `json:"virtual_size_mib"`
	// From is where the ready copy came from: "peer <address>" or the URL.
	From string `json:"from,omitempty"`
}

// ImageList is the answer of GET /v1/images.
type ImageList struct {
	Items []ImageStatus `json:"items"`
}

// VMDisk is the body of PUT /v1/vms/{id}/disk: the VM's new disk size. The
// disk grows in place (qemu-img resize when the VM is stopped, QMP
// block_resize while it runs); a smaller size is refused; the same size
// again changes nothing.
type VMDisk struct {
	DiskMiB int64 `json:"disk_mib"`
}
