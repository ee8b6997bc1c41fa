package qemu

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/network"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

var _ agent.NetworkDriver = (*Driver)(nil)

// hostPorts are the 127.0.0.1 ports of user-mode forwards this driver gave
// out: port -> VM id. A port is chosen free (bound and let go) and kept out
// of other VMs' reach even while its QEMU is not running.
type hostPorts struct {
	mu    sync.Mutex
	owner map[int]string
}

// take returns a host port for a forward of vm: want when it is vm's or free.
func (p *hostPorts) take(vm string, want int) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.owner == nil {
		p.owner = map[int]string{}
	}
	if want != 0 {
		if o, ok := p.owner[want]; (!ok || o == vm) && portFree(want) {
			p.owner[want] = vm
			return want, nil
		}
	}
	for range 64 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, fmt.Errorf("find a free port on 127.0.0.1: %w", err)
		}
		port := ln.Addr().(*net.TCPAddr).Port
		_ = ln.Close()
		if _, used := p.owner[port]; !used {
			p.owner[port] = vm
			return port, nil
		}
	}
	return 0, errors.New("no free port on 127.0.0.1 after 64 tries")
}

func portFree(port int) bool {
	ln, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port))
	if err != nil {
		return false
	}
	_ = ln.Close()
	return true
}

func (p *hostPorts) keep(vm string, port int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.owner == nil {
		p.owner = map[int]string{}
	}
	p.owner[port] = vm
}

func (p *hostPorts) release(vm string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for port, o := range p.owner {
		if o == vm {
			delete(p.owner, port)
		}
	}
}

// checkNICs refuses a bridge-mode NIC whose bridge this host lacks, a nat
// or overlay NIC whose network overlaps a route of the host the agent did
// not make, and an overlay NIC on an agent without an underlay address.
func (d *Driver) checkNICs(nics []agentapi.NIC) error {
	for _, n := range nics {
		if n.Mode == agentapi.NetworkOverlay && !d.net.Underlay().Addr.IsValid() {
			return agent.ErrInvalidSpec("network %s is an overlay network, and this agent has no underlay address: "+
				"start it with --underlay-address, or place the vm on a host that has one", n.Network)
		}
		if n.Mode == agentapi.NetworkNAT || n.Mode == agentapi.NetworkOverlay {
			cidr, err := netip.ParsePrefix(n.CIDR)
			if err != nil {
				return agent.ErrInvalidSpec("network %s: cidr %q: %v", n.Network, n.CIDR, err)
			}
			if err := network.CheckHostRoutes(n.Network, cidr); err != nil {
				return agent.ErrInvalidSpec("%v", err)
			}
		}
		if n.Mode != agentapi.NetworkBridge {
			continue
		}
		ok, err := network.BridgeExists(n.Bridge)
		if err != nil {
			return err
		}
		if !ok {
			host, _ := os.Hostname()
			return agent.ErrNoBridge(n.Bridge, host)
		}
	}
	return nil
}

// guestNIC is NIC i of m as its guest sees it.
func guestNIC(m *agent.Machine, i int) agentapi.NIC {
	if i < len(m.GuestNICs) {
		return m.GuestNICs[i]
	}
	return m.NICs[i]
}

// attachNICs makes the host side of m's NICs: host ports for user-mode
// forwards (written into m.NICs) and their passt processes, taps, leases
// and rules for the others. It returns QEMU's NIC arguments, the network
// namespace QEMU must run in ("" for the agent's own), and the descriptors
// QEMU inherits (passt's sockets, named by the arguments), for the caller
// to close once QEMU has started.
func (d *Driver) attachNICs(m *agent.Machine, img *image) ([]string, string, []*os.File, error) {
	var args []string
	var files []*os.File
	netns := ""
	dev := "virtio-net-pci"
	if img.Machine == "microvm" {
		dev = "virtio-net-device"
	}
	hasForwards := false
	for i := range m.NICs {
		n := &m.NICs[i]
		id := "net" + strconv.Itoa(i)
		switch n.Mode {
		case agentapi.NetworkUser:
			for j := range n.PortForwards {
				f := &n.PortForwards[j]
				port, err := d.ports.take(m.ID, f.HostPort)
				if err != nil {
					closeAll(files)
					return nil, "", nil, fmt.Errorf("nic %d of vm %s: forward of guest port %d: %w", i, m.ID, f.GuestPort, err)
				}
				f.HostAddress, f.HostPort = "127.0.0.1", port
				hasForwards = true
			}
			// passt, not QEMU's slirp: see passt.go.
			f, err := d.startPasst(m.ID, m.Dir, i, n.PortForwards)
			if err != nil {
				closeAll(files)
				return nil, "", nil, fmt.Errorf("nic %d of vm %s on the user-mode network: %w", i, m.ID, err)
			}
			// QEMU's descriptor 3+k is files[k] (exec.Cmd.ExtraFiles).
			args = append(args, "-netdev", "stream,id="+id+",server=off,addr.type=fd,addr.str="+strconv.Itoa(3+len(files)))
			files = append(files, f)
		case agentapi.NetworkNAT, agentapi.NetworkBridge, agentapi.NetworkOverlay:
			at, err := d.net.Attach(network.Attachment{VMID: m.ID, Key: m.Dir, Index: i, NIC: *n, Guest: guestNIC(m, i), Hostname: m.ID})
			if err != nil {
				closeAll(files)
				return nil, "", nil, fmt.Errorf("nic %d of vm %s on network %s: %w", i, m.ID, n.Network, err)
			}
			if at.NetNS != "" {
				netns = at.NetNS
			}
			args = append(args, "-netdev", "tap,id="+id+",ifname="+at.Tap+",script=no,downscript=no")
		default:
			closeAll(files)
			return nil, "", nil, fmt.Errorf("nic %d of vm %s: unknown mode %q", i, m.ID, n.Mode)
		}
		args = append(args, "-device", dev+",netdev="+id+",mac="+strings.ToLower(guestNIC(m, i).MACAddress))
	}
	if netns != "" && hasForwards {
		closeAll(files)
		return nil, "", nil, fmt.Errorf("vm %s is a child with a nat nic, which runs in a network namespace of its own: "+
			"its user-mode port forwards would listen there, out of reach; give the source vm no port forwards beside nat nics", m.ID)
	}
	return args, netns, files, nil
}

func closeAll(files []*os.File) {
	for _, f := range files {
		_ = f.Close()
	}
}

// AdoptNetwork re-adopts m's NICs after an agent restart: its host ports
// stay its own; taps, bridges and rules are kept as they are (made again
// only if missing) and their DHCP leases served again.
func (d *Driver) AdoptNetwork(_ context.Context, m *agent.Machine) error {
	var errs []error
	for i, n := range m.NICs {
		switch n.Mode {
		case agentapi.NetworkUser:
			for _, f := range n.PortForwards {
				if f.HostPort != 0 {
					d.ports.keep(m.ID, f.HostPort)
				}
			}
			// passt runs on in its own session; QEMU 7.2 cannot join a new
			// one, so a lost passt is only reported.
			if _, record := passtPaths(launchDir(m), i); fileExists(record) && !passtAlive(record) {
				d.log.Warn("the passt process of a user-mode nic is gone: the guest has no network until the vm is stopped and started",
					"vm", m.ID, "nic", i, "record", record)
			}
		case agentapi.NetworkNAT, agentapi.NetworkBridge, agentapi.NetworkOverlay:
			if _, err := d.net.Attach(network.Attachment{VMID: m.ID, Key: m.Dir, Index: i, NIC: n, Guest: guestNIC(m, i), Hostname: m.ID}); err != nil {
				errs = append(errs, fmt.Errorf("nic %d on network %s: %w", i, n.Network, err))
			}
		}
	}
	return errors.Join(errs...)
}

// ReleaseNetwork removes what m's NICs have on the host (the VM's QEMU has
// ended): host ports, passt processes, taps, leases, its namespace, and a
// nat network's bridge and rule when m was its last VM here.
func (d *Driver) ReleaseNetwork(_ context.Context, m *agent.Machine) error {
	d.ports.release(m.ID)
	stopPassts(m.Dir, m.Process.LaunchDir)
	var errs []error
	for i, n := range m.NICs {
		if n.Mode == agentapi.NetworkUser {
			continue
		}
		errs = append(errs, d.net.Detach(m.Dir, i, n))
	}
	return errors.Join(errs...)
}

// Network is the driver's host networking (for tests and operators: its
// leases).
func (d *Driver) Network() *network.Host { return d.net }

// Close stops what the driver runs in the agent's process (DHCP
// responders). VMs, taps, bridges and rules stay for the next agent.
func (d *Driver) Close() { d.net.Close() }

// launchDir is the directory m's QEMU was started in (pidfileOf).
func launchDir(m *agent.Machine) string {
	if m.Process.LaunchDir != "" {
		return m.Process.LaunchDir
	}
	return m.Dir
}

func fileExists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}
