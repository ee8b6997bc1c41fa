package agentapi

// Overlay networks: one L2 segment across hosts, carried in VXLAN between
// the hosts' underlay addresses. The control plane knows every NIC's MAC,
// address and host; it tells each agent, per network, which NICs are on
// the other hosts (Entries) and which hosts have the network (Peers). The
// agent programs static forwarding and neighbour entries from that: no
// learning, no multicast, no flooding.

// OverlayPort is the VXLAN UDP port (IANA).
const OverlayPort = 4789

// Bounds of an overlay network's VNI and MTU.
const (
	OverlayVNIMin = 1
	OverlayVNIMax = 1<<24 - 1
	// OverlayOverhead is what VXLAN over IPv4 adds to a frame: the
	// overlay's MTU is at most the underlay's less this.
	OverlayOverhead   = 50
	OverlayMTUDefault = 1500 - OverlayOverhead
	OverlayMTUMin     = 576
	OverlayMTUMax     = 9000 - OverlayOverhead
)

// Overlay is the desired state of one overlay network on one host: the
// body of PUT /v1/overlays/{network}.
type Overlay struct {
	Network string `json:"network"`
	VNI     int    `json:"vni"`
	CIDR    string `json:"cidr"`
	Gateway string `json:"gateway"`
	MTU     int    `json:"mtu"`
	// Allow is as NIC.Allow.
	Allow []string `json:"allow,omitempty"`
	// Peers are every OTHER host that has this network now: UDP 4789 is
	// accepted from their underlay addresses only.
	Peers []OverlayPeer `json:"peers"`
	// Entries are every NIC of this network on OTHER hosts.
	Entries []OverlayEntry `json:"entries"`
}

// OverlayPeer is another host of an overlay network.
type OverlayPeer struct {
	Host     string `json:"host"`
	Underlay string `json:"underlay_address"`
}

// OverlayEntry is a NIC of an overlay network on another host: its MAC
// and address, and the underlay address of its host.
type OverlayEntry struct {
	MAC      string `json:"mac_address"`
	IPv4     string `json:"ipv4_address"`
	Underlay string `json:"underlay_address"`
}

// OverlayState is one overlay network on a host as the kernel has it (read
// through netlink, not from memory): GET /v1/overlays answers a JSON array
// of them, PUT /v1/overlays/{network} the one it made.
type OverlayState struct {
	Network string `json:"network"`
	VNI     int    `json:"vni"`
	Device  string `json:"device"`
	Bridge  string `json:"bridge"`
	MTU     int    `json:"mtu"`
	// FDB are the permanent forwarding entries of the vxlan device,
	// sorted by MAC then destination.
	FDB []OverlayFDB `json:"fdb"`
	// Neigh are the neighbour entries of the vxlan device, sorted by
	// address.
	Neigh []OverlayNeigh `json:"neigh"`
}

// OverlayFDB is a forwarding entry: frames to MAC go to the VXLAN tunnel
// endpoint Dst.
type OverlayFDB struct {
	MAC string `json:"mac_address"`
	Dst string `json:"dst"`
}

// OverlayNeigh is a neighbour entry: IPv4 is at MAC (the vxlan device's
// ARP proxy answers with it).
type OverlayNeigh struct {
	IPv4 string `json:"ipv4_address"`
	MAC  string `json:"mac_address"`
}
