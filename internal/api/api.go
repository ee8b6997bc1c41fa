// Package api holds the wire types of the control API (v1). JSON names are
// snake_case and match the Terraform attribute names of the provider.
package api

import "time"

// Power states a VM can be asked for.
const (
	PowerRunning = "running"
	PowerStopped = "stopped"
)

// Observed states of a VM, as the control API last saw it.
const (
	StateCreating = "creating"
	StateRunning  = "running"
	StatePaused   = "paused"
	StateStopped  = "stopped"
	StateError    = "error"
	StateMissing  = "missing"
	StateUnknown  = "unknown"
	// StateLost: the VM's host was retired (its agent is gone for good).
	StateLost = "lost"
)

// Gone says whether a VM in this observed state runs nowhere and holds no
// capacity: missing (its agent lost it) or lost (its host was retired).
// Such a VM is only deleted, and made again.
func Gone(state string) bool { return state == StateMissing || state == StateLost }

// How a VM was started.
const (
	StartedCold     = "cold"
	StartedWarm     = "warm"
	StartedSnapshot = "snapshot"
)

// Fork placement strategies.
const (
	PlacementColocate = "colocate"
	PlacementSpread   = "spread"
)

// Fork phases.
const (
	ForkPending      = "pending"
	ForkSnapshotting = "snapshotting"
	ForkSpawning     = "spawning"
	ForkReady        = "ready"
	// ForkRetrying: the last pass failed (Error says why) and the control
	// plane runs it again at RetryAt, up to MaxForkAttempts passes in all.
	ForkRetrying = "retrying"
	// ForkFailed is terminal: MaxForkAttempts passes failed in a row. Only
	// a request (a retried POST, a PATCH) runs the fork again; DELETE
	// removes it.
	ForkFailed = "failed"
)

// MaxForkAttempts is how many passes of a fork may fail in a row before it
// is failed for good (a request's pass and the control plane's retries).
const MaxForkAttempts = 3

// Resources is an amount of capacity. Memory and disk are in MiB, CPUs in whole vCPUs.
type Resources struct {
	VCPUs     int64 `json:"vcpus"`
	MemoryMiB int64 `json:"memory_mib"`
	DiskMiB   int64 `json:"disk_mib"`
}

// WarmPoolTarget is one warm pool shape on a host: the target size and, in
// responses, how many warm VMs are ready.
type WarmPoolTarget struct {
	Image     string `json:"image"`
	VCPUs     int64  `json:"vcpus"`
	MemoryMiB int64  `json:"memory_mib"`
	DiskMiB   int64  `json:"disk_mib"`
	Size      int    `json:"size"`
	Ready     int    `json:"ready"`
}

// HostPut is the body of PUT /v1/hosts/{name}. Nil fields take their defaults.
type HostPut struct {
	Address            string            `json:"address"`
	Labels             map[string]string `json:"labels,omitempty"`
	Schedulable        *bool             `json:"schedulable,omitempty"`
	CPUAllocationRatio *float64          `json:"cpu_allocation_ratio,omitempty"`
	MemoryReservedMiB  *int64            `json:"memory_reserved_mib,omitempty"`
	WarmPool           []WarmPoolTarget  `json:"warm_pool,omitempty"`
	// UnderlayAddress is the host's IPv4 address that overlay networks'
	// VXLAN tunnels run between; its agent must prove it (it is started
	// with --underlay-address). Empty: the host takes no overlay NIC.
	UnderlayAddress string `json:"underlay_address,omitempty"`
}

// Host is a registered host agent with its capacity.
type Host struct {
	Name               string            `json:"name"`
	Address            string            `json:"address"`
	Labels             map[string]string `json:"labels"`
	Schedulable        bool              `json:"schedulable"`
	Alive              bool              `json:"alive"`
	LastSeen           *time.Time        `json:"last_seen,omitempty"`
	Accel              string            `json:"accel"`
	Driver             string            `json:"driver"`
	Images             []string          `json:"images"`
	CPUAllocationRatio float64           `json:"cpu_allocation_ratio"`
	MemoryReservedMiB  int64             `json:"memory_reserved_mib"`
	Capacity           Resources         `json:"capacity"`
	Allocated          Resources         `json:"allocated"`
	// Warm is what the host's warm pool holds (ready and booting warm
	// VMs). Free is capacity less allocated and warm; a create may also
	// use the warm share, the host's agent evicts warm VMs to make room.
	Warm     Resources        `json:"warm"`
	Free     Resources        `json:"free"`
	WarmPool []WarmPoolTarget `json:"warm_pool"`
	// Isolation is how the host's agent holds each VM to its shape:
	// "cgroup v2 ..." or "none: <why>".
	Isolation string `json:"isolation,omitempty"`
	// RetiredAt is set once the host is retired (POST /v1/hosts/{name}/retire).
	RetiredAt *time.Time `json:"retired_at,omitempty"`
	// Drain is the host's drain (state "" while it is in service).
	Drain HostDrain `json:"drain"`
	// UnderlayAddress is the address its overlay tunnels run from ("" for none).
	UnderlayAddress string `json:"underlay_address"`
	// AgentRelease and AgentAPILevel are the host agent's kvmd as it last
	// reported (level 0: an agent of a release before levels, or not yet
	// seen). AgentRefused, when set, is why the control plane does not use
	// the agent: its level is outside the skew contract (the host is not
	// alive until the agent is upgraded).
	AgentRelease  string `json:"agent_release,omitempty"`
	AgentAPILevel int    `json:"agent_api_level,omitempty"`
	AgentRefused  string `json:"agent_refused,omitempty"`
}

// Info is the answer of GET /v1/info: the control API's kvmd and the
// agent API levels it serves (internal/version's skew contract).
type Info struct {
	Release     string `json:"release"`
	APILevel    int    `json:"api_level"`
	MinAPILevel int    `json:"min_api_level"`
	MaxAPILevel int    `json:"max_api_level"`
}

// VMCreate is the body of POST /v1/vms.
type VMCreate struct {
	Name string `json:"name"`
	// Project is the project the VM belongs to. Empty: the token's project
	// (a fleet-wide token: "default"). A project token may name only its own.
	Project    string            `json:"project,omitempty"`
	Image      string            `json:"image"`
	VCPUs      int64             `json:"vcpus"`
	MemoryMiB  int64             `json:"memory_mib"`
	DiskMiB    int64             `json:"disk_mib"`
	Host       string            `json:"host,omitempty"`
	PowerState string            `json:"power_state,omitempty"`
	Labels     map[string]string `json:"labels,omitempty"`
	// NetworkInterfaces are the VM's NICs in order; omitted, the VM gets
	// one NIC on the network named "default".
	NetworkInterfaces []NetworkInterface `json:"network_interfaces,omitempty"`
	// Constraints steer placement; nil places by score alone.
	Constraints *Constraints `json:"constraints,omitempty"`
	// Guest configuration (cloud-init NoCloud seed). Any of these makes the
	// VM boot cold with a seed disk of its own. It is immutable: a PATCH
	// never changes it.
	//
	// UserData is raw cloud-init user data, at most MaxUserDataBytes.
	UserData string `json:"user_data,omitempty"`
	// SSHAuthorizedKeys are OpenSSH authorized keys (at most
	// MaxSSHAuthorizedKeys), each one key.
	SSHAuthorizedKeys []string `json:"ssh_authorized_keys,omitempty"`
	// MetaData are extra NoCloud meta-data keys; local-hostname sets the
	// guest's hostname. instance-id and public-keys are reserved.
	MetaData map[string]string `json:"meta_data,omitempty"`
	// NetworkConfig is cloud-init network-config (v1 or v2, YAML or JSON),
	// at most MaxNetworkConfigBytes; empty: generated from the VM's NICs.
	NetworkConfig string `json:"network_config,omitempty"`
	// Volumes are attached before the VM boots; the VM is placed on
	// their host (volumes.go).
	Volumes []VMVolume `json:"volumes,omitempty"`
	// GuestAgent adds the QEMU guest agent channel (virtio-serial port
	// org.qemu.guest_agent.0). When the guest runs qemu-guest-agent, the
	// VM's answer carries the addresses it reports on each NIC, a stop
	// asks it to power the guest off, and a fork's snapshot freezes the
	// guest's file systems. Like the guest configuration it is fixed at
	// create (the VM boots cold; a fork's children inherit it).
	GuestAgent bool `json:"guest_agent,omitempty"`
	// SecureBoot boots the VM with Secure Boot on, the Microsoft keys
	// enrolled: its image must boot with firmware uefi (and a signed
	// bootloader, e.g. shim). Immutable.
	SecureBoot bool `json:"secure_boot,omitempty"`
}

// Limits of a VM's guest configuration.
const (
	MaxUserDataBytes      = 64 << 10
	MaxNetworkConfigBytes = 64 << 10
	MaxSSHAuthorizedKeys  = 32
	// MaxMetaDataKeys bounds meta_data; each key is at most 255 bytes and
	// each value at most MaxMetaDataValueBytes.
	MaxMetaDataKeys       = 64
	MaxMetaDataValueBytes = 4096
)

// Meta-data keys the product sets itself.
const (
	MetaInstanceID    = "instance-id"
	MetaPublicKeys    = "public-keys"
	MetaLocalHostname = "local-hostname"
)

// VMPatch is the body of PATCH /v1/vms/{id}. Only the fields that are set change.
// A new vcpus or memory_mib restarts a running guest on its own disk (the
// growth is reserved on its host first; no room is 409 no_capacity); a new
// name changes only the control plane's record.
type VMPatch struct {
	PowerState *string            `json:"power_state,omitempty"`
	Labels     *map[string]string `json:"labels,omitempty"`
	Name       *string            `json:"name,omitempty"`
	VCPUs      *int64             `json:"vcpus,omitempty"`
	MemoryMiB  *int64             `json:"memory_mib,omitempty"`
	// DiskMiB grows the VM's disk in place (never shrinks it); the growth
	// is reserved on its host first (no room is 409 no_capacity).
	DiskMiB *int64 `json:"disk_mib,omitempty"`
	// Constraints replaces the stored constraints; the VM does not move.
	// An empty object clears them.
	Constraints *Constraints `json:"constraints,omitempty"`
}

// VMShape is a VM's vCPUs and memory.
type VMShape struct {
	VCPUs     int64 `json:"vcpus"`
	MemoryMiB int64 `json:"memory_mib"`
}

// VM is a virtual machine: what was asked for and what was last observed.
type VM struct {
	ID            string `json:"id"`
	Name          string `json:"name"`
	Project       string `json:"project"`
	Image         string `json:"image"`
	VCPUs         int64  `json:"vcpus"`
	MemoryMiB     int64  `json:"memory_mib"`
	DiskMiB       int64  `json:"disk_mib"`
	Host          string `json:"host"`
	PowerState    string `json:"power_state"`
	ObservedState string `json:"observed_state"`
	Reason        string `json:"reason,omitempty"`
	StartedFrom   string `json:"started_from,omitempty"`
	ForkID        string `json:"fork_id,omitempty"`
	// PendingResize is the shape a resize is applying and has not settled
	// (its host's allocation holds the larger of the two meanwhile).
	PendingResize *VMShape `json:"pending_resize,omitempty"`
	// Migration is the VM's migration while it runs (nil otherwise).
	Migration *VMMigration      `json:"migration,omitempty"`
	Placement *Placement        `json:"placement,omitempty"`
	Labels    map[string]string `json:"labels"`
	// NetworkInterfaces are the VM's NICs with their MAC, address and
	// forwarded ports filled in.
	NetworkInterfaces []NetworkInterface `json:"network_interfaces"`
	// IPv4Address is the first NIC's address ("" while unknown).
	IPv4Address string       `json:"ipv4_address"`
	Constraints *Constraints `json:"constraints,omitempty"`
	// ConstraintsViolated says, when not empty, how the VM's host no
	// longer meets its constraints (its labels changed after placement).
	// The VM is never moved for it.
	ConstraintsViolated string `json:"constraints_violated,omitempty"`
	// UserDataSHA256 is the hex SHA-256 of the VM's user data ("" for
	// none); the user data itself is never returned.
	UserDataSHA256    string            `json:"user_data_sha256"`
	SSHAuthorizedKeys []string          `json:"ssh_authorized_keys"`
	MetaData          map[string]string `json:"meta_data"`
	// NetworkConfig is the user-given network-config ("" when generated).
	NetworkConfig string `json:"network_config"`
	// Hostname is the guest's effective local-hostname ("" for a VM
	// without guest configuration).
	Hostname string `json:"hostname"`
	// Volumes are the VM's volumes, in the order it was created with.
	Volumes []VMVolume `json:"volumes"`
	// GuestAgent says the VM has the QEMU guest agent channel.
	GuestAgent bool      `json:"guest_agent"`
	SecureBoot bool      `json:"secure_boot"`
	CreatedAt  time.Time `json:"created_at"`
}

// Cloud-init states of GuestStatus.
const (
	CloudInitNone    = "none"
	CloudInitRunning = "running"
	CloudInitDone    = "done"
	CloudInitError   = "error"
)

// GuestStatus is what a VM's guest reported on its serial console during
// its current boot: the answer of GET /v1/vms/{id}/guest.
type GuestStatus struct {
	// CloudInit is none (no seed, or nothing seen yet), running, done or
	// error.
	CloudInit string `json:"cloud_init"`
	// CloudInitErrors are the console lines that made CloudInit error (the
	// first few): a module that failed, a missing datasource, a failed stage.
	CloudInitErrors []string `json:"cloud_init_errors,omitempty"`
	// IPv4Addresses are the addresses the guest reported (no prefix, no
	// loopback).
	IPv4Addresses []string `json:"ipv4_addresses"`
	// Hostname is what the guest reported: getty's login prompt on the
	// serial console, the busybox guest's line, or the comment of the SSH
	// host keys cloud-init printed. UserDataSHA256 is the digest of the user
	// data the busybox guest read (cloud-init does not print it).
	Hostname       string `json:"hostname,omitempty"`
	UserDataSHA256 string `json:"user_data_sha256,omitempty"`
	// GuestAgent is the QEMU guest agent's state: none (the VM has no
	// channel), waiting (nothing answers on it, yet) or ready (it answered;
	// IPv4Addresses then include the addresses it reports).
	GuestAgent string `json:"guest_agent"`
}

// States of GuestStatus.GuestAgent.
const (
	GuestAgentNone    = "none"
	GuestAgentWaiting = "waiting"
	GuestAgentReady   = "ready"
)

// Placement explains why a VM went where it did.
type Placement struct {
	Host     string             `json:"host"`
	Score    float64            `json:"score"`
	Terms    map[string]float64 `json:"terms"`
	Rejected []Rejection        `json:"rejected"`
	// RejectedCounts counts every rejected host by reason; Rejected lists
	// the first of them only (a VM keeps at most a few dozen), and
	// RejectedOmitted says how many more there were.
	RejectedCounts  map[string]int `json:"rejected_counts,omitempty"`
	RejectedOmitted int            `json:"rejected_omitted,omitempty"`
	// Note says when something besides the score decided, e.g. the warm
	// pool preference.
	Note string `json:"note,omitempty"`
}

// Rejection says why one host could not take a request. Reason is a
// named reason (the Reason* constants); Detail says the particulars.
type Rejection struct {
	Host   string `json:"host"`
	Reason string `json:"reason"`
	Detail string `json:"detail,omitempty"`
}

// Rejection reasons, the first filter a host failed. More may be added.
const (
	ReasonNotPinned     = "not_pinned"
	ReasonNotRegistered = "not_registered"
	ReasonNotAlive      = "not_alive"
	ReasonUnschedulable = "unschedulable"
	ReasonNoImage       = "no_image"
	ReasonNetwork       = "network"
	ReasonLabels        = "labels"
	ReasonGroupCap      = "group_cap"
	ReasonMemory        = "memory"
	ReasonCPU           = "cpu"
	ReasonDisk          = "disk"
)

// PlacementRequest is the body of POST /v1/placements (a dry run).
type PlacementRequest struct {
	Image     string `json:"image"`
	VCPUs     int64  `json:"vcpus"`
	MemoryMiB int64  `json:"memory_mib"`
	DiskMiB   int64  `json:"disk_mib"`
	Host      string `json:"host,omitempty"`
	// Constraints are applied as they would be to a create.
	Constraints *Constraints `json:"constraints,omitempty"`
	// NetworkInterfaces and Volumes are a create's: hosts a network is not
	// on, or that do not hold the volumes, are refused as a create refuses
	// them, and a network with no free address is the create's 409.
	// Omitted NICs are a create's default: one NIC on "default".
	NetworkInterfaces []NetworkInterface `json:"network_interfaces,omitempty"`
	Volumes           []VMVolume         `json:"volumes,omitempty"`
}

// RankedHost is one host that fits a request, with its score (lower is better).
type RankedHost struct {
	Host  string             `json:"host"`
	Score float64            `json:"score"`
	Terms map[string]float64 `json:"terms"`
	// WarmReady is how many warm VMs of the request's image and shape the
	// host has ready.
	WarmReady int `json:"warm_ready"`
}

// PlacementResult is the answer of a dry run: the hosts that fit, best first,
// and the reason every other host was rejected. Host is empty when none fits.
type PlacementResult struct {
	Host     string       `json:"host"`
	Score    float64      `json:"score"`
	Ranked   []RankedHost `json:"ranked"`
	Rejected []Rejection  `json:"rejected"`
	// Note says when something besides the score decided (warm preference).
	Note string `json:"note,omitempty"`
}

// ForkCreate is the body of POST /v1/forks.
type ForkCreate struct {
	SourceVMID  string `json:"source_vm_id"`
	Count       int    `json:"count"`
	PauseSource bool   `json:"pause_source"`
	Placement   string `json:"placement,omitempty"`
	// Constraints apply to every child (a group spreads the children).
	Constraints *Constraints `json:"constraints,omitempty"`
}

// ForkPatch is the body of PATCH /v1/forks/{id}.
type ForkPatch struct {
	Count *int `json:"count,omitempty"`
	// Constraints replaces the children's constraints: children placed
	// from now on follow them; running children stay where they are. An
	// empty object clears them.
	Constraints *Constraints `json:"constraints,omitempty"`
}

// Fork is N children of one source VM, all from one snapshot.
type Fork struct {
	ID string `json:"id"`
	// Project is the source VM's project; the children belong to it.
	Project       string `json:"project"`
	SourceVMID    string `json:"source_vm_id"`
	Count         int    `json:"count"`
	PauseSource   bool   `json:"pause_source"`
	Placement     string `json:"placement"`
	SnapshotID    string `json:"snapshot_id"`
	SnapshotTaken bool   `json:"snapshot_taken"`
	Phase         string `json:"phase"`
	// Error is the reason the last pass failed (phases retrying and failed).
	Error string `json:"error,omitempty"`
	// Attempts counts the passes that failed in a row; RetryAt is when the
	// control plane runs the next one (phase retrying only).
	Attempts int        `json:"attempts"`
	RetryAt  *time.Time `json:"retry_at,omitempty"`
	// Constraints apply to every child.
	Constraints *Constraints `json:"constraints,omitempty"`
	Children    []VM         `json:"children"`
	CreatedAt   time.Time    `json:"created_at"`
}

// List is one page of a list response.
type List[T any] struct {
	Items         []T    `json:"items"`
	NextPageToken string `json:"next_page_token"`
}

// Paging limits of list endpoints.
const (
	DefaultPageSize = 100
	MaxPageSize     = 1000
)

// Network modes.
const (
	// NetworkUser is QEMU user-mode networking: no root, port forwards on
	// 127.0.0.1 with host ports the agent chooses.
	NetworkUser = "user"
	// NetworkNAT is an agent-made Linux bridge with a tap per NIC, DHCP with
	// one static lease per MAC, and masquerade for traffic out.
	NetworkNAT = "nat"
	// NetworkBridge is a tap on a bridge the operator made on the hosts.
	NetworkBridge = "bridge"
	// NetworkOverlay is one L2 segment across the hosts: a bridge like
	// nat's on each host (same gateway address, egress NAT on each) joined
	// to the other hosts' by a VXLAN device whose forwarding entries the
	// control plane programs; the hosts need an underlay_address.
	NetworkOverlay = "overlay"
)

// Overlay network limits and defaults.
const (
	// OverlayDefaultMTU is 1500 less the 50 bytes of VXLAN over IPv4.
	OverlayDefaultMTU = 1450
	// OverlayMinMTU is the smallest MTU IPv4 guarantees to work; OverlayMaxMTU
	// is a 9000-byte jumbo underlay less the VXLAN overhead.
	OverlayMinMTU = 576
	OverlayMaxMTU = 9000 - 50
	// OverlayFirstAutoVNI is where VNIs chosen by the control plane start
	// (the low ones are left to the operator's own VXLAN use); OverlayMaxVNI
	// is the 24-bit limit.
	OverlayFirstAutoVNI = 4096
	OverlayMaxVNI       = 1<<24 - 1
)

// DefaultNetwork is the user-mode network that exists out of the box.
const DefaultNetwork = "default"

// NetworkCreate is the body of POST /v1/networks.
type NetworkCreate struct {
	Name string `json:"name"`
	// Project is the project whose VMs may attach to the network. Empty:
	// "default". Network names are fleet-wide (they name bridges on hosts).
	Project string `json:"project,omitempty"`
	Mode    string `json:"mode"`
	CIDR    string `json:"cidr,omitempty"`
	Gateway string `json:"gateway,omitempty"`
	// DHCP defaults to true for nat, and for bridge networks with a CIDR.
	DHCP   *bool  `json:"dhcp,omitempty"`
	Bridge string `json:"bridge,omitempty"`
	// Hosts limits the network to these hosts; empty means every host.
	Hosts []string `json:"hosts,omitempty"`
	// Allow (nat networks) is what the network's guests may reach besides
	// their own network and the outside through NAT: names of other nat
	// networks (their guests on the same host) and IPv4 CIDRs (private
	// ranges, e.g. the operator's LAN, are fenced off unless listed here).
	// The host itself is never reachable.
	Allow []string `json:"allow,omitempty"`
	// VNI (overlay networks) is the VXLAN network identifier, 1 to
	// 16777215; omitted, the lowest free one from 4096 up.
	VNI *int64 `json:"vni,omitempty"`
	// MTU (overlay networks) of the network's guests, bridges and tunnels:
	// 576 to 8950, default 1450 (an underlay MTU of 1500 less the VXLAN
	// overhead of 50).
	MTU *int64 `json:"mtu,omitempty"`
}

// NetworkPatch is the body of PATCH /v1/networks/{name}: what changes in
// place. Hosts, when set, replaces the list (empty: every host); it steers
// future placements only, VMs already placed keep their NICs.
type NetworkPatch struct {
	Hosts *[]string `json:"hosts,omitempty"`
}

// Network is a named network VMs attach NICs to.
type Network struct {
	Name    string   `json:"name"`
	Project string   `json:"project"`
	Mode    string   `json:"mode"`
	CIDR    string   `json:"cidr"`
	Gateway string   `json:"gateway"`
	DHCP    bool     `json:"dhcp"`
	Bridge  string   `json:"bridge"`
	Hosts   []string `json:"hosts"`
	Allow   []string `json:"allow"`
	// VNI and MTU are an overlay network's (0 for the other modes).
	VNI int64 `json:"vni,omitempty"`
	MTU int64 `json:"mtu,omitempty"`
	// AddressesTotal and AddressesUsed count the IPAM range (0 without a CIDR).
	AddressesTotal int       `json:"addresses_total"`
	AddressesUsed  int       `json:"addresses_used"`
	CreatedAt      time.Time `json:"created_at"`
}

// PortForward maps a host port to a guest port (user-mode networks).
// HostAddress and HostPort are chosen by the agent and reported.
type PortForward struct {
	GuestPort   int    `json:"guest_port"`
	HostAddress string `json:"host_address,omitempty"`
	HostPort    int    `json:"host_port,omitempty"`
}

// NetworkInterface is one NIC of a VM. In a create, IPv4Address asks for a
// fixed address; in a VM it is the address the VM has.
type NetworkInterface struct {
	Network      string        `json:"network"`
	MACAddress   string        `json:"mac_address,omitempty"`
	IPv4Address  string        `json:"ipv4_address,omitempty"`
	PortForwards []PortForward `json:"port_forwards,omitempty"`
	// IPv4Addresses, in answers only, are the addresses the guest reports
	// on this NIC (matched by its MAC) through the QEMU guest agent: filled
	// by GET /v1/vms/{id} for a running VM with guest_agent whose guest
	// agent answers (lists leave it out: one guest round trip per VM),
	// whatever the network's mode, also where the network assigns none.
	IPv4Addresses []string `json:"ipv4_addresses,omitempty"`
	// GuestIPv4Address, in the children of a fork's answer only, is the
	// address the child's guest has inside on a nat network: its source's
	// address at the fork point, which the agent translates to and from the
	// child's own (IPv4Address). It is a known alias of the child, not of
	// the source: inside the child it names the child itself, so the child
	// cannot reach its source there (docs/guides/networks.md, "Forks").
	GuestIPv4Address string `json:"guest_ipv4_address,omitempty"`
}

// Constraints steer placement (all optional).
type Constraints struct {
	// HostLabels must all match the host's labels (a hard filter).
	HostLabels map[string]string `json:"host_labels,omitempty"`
	// Group names VMs that belong together; spreading applies within it.
	Group string `json:"group,omitempty"`
	// SpreadBy is the failure domain: "host" or "label:<key>".
	SpreadBy string `json:"spread_by,omitempty"`
	// MaxPerDomain caps the group's VMs per domain (0: no cap).
	MaxPerDomain int `json:"max_per_domain,omitempty"`
}

// Token scopes.
const (
	// ScopeAdmin manages hosts, networks, images and tokens.
	ScopeAdmin = "admin"
	// ScopeUser manages VMs, forks and placements and reads the rest.
	ScopeUser = "user"
)

// TokenCreate is the body of POST /v1/tokens.
type TokenCreate struct {
	Name string `json:"name"`
	// Project makes a project token: it sees and acts on that project's
	// objects only and cannot hold the admin scope. Empty: a fleet-wide token.
	Project   string     `json:"project,omitempty"`
	Scopes    []string   `json:"scopes"`
	ExpiresAt *time.Time `json:"expires_at,omitempty"`
}

// Token is an API token. Secret is set only in the answer of its create.
type Token struct {
	ID         string     `json:"id"`
	Name       string     `json:"name"`
	Project    string     `json:"project,omitempty"`
	Scopes     []string   `json:"scopes"`
	ExpiresAt  *time.Time `json:"expires_at,omitempty"`
	LastUsedAt *time.Time `json:"last_used_at,omitempty"`
	CreatedAt  time.Time  `json:"created_at"`
	Secret     string     `json:"token,omitempty"`
}

// Image formats of a registered image.
const (
	ImageFormatQCOW2 = "qcow2"
	ImageFormatRaw   = "raw"
	// ImageFormatKernel is a kernel bundle: a tar whose top level holds
	// image.json and the files it names (kernel, initrd, an optional qcow2
	// disk), the layout of an agent's image folder.
	ImageFormatKernel = "kernel"
)

// Per-host image states.
const (
	ImageReady    = "ready"
	ImageFetching = "fetching"
	ImageFailed   = "failed"
)

// ImageCreate is the body of POST /v1/images.
type ImageCreate struct {
	Name string `json:"name"`
	// SourceURL is http://, https:// or file:// (a path on the hosts, read
	// with the agent's privileges: registering an image takes the admin
	// scope).
	SourceURL string `json:"source_url"`
	// SHA256 is the digest of the file at SourceURL (64 lower-case hex).
	SHA256 string `json:"sha256"`
	Format string `json:"format"`
	// MinDiskMiB is the smallest disk_mib a VM of this image may have.
	MinDiskMiB int64 `json:"min_disk_mib,omitempty"`
	// Prefetch asks every host to fetch the image now, not on first use.
	Prefetch bool `json:"prefetch,omitempty"`
	// Firmware boots VMs of a disk image (qcow2, raw): FirmwareBIOS
	// (default) or FirmwareUEFI. A UEFI-only disk (an EFI system partition
	// and no BIOS boot code) is refused under bios at the VM's create.
	Firmware string `json:"firmware,omitempty"`
}

// Firmware of an image.
const (
	FirmwareBIOS = "bios"
	FirmwareUEFI = "uefi"
)

// ImagePatch is the body of PATCH /v1/images/{name}: what changes in place.
type ImagePatch struct {
	MinDiskMiB *int64 `json:"min_disk_mib,omitempty"`
	Prefetch   *bool  `json:"prefetch,omitempty"`
}

// ImageHost is an image's state on one host.
type ImageHost struct {
	Host   string `json:"host"`
	Status string `json:"status"`
	Reason string `json:"reason,omitempty"`
}

// Image is a registered image. SizeBytes and VirtualSizeMiB are known once a
// host has fetched it (0 before).
type Image struct {
	Name           string      `json:"name"`
	SourceURL      string      `json:"source_url"`
	SHA256         string      `json:"sha256"`
	Format         string      `json:"format"`
	MinDiskMiB     int64       `json:"min_disk_mib"`
	Prefetch       bool        `json:"prefetch"`
	Firmware       string      `json:"firmware"`
	SizeBytes      int64       `json:"size_bytes"`
	VirtualSizeMiB int64       `json:"virtual_size_mib"`
	Hosts          []ImageHost `json:"hosts"`
	CreatedAt      time.Time   `json:"created_at"`
}

// DefaultProject holds every object made without a project, and every
// object made before projects existed.
const DefaultProject = "default"

// Quotas are a project's limits; a nil field is unlimited. Fork children
// are VMs and count like any other.
type Quotas struct {
	VCPUs     *int64 `json:"vcpus"`
	MemoryMiB *int64 `json:"memory_mib"`
	DiskMiB   *int64 `json:"disk_mib"`
	VMs       *int64 `json:"vms"`
}

// ProjectUsage is what a project's VMs hold now (the VMs that hold
// capacity on a host).
type ProjectUsage struct {
	VCPUs     int64 `json:"vcpus"`
	MemoryMiB int64 `json:"memory_mib"`
	DiskMiB   int64 `json:"disk_mib"`
	VMs       int64 `json:"vms"`
}

// Quota resources, as named in a quota_exceeded error's details.
const (
	ResourceVCPUs     = "vcpus"
	ResourceMemoryMiB = "memory_mib"
	ResourceDiskMiB   = "disk_mib"
	ResourceVMs       = "vms"
)

// ProjectCreate is the body of POST /v1/projects.
type ProjectCreate struct {
	// Name is a DNS label: lowercase letters, digits and '-', at most 63.
	Name        string `json:"name"`
	Description string `json:"description,omitempty"`
	Quotas      Quotas `json:"quotas"`
	// HostLabels confine the project's VMs to hosts with all these labels.
	HostLabels map[string]string `json:"host_labels,omitempty"`
}

// ProjectPatch is the body of PATCH /v1/projects/{name}: the fields that
// are set replace the stored ones (Quotas whole: a nil field in it is
// unlimited). A quota below the usage is accepted: it refuses growth
// only, nothing running is stopped.
type ProjectPatch struct {
	Description *string            `json:"description,omitempty"`
	Quotas      *Quotas            `json:"quotas,omitempty"`
	HostLabels  *map[string]string `json:"host_labels,omitempty"`
}

// Project is a team's share of the fleet.
type Project struct {
	Name        string            `json:"name"`
	Description string            `json:"description"`
	Quotas      Quotas            `json:"quotas"`
	HostLabels  map[string]string `json:"host_labels"`
	Usage       ProjectUsage      `json:"usage"`
	CreatedAt   time.Time         `json:"created_at"`
}

// WhoAmI is the answer of GET /v1/whoami: the token a request carries.
type WhoAmI struct {
	// TokenID is "" for the bootstrap token (--token).
	TokenID string   `json:"token_id"`
	Name    string   `json:"name"`
	Scopes  []string `json:"scopes"`
	// Project is the token's project; "" for a fleet-wide token.
	Project string `json:"project"`
	// CreateProject is where the token's creates go when they name no
	// project: its own, or default for a fleet-wide token.
	CreateProject string `json:"create_project"`
}
