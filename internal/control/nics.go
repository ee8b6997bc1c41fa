package control

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"sync"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/scheduler"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

const (
	// maxNICs bounds a VM's network interfaces.
	maxNICs = 8
	// maxForwards bounds the forwarded ports of one NIC.
	maxForwards = 16
	// userModeAddress is the address QEMU's user-mode network gives a guest.
	userModeAddress = "10.0.2.15"
	// probeAttempts is how many cheap address probes (a per-network hint
	// that moves on with every allocation) a reservation tries before it
	// asks the database for the free gaps.
	probeAttempts = 4
	// maxIPAMAttempts bounds the reservations a create retries because an
	// address or MAC it chose was taken meanwhile.
	maxIPAMAttempts = 24
)

// vmNICs is the NIC plan of one VM: the rows to store and the networks
// they are on (same order).
type vmNICs struct {
	nics []store.NIC
	nets []store.Network
}

// resolveNICs checks the requested NICs against their networks and fills
// what the control plane decides before placement: MACs (derived from the
// VM id) and the user-mode address. IPAM addresses come with the
// reservation (assignAddresses). Omitted, the VM gets one NIC on "default".
func (s *Service) resolveNICs(ctx context.Context, vmID, project string, in []api.NetworkInterface) (vmNICs, error) {
	if in == nil {
		in = []api.NetworkInterface{{Network: api.DefaultNetwork}}
	}
	if len(in) > maxNICs {
		return vmNICs{}, invalidf("network_interfaces: at most %d, got %d", maxNICs, len(in))
	}
	var out vmNICs
	for i, req := range in {
		field := fmt.Sprintf("network_interfaces[%d]", i)
		if req.Network == "" {
			return vmNICs{}, invalidf("%s.network is required", field)
		}
		n, err := s.networks.get(ctx, s.store, req.Network)
		if err == nil && !attachable(n, project) {
			// Another project's network answers as one that does not exist.
			err = fmt.Errorf("network %q: %w", req.Network, store.ErrNotFound)
		}
		if errors.Is(err, store.ErrNotFound) {
			return vmNICs{}, invalidf("%s.network: network %q does not exist; create it first (GET /v1/networks lists them)", field, req.Network)
		}
		if err != nil {
			return vmNICs{}, fromStore(err, "read network "+req.Network)
		}
		if req.MACAddress != "" {
			return vmNICs{}, invalidf("%s.mac_address is chosen by the control plane; leave it empty", field)
		}
		nic := store.NIC{Network: n.Name, MACAddress: deriveMAC(vmID, i, 0)}
		if req.IPv4Address != "" {
			if nic.Address, err = fixedAddress(field, n, req.IPv4Address); err != nil {
				return vmNICs{}, err
			}
			nic.Fixed = true
			nic.IPv4Address = numAddr(nic.Address).String()
		}
		if n.Mode == api.NetworkUser {
			nic.IPv4Address = userModeAddress
		}
		if nic.PortForwards, err = validateForwards(field, n, req.PortForwards); err != nil {
			return vmNICs{}, err
		}
		out.nics = append(out.nics, nic)
		out.nets = append(out.nets, n)
	}
	return out, nil
}

// fixedAddress checks a requested address: inside the range, not the
// network, broadcast or gateway address. Whether it is free the unique
// index decides at reservation.
func fixedAddress(field string, n store.Network, addr string) (int64, error) {
	if !n.HasIPAM() {
		return 0, invalidf("%s.ipv4_address: network %q (mode %s) has no cidr, so the control plane assigns no addresses on it", field, n.Name, n.Mode)
	}
	a, err := netip.ParseAddr(addr)
	if err != nil || !a.Is4() {
		return 0, invalidf("%s.ipv4_address %q is not an IPv4 address", field, addr)
	}
	num := addrNum(a)
	if num < n.RangeFirst || num > n.RangeLast {
		return 0, invalidf("%s.ipv4_address %s is outside the usable addresses of network %q (%s: %s to %s)",
			field, addr, n.Name, n.CIDR, numAddr(n.RangeFirst), numAddr(n.RangeLast))
	}
	if num == n.GatewayNum {
		return 0, invalidf("%s.ipv4_address %s is the gateway of network %q", field, addr, n.Name)
	}
	return num, nil
}

func validateForwards(field string, n store.Network, in []api.PortForward) ([]store.PortForward, error) {
	if len(in) == 0 {
		return nil, nil
	}
	if n.Mode != api.NetworkUser {
		return nil, invalidf("%s.port_forwards: only user-mode networks forward ports; network %q is %s (its VMs are reached at their own address)", field, n.Name, n.Mode)
	}
	if len(in) > maxForwards {
		return nil, invalidf("%s.port_forwards: at most %d, got %d", field, maxForwards, len(in))
	}
	out := make([]store.PortForward, 0, len(in))
	for j, f := range in {
		if f.GuestPort < 1 || f.GuestPort > 65535 {
			return nil, invalidf("%s.port_forwards[%d].guest_port must be between 1 and 65535, got %d", field, j, f.GuestPort)
		}
		if f.HostAddress != "" || f.HostPort != 0 {
			return nil, invalidf("%s.port_forwards[%d]: host_address and host_port are chosen by the agent; leave them empty", field, j)
		}
		for _, o := range out {
			if o.GuestPort == f.GuestPort {
				return nil, invalidf("%s.port_forwards: guest_port %d is forwarded twice", field, f.GuestPort)
			}
		}
		out = append(out, store.PortForward{GuestPort: f.GuestPort})
	}
	return out, nil
}

// deriveMAC is a VM's MAC for a NIC: locally administered and unicast
// (02:...), the rest from a hash of the VM id and NIC index, so it is
// stable and needs no coordination; salt moves it when the unique index
// reports the (rare) collision with a live VM.
func deriveMAC(vmID string, index, salt int) string {
	h := sha256.Sum256(fmt.Appendf(nil, "%s/%d/%d", vmID, index, salt))
	return fmt.Sprintf("02:%02x:%02x:%02x:%02x:%02x", h[0], h[1], h[2], h[3], h[4])
}

// networkHosts is the placement filter of a VM's networks: those limited
// to some hosts, and overlays (hosts with an underlay address only).
func networkHosts(nets []store.Network) []scheduler.NetworkHosts {
	var out []scheduler.NetworkHosts
	for _, n := range nets {
		overlay := n.Mode == api.NetworkOverlay
		if (len(n.Hosts) > 0 || overlay) && !slices.ContainsFunc(out, func(o scheduler.NetworkHosts) bool { return o.Network == n.Name }) {
			out = append(out, scheduler.NetworkHosts{Network: n.Name, Hosts: n.Hosts, Overlay: overlay})
		}
	}
	return out
}

// warmCapable says whether a warm pool VM may serve the VM: pool VMs boot
// with one user-mode NIC, so only a VM with exactly that takes one; any
// other NIC set boots cold.
func warmCapable(p vmNICs) bool {
	return len(p.nics) == 1 && p.nets[0].Mode == api.NetworkUser && len(p.nics[0].PortForwards) == 0
}

// ipamHints is each network's next address to probe on this replica.
// Addresses are handed out from the low end of the range, so fixed
// addresses asked for at the high end rarely meet an automatic one; a hint
// starts at the lowest free address the database knows of.
type ipamHints struct {
	mu   sync.Mutex
	next map[string]int64
}

// take returns the next candidate of n and moves the hint on; ok is false
// when the replica has no hint for n yet. jump skips a random few
// addresses after a lost race, so that replicas probing in step part ways.
func (h *ipamHints) take(n store.Network, jump bool) (int64, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	c, ok := h.next[n.Name]
	if !ok {
		return 0, false
	}
	if jump {
		c += rand.Int64N(8) //nolint:gosec // a spread, not a secret
	}
	if c == n.GatewayNum {
		c++
	}
	if c < n.RangeFirst || c > n.RangeLast {
		c = n.RangeFirst
		if c == n.GatewayNum {
			c++
		}
	}
	h.next[n.Name] = c + 1
	return c, true
}

// restart points the hint at an address known to be free.
func (h *ipamHints) restart(network string, at int64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.next == nil {
		h.next = map[string]int64{}
	}
	h.next[network] = at
}

// assignAddresses gives every NIC on an IPAM network without a fixed
// address a candidate address. The first attempts probe from the hint; later
// ones take the lowest free addresses the database knows of, and an empty
// answer there is the network's exhaustion: 409 no_address naming it.
func (s *Service) assignAddresses(ctx context.Context, p vmNICs, attempt int) error {
	taken := map[string][]int64{}
	for i := range p.nics {
		nic, n := &p.nics[i], p.nets[i]
		if !n.HasIPAM() || nic.Fixed {
			continue
		}
		var c int64
		probed := false
		if attempt < probeAttempts {
			c, probed = s.ipam.take(n, attempt > 0)
		}
		if !probed {
			free, err := s.store.FreeAddresses(ctx, n, len(taken[n.Name])+1)
			if err != nil {
				return fromStore(err, "find a free address on network "+n.Name)
			}
			for _, f := range free {
				if !slices.Contains(taken[n.Name], f) {
					c = f
					break
				}
			}
			if c == 0 {
				return noAddress(n)
			}
			s.ipam.restart(n.Name, c+1)
		}
		taken[n.Name] = append(taken[n.Name], c)
		nic.Address = c
		nic.IPv4Address = numAddr(c).String()
	}
	return nil
}

// checkFreeAddresses is the dry run's assignAddresses: it refuses, as a
// create would, a plan whose networks lack a free address for each of its
// NICs there, or whose fixed address a VM holds, and changes nothing (no
// hint moves, nothing is held).
func (s *Service) checkFreeAddresses(ctx context.Context, p vmNICs) error {
	need := map[string]int{}
	var order []store.Network
	for i, nic := range p.nics {
		n := p.nets[i]
		if !n.HasIPAM() || nic.Fixed {
			continue
		}
		if need[n.Name] == 0 {
			order = append(order, n)
		}
		need[n.Name]++
	}
	for _, n := range order {
		free, err := s.store.FreeAddresses(ctx, n, need[n.Name])
		if err != nil {
			return fromStore(err, "find a free address on network "+n.Name)
		}
		if len(free) < need[n.Name] {
			return noAddress(n)
		}
	}
	return s.resolveTakenFixed(ctx, "", p)
}

func noAddress(n store.Network) error {
	return &Error{Code: api.CodeNoAddress,
		Message: fmt.Sprintf("network %q has no free address: all %d addresses of %s are held by VMs; delete some or use a larger network", n.Name, n.Size(), n.CIDR),
		Details: map[string]any{"network": n.Name, "addresses_total": n.Size()}}
}

// resolveTakenFixed turns a taken fixed address into a 409 naming its
// holder; nil when every fixed address is free (a probe lost a race).
func (s *Service) resolveTakenFixed(ctx context.Context, vmID string, p vmNICs) error {
	for i, nic := range p.nics {
		if !nic.Fixed {
			continue
		}
		holder, err := s.store.AddressHolder(ctx, nic.Network, nic.Address)
		if errors.Is(err, store.ErrNotFound) || (err == nil && holder.VMID == vmID) {
			continue
		}
		if err != nil {
			return fromStore(err, "read the holder of "+nic.IPv4Address)
		}
		return &Error{Code: api.CodeConflict,
			Message: fmt.Sprintf("network_interfaces[%d].ipv4_address %s on network %q is held by VM %s (%s); choose another address or delete that VM",
				i, nic.IPv4Address, nic.Network, holder.Name, holder.VMID),
			Details: map[string]any{"network": nic.Network, "ipv4_address": nic.IPv4Address, "holder_id": holder.VMID}}
	}
	return nil
}

// remac moves every MAC of the plan to the next salt.
func remac(vmID string, p vmNICs, salt int) {
	for i := range p.nics {
		p.nics[i].MACAddress = deriveMAC(vmID, i, salt)
	}
}

// agentNICs is what the agent needs to attach the NICs.
func agentNICs(p vmNICs) []agentapi.NIC {
	if len(p.nics) == 0 {
		return nil
	}
	out := make([]agentapi.NIC, 0, len(p.nics))
	for i, nic := range p.nics {
		n := p.nets[i]
		a := agentapi.NIC{Network: n.Name, Mode: n.Mode, MACAddress: nic.MACAddress, CIDR: n.CIDR, Gateway: n.Gateway,
			DHCP: n.DHCP, Bridge: n.Bridge, Allow: n.Allow}
		if n.HasIPAM() {
			a.IPv4Address = nic.IPv4Address
		}
		if n.Mode == api.NetworkOverlay && n.VNI != nil {
			a.VNI, a.MTU = int(*n.VNI), int(n.MTU)
		}
		for _, f := range nic.PortForwards {
			a.PortForwards = append(a.PortForwards, agentapi.PortForward{GuestPort: f.GuestPort})
		}
		out = append(out, a)
	}
	return out
}

// mergeAgentNICs takes what the agent chose (forwarded host ports, and the
// MAC of a warm VM's NIC) into the stored NICs; it reports a change.
func mergeAgentNICs(nics []store.NIC, got []agentapi.NIC) bool {
	changed := false
	for i := range min(len(nics), len(got)) {
		nic, a := &nics[i], got[i]
		if a.MACAddress != "" && a.MACAddress != nic.MACAddress {
			nic.MACAddress, changed = a.MACAddress, true
		}
		for j := range nic.PortForwards {
			f := &nic.PortForwards[j]
			for _, af := range a.PortForwards {
				if af.GuestPort == f.GuestPort && (af.HostPort != f.HostPort || af.HostAddress != f.HostAddress) {
					f.HostAddress, f.HostPort, changed = af.HostAddress, af.HostPort, true
				}
			}
		}
	}
	return changed
}

// apiNICs is the wire form of stored NICs.
func apiNICs(nics []store.NIC) []api.NetworkInterface {
	out := make([]api.NetworkInterface, 0, len(nics))
	for _, n := range nics {
		w := api.NetworkInterface{Network: n.Network, MACAddress: n.MACAddress, IPv4Address: n.IPv4Address}
		for _, f := range n.PortForwards {
			w.PortForwards = append(w.PortForwards, api.PortForward(f))
		}
		out = append(out, w)
	}
	return out
}

// forkNICs is what a fork's children get of the source's NICs: the same
// networks and forwarded guest ports, with their own MACs and addresses.
func forkNICs(src []store.NIC) []api.NetworkInterface {
	out := make([]api.NetworkInterface, 0, len(src))
	for _, n := range src {
		w := api.NetworkInterface{Network: n.Network}
		for _, f := range n.PortForwards {
			w.PortForwards = append(w.PortForwards, api.PortForward{GuestPort: f.GuestPort})
		}
		out = append(out, w)
	}
	return out
}

// retryAfterNICConflict handles a reservation refused by a vm_nics index:
// a taken fixed address is the caller's 409; a probed address or a MAC
// taken meanwhile means try again with new ones (nil).
func (s *Service) retryAfterNICConflict(ctx context.Context, vm *store.VM, p vmNICs, err error, attempt int) error {
	if attempt+1 >= maxIPAMAttempts {
		return unavailable(err, "VM %q kept losing its addresses to concurrent creates; retry", vm.Name)
	}
	if errors.Is(err, store.ErrMACTaken) {
		remac(vm.ID, p, attempt+1)
		return nil
	}
	if err := s.resolveTakenFixed(ctx, vm.ID, p); err != nil {
		return err
	}
	return s.assignAddresses(ctx, p, attempt+1)
}
