package control

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

const (
	// minPrefix and maxPrefix bound the CIDR of a network with IPAM: a /16
	// at most (65,533 addresses), a /30 at least (one VM beside the gateway).
	minPrefix = 16
	maxPrefix = 30
	// maxHostsPerNetwork bounds a network's host list.
	maxHostsPerNetwork = 1000
	// maxUsersInError bounds the VMs a 409 of a network delete names.
	maxUsersInError = 20
	// networkCacheTTL is how long a replica trusts its copy of a network
	// (hosts can change in place on another replica; the rest is fixed).
	networkCacheTTL = 2 * time.Second
)

// bridgeNamePattern is a Linux interface name: at most 15 characters.
var bridgeNamePattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,14}$`)

// CreateNetwork validates and stores a network.
func (s *Service) CreateNetwork(ctx context.Context, in api.NetworkCreate) (api.Network, error) {
	n, err := networkFromCreate(in)
	if err != nil {
		return api.Network{}, err
	}
	project, err := s.projectFor(ctx, in.Project)
	if err != nil {
		return api.Network{}, err
	}
	n.Project = project.Name
	var check func([]store.Network, *store.Network) error
	if n.HasIPAM() {
		check = func(all []store.Network, n *store.Network) error {
			if err := checkOverlap(*n, all); err != nil {
				return err
			}
			if n.Mode == api.NetworkOverlay {
				return chooseVNI(n, all)
			}
			return nil
		}
	}
	created, err := s.store.InsertNetworkChecked(ctx, n, check)
	var e *Error
	if errors.As(err, &e) {
		return api.Network{}, e
	}
	if errors.Is(err, store.ErrVNITaken) {
		// The lock makes chooseVNI see every committed network; the index
		// still has the last word (a network inserted around the lock).
		return api.Network{}, &Error{Code: api.CodeConflict, Err: err, Details: map[string]any{"field": "vni"},
			Message: fmt.Sprintf("vni of network %q is used by another overlay network (%v); choose another vni or leave it unset", in.Name, err)}
	}
	if errors.Is(err, store.ErrDuplicateName) {
		return api.Network{}, conflictf("a network named %q already exists; choose another name or import it", in.Name)
	}
	if err != nil {
		return api.Network{}, fromStore(err, "create network "+in.Name)
	}
	s.networks.put(created)
	s.log.Info("network created", "network", n.Name, "project", n.Project, "mode", n.Mode, "cidr", n.CIDR, "vni", created.VNI, "mtu", created.MTU)
	return apiNetwork(created, 0), nil
}

// networkFromCreate checks a create body field by field and fills the
// defaults: the first usable address as gateway, DHCP on where the control
// plane assigns addresses.
func networkFromCreate(in api.NetworkCreate) (store.Network, error) {
	if err := validateName("name", in.Name); err != nil {
		return store.Network{}, err
	}
	n := store.Network{Name: in.Name, Mode: in.Mode, Bridge: in.Bridge}
	hosts, err := validateNetworkHosts(in.Hosts)
	if err != nil {
		return store.Network{}, err
	}
	n.Hosts = hosts
	if n.Allow, err = validateAllow(in); err != nil {
		return store.Network{}, err
	}
	if in.Mode != api.NetworkOverlay && (in.VNI != nil || in.MTU != nil) {
		return store.Network{}, invalidf("vni and mtu: only an overlay network has them (its VXLAN tunnel); leave them unset for mode %q", in.Mode)
	}
	switch in.Mode {
	case api.NetworkUser:
		for field, v := range map[string]string{"cidr": in.CIDR, "gateway": in.Gateway, "bridge": in.Bridge} {
			if v != "" {
				return store.Network{}, invalidf("%s: a user-mode network takes none (QEMU gives each VM 10.0.2.15 behind its own NAT), got %q", field, v)
			}
		}
		if in.DHCP != nil && *in.DHCP {
			return store.Network{}, invalidf("dhcp: a user-mode network has QEMU's own DHCP; leave dhcp unset")
		}
		return n, nil
	case api.NetworkNAT:
		if in.Bridge != "" {
			return store.Network{}, invalidf("bridge: a nat network makes its own bridge on each host; leave bridge empty (use mode \"bridge\" for an existing bridge)")
		}
		if in.CIDR == "" {
			return store.Network{}, invalidf("cidr is required for a nat network (an IPv4 network such as 10.20.0.0/24, prefix /%d to /%d)", minPrefix, maxPrefix)
		}
	case api.NetworkOverlay:
		if in.Bridge != "" {
			return store.Network{}, invalidf("bridge: an overlay network makes its own bridge and VXLAN device on each host; leave bridge empty")
		}
		if in.CIDR == "" {
			return store.Network{}, invalidf("cidr is required for an overlay network (an IPv4 network such as 10.40.0.0/24, prefix /%d to /%d): its addresses are unique across every host", minPrefix, maxPrefix)
		}
		if err := overlayShape(&n, in); err != nil {
			return store.Network{}, err
		}
	case api.NetworkBridge:
		if in.Bridge == "" {
			return store.Network{}, invalidf("bridge is required for a bridge network: the name of an existing Linux bridge on the hosts")
		}
		if !bridgeNamePattern.MatchString(in.Bridge) {
			return store.Network{}, invalidf("bridge %q is not a valid interface name (1-15 letters, digits, '_', '.', '-')", in.Bridge)
		}
		if in.CIDR == "" {
			if in.Gateway != "" {
				return store.Network{}, invalidf("gateway: a bridge network without a cidr gets no addresses from the control plane; set cidr too, or drop gateway")
			}
			if in.DHCP != nil && *in.DHCP {
				return store.Network{}, invalidf("dhcp: needs a cidr to serve addresses from")
			}
			return n, nil
		}
	default:
		return store.Network{}, invalidf("mode must be %q, %q, %q or %q, got %q", api.NetworkUser, api.NetworkNAT, api.NetworkBridge, api.NetworkOverlay, in.Mode)
	}
	if err := setRange(&n, in.CIDR, in.Gateway); err != nil {
		return store.Network{}, err
	}
	n.DHCP = in.DHCP == nil || *in.DHCP
	return n, nil
}

// overlayShape checks an overlay's VNI and MTU and fills the MTU's
// default; a VNI left unset is chosen at insert (chooseVNI).
func overlayShape(n *store.Network, in api.NetworkCreate) error {
	if in.VNI != nil {
		if *in.VNI < 1 || *in.VNI > api.OverlayMaxVNI {
			return &Error{Code: api.CodeInvalid, Details: map[string]any{"field": "vni"},
				Message: fmt.Sprintf("vni must be between 1 and %d (24 bits), got %d; or leave it unset for the lowest free one from %d", api.OverlayMaxVNI, *in.VNI, api.OverlayFirstAutoVNI)}
		}
		vni := *in.VNI
		n.VNI = &vni
	}
	n.MTU = api.OverlayDefaultMTU
	if in.MTU != nil {
		if *in.MTU < api.OverlayMinMTU || *in.MTU > api.OverlayMaxMTU {
			return &Error{Code: api.CodeInvalid, Details: map[string]any{"field": "mtu"},
				Message: fmt.Sprintf("mtu must be between %d and %d (a 9000-byte underlay less the 50 bytes of VXLAN), got %d; the default %d fits a 1500-byte underlay",
					api.OverlayMinMTU, api.OverlayMaxMTU, *in.MTU, api.OverlayDefaultMTU)}
		}
		n.MTU = *in.MTU
	}
	return nil
}

// chooseVNI refuses a VNI another overlay has (409 naming it) and gives a
// network without one the lowest free VNI from OverlayFirstAutoVNI up.
// The caller holds the network creates' lock, so all is every committed
// network.
func chooseVNI(n *store.Network, all []store.Network) error {
	used := map[int64]string{}
	for _, o := range all {
		if o.VNI != nil && o.Name != n.Name {
			used[*o.VNI] = o.Name
		}
	}
	if n.VNI != nil {
		if other, ok := used[*n.VNI]; ok {
			return &Error{Code: api.CodeConflict, Details: map[string]any{"field": "vni", "network": other},
				Message: fmt.Sprintf("vni %d is used by overlay network %q; choose another vni or leave it unset for a free one", *n.VNI, other)}
		}
		return nil
	}
	for v := int64(api.OverlayFirstAutoVNI); v <= api.OverlayMaxVNI; v++ {
		if _, taken := used[v]; !taken {
			n.VNI = &v
			return nil
		}
	}
	return conflictf("every vni from %d to %d is used; give the network an unused one below %d", api.OverlayFirstAutoVNI, api.OverlayMaxVNI, api.OverlayFirstAutoVNI)
}

// setRange parses the CIDR and gateway into the IPAM range.
func setRange(n *store.Network, cidr, gateway string) error {
	p, err := netip.ParsePrefix(cidr)
	if err != nil || !p.Addr().Is4() {
		return invalidf("cidr %q is not an IPv4 network such as 10.20.0.0/24", cidr)
	}
	if p.Bits() < minPrefix || p.Bits() > maxPrefix {
		return invalidf("cidr %q: the prefix must be /%d to /%d, got /%d", cidr, minPrefix, maxPrefix, p.Bits())
	}
	if p.Masked() != p {
		return invalidf("cidr %q has host bits set; did you mean %s?", cidr, p.Masked())
	}
	if r, what, ok := agentapi.ReservedRange(p); ok {
		return &Error{Code: api.CodeInvalid, Message: fmt.Sprintf("cidr %s overlaps %s, %s: no network of guests; choose a private range such as 10.20.0.0/24", p, r, what),
			Details: map[string]any{"field": "cidr", "reserved": r.String()}}
	}
	network := addrNum(p.Addr())
	broadcast := network + (int64(1) << (32 - p.Bits())) - 1
	n.CIDR = p.String()
	n.RangeFirst, n.RangeLast = network+1, broadcast-1
	if gateway == "" {
		n.GatewayNum = n.RangeFirst
	} else {
		g, err := netip.ParseAddr(gateway)
		if err != nil || !g.Is4() {
			return invalidf("gateway %q is not an IPv4 address", gateway)
		}
		gn := addrNum(g)
		if !p.Contains(g) || gn == network || gn == broadcast {
			return invalidf("gateway %s is outside the usable addresses of cidr %s (%s to %s)", gateway, n.CIDR, numAddr(n.RangeFirst), numAddr(n.RangeLast))
		}
		n.GatewayNum = gn
	}
	n.Gateway = numAddr(n.GatewayNum).String()
	return nil
}

// maxAllow bounds a network's allow list (each entry is a rule on every
// host the network is on).
const maxAllow = 64

// validateAllow checks a nat network's allow list: names of other networks
// and IPv4 CIDRs, each once; sorted.
func validateAllow(in api.NetworkCreate) ([]string, error) {
	if len(in.Allow) == 0 {
		return []string{}, nil
	}
	if in.Mode != api.NetworkNAT && in.Mode != api.NetworkOverlay {
		return nil, invalidf("allow: only a nat network or an overlay network has a fence to open (the agent routes those only); leave allow empty for mode %q", in.Mode)
	}
	if len(in.Allow) > maxAllow {
		return nil, invalidf("allow: at most %d entries, got %d", maxAllow, len(in.Allow))
	}
	out := make([]string, 0, len(in.Allow))
	for _, a := range in.Allow {
		if strings.Contains(a, "/") {
			p, err := netip.ParsePrefix(a)
			if err != nil || !p.Addr().Is4() {
				return nil, invalidf("allow: %q is not an IPv4 CIDR such as 192.168.10.0/24", a)
			}
			if p.Masked() != p {
				return nil, invalidf("allow: %q has host bits set; did you mean %s?", a, p.Masked())
			}
			a = p.String()
		} else {
			if err := validateName("allow entry", a); err != nil {
				return nil, invalidf("allow: %q is neither an IPv4 CIDR nor a network name", a)
			}
			if a == in.Name {
				return nil, invalidf("allow: %q is this network; its own guests always reach each other", a)
			}
		}
		if slices.Contains(out, a) {
			return nil, invalidf("allow: %q is listed twice", a)
		}
		out = append(out, a)
	}
	slices.Sort(out)
	return out, nil
}

func validateNetworkHosts(hosts []string) ([]string, error) {
	if len(hosts) > maxHostsPerNetwork {
		return nil, invalidf("hosts: at most %d, got %d", maxHostsPerNetwork, len(hosts))
	}
	out := make([]string, 0, len(hosts))
	for _, h := range hosts {
		if err := validateName("hosts entry", h); err != nil {
			return nil, err
		}
		if slices.Contains(out, h) {
			return nil, invalidf("hosts: %q is listed twice", h)
		}
		out = append(out, h)
	}
	slices.Sort(out)
	return out, nil
}

// checkOverlap refuses a CIDR that overlaps another network's.
func checkOverlap(n store.Network, all []store.Network) error {
	p := netip.MustParsePrefix(n.CIDR)
	for _, o := range all {
		if o.CIDR == "" || o.Name == n.Name {
			continue
		}
		if q := netip.MustParsePrefix(o.CIDR); q.Overlaps(p) {
			return &Error{Code: api.CodeConflict, Message: fmt.Sprintf("cidr %s overlaps cidr %s of network %q; choose a range that does not overlap", n.CIDR, o.CIDR, o.Name),
				Details: map[string]any{"field": "cidr", "network": o.Name}}
		}
	}
	return nil
}

// GetNetwork returns one network with its address counts.
func (s *Service) GetNetwork(ctx context.Context, name string) (api.Network, error) {
	n, err := s.visibleNetwork(ctx, name)
	if err != nil {
		return api.Network{}, fromStore(err, "read network "+name)
	}
	used := int64(0)
	if n.HasIPAM() {
		counts, err := s.store.CountAddresses(ctx)
		if err != nil {
			return api.Network{}, fromStore(err, "count addresses of network "+name)
		}
		used = counts[name]
	}
	return apiNetwork(n, used), nil
}

// ListNetworks returns every network the caller sees: a project token's
// project's and the shared default network.
func (s *Service) ListNetworks(ctx context.Context) (api.List[api.Network], error) {
	all, err := s.store.ListNetworks(ctx)
	if err != nil {
		return api.List[api.Network]{}, fromStore(err, "list networks")
	}
	counts, err := s.store.CountAddresses(ctx)
	if err != nil {
		return api.List[api.Network]{}, fromStore(err, "count addresses")
	}
	out := api.List[api.Network]{Items: make([]api.Network, 0, len(all))}
	p := principalOf(ctx)
	for _, n := range all {
		if p.Project != "" && !attachable(n, p.Project) {
			continue
		}
		out.Items = append(out.Items, apiNetwork(n, counts[n.Name]))
	}
	return out, nil
}

// UpdateNetwork changes what can change in place: the hosts.
func (s *Service) UpdateNetwork(ctx context.Context, name string, in api.NetworkPatch) (api.Network, error) {
	if _, err := s.visibleNetwork(ctx, name); err != nil {
		return api.Network{}, fromStore(err, "read network "+name)
	}
	if in.Hosts != nil {
		hosts, err := validateNetworkHosts(*in.Hosts)
		if err != nil {
			return api.Network{}, err
		}
		if err := s.store.SetNetworkHosts(ctx, name, hosts); err != nil {
			return api.Network{}, fromStore(err, "update network "+name)
		}
		s.networks.drop(name)
	}
	return s.GetNetwork(ctx, name)
}

// DeleteNetwork removes a network no live NIC uses; 409 naming the VMs
// otherwise. The default network stays.
func (s *Service) DeleteNetwork(ctx context.Context, name string) error {
	if name == api.DefaultNetwork {
		return conflictf("the network %q is where VMs without network_interfaces go; it cannot be deleted", name)
	}
	if _, err := s.visibleNetwork(ctx, name); err != nil {
		return fromStore(err, "read network "+name)
	}
	err := s.store.DeleteNetwork(ctx, name)
	if errors.Is(err, store.ErrNetworkInUse) {
		users, uerr := s.store.NetworkUsers(ctx, name, maxUsersInError)
		if uerr != nil {
			return fromStore(uerr, "list vms on network "+name)
		}
		names := make([]string, 0, len(users))
		ids := make([]string, 0, len(users))
		for _, u := range users {
			names = append(names, fmt.Sprintf("%s (%s)", u.Name, u.VMID))
			ids = append(ids, u.VMID)
		}
		return &Error{Code: api.CodeConflict, Err: err, Details: map[string]any{"vm_ids": ids},
			Message: fmt.Sprintf("network %q still has NICs of VMs %s; delete those VMs first", name, strings.Join(names, ", "))}
	}
	if err != nil {
		return fromStore(err, "delete network "+name)
	}
	s.networks.drop(name)
	s.log.Info("network deleted", "network", name)
	return nil
}

func apiNetwork(n store.Network, used int64) api.Network {
	hosts := n.Hosts
	if hosts == nil {
		hosts = []string{}
	}
	allow := n.Allow
	if allow == nil {
		allow = []string{}
	}
	out := api.Network{Name: n.Name, Project: n.Project, Mode: n.Mode, CIDR: n.CIDR, Gateway: n.Gateway, DHCP: n.DHCP, Bridge: n.Bridge,
		Hosts: hosts, Allow: allow, MTU: n.MTU, AddressesTotal: int(n.Size()), AddressesUsed: int(used), CreatedAt: n.CreatedAt}
	if n.VNI != nil {
		out.VNI = *n.VNI
	}
	return out
}

func addrNum(a netip.Addr) int64 {
	b := a.As4()
	return int64(b[0])<<24 | int64(b[1])<<16 | int64(b[2])<<8 | int64(b[3])
}

func numAddr(n int64) netip.Addr {
	return netip.AddrFrom4([4]byte{byte(n >> 24), byte(n >> 16), byte(n >> 8), byte(n)})
}

// networkCache keeps recently read networks: a create reads each of its
// networks from here instead of the database. Only hosts change in place
// (networkCacheTTL bounds how long another replica's change takes to show,
// and how long a replica may still place NICs on a network deleted on
// another one).
type networkCache struct {
	mu   sync.Mutex
	byID map[string]cachedNetwork
}

type cachedNetwork struct {
	n    store.Network
	read time.Time
}

func (c *networkCache) get(ctx context.Context, st *store.Store, name string) (store.Network, error) {
	c.mu.Lock()
	e, ok := c.byID[name]
	c.mu.Unlock()
	if ok && time.Since(e.read) < networkCacheTTL {
		return e.n, nil
	}
	n, err := st.GetNetwork(ctx, name)
	if err != nil {
		return store.Network{}, err
	}
	c.put(n)
	return n, nil
}

func (c *networkCache) put(n store.Network) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.byID == nil {
		c.byID = map[string]cachedNetwork{}
	}
	c.byID[n.Name] = cachedNetwork{n: n, read: time.Now()}
}

func (c *networkCache) drop(name string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.byID, name)
}
