package sim

import (
	"context"
	"fmt"
	"os"
	"slices"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// DefaultBridges are the bridges a sim host has when Options.Bridges is nil.
var DefaultBridges = []string{"br0"}

// Simulated host ports of port forwards: unique per driver, handed out in
// order and given back when their VM is deleted. No socket is opened: the
// sim says so on each VM's console.
const (
	firstSimPort = 40000
	lastSimPort  = 65535
)

var _ agent.NetworkDriver = (*Driver)(nil)

// checkNICs rejects a bridge-mode NIC on a bridge this simulated host lacks.
func (d *Driver) checkNICs(nics []agentapi.NIC) error {
	bridges := d.opts.Bridges
	if bridges == nil {
		bridges = DefaultBridges
	}
	host, _ := os.Hostname()
	for _, n := range nics {
		if n.Mode == agentapi.NetworkBridge && !slices.Contains(bridges, n.Bridge) {
			return agent.ErrNoBridge(n.Bridge, host+" (sim; its bridges: "+fmt.Sprint(bridges)+")")
		}
	}
	return nil
}

// assignPorts gives each port forward of m a simulated host port on
// 127.0.0.1, keeping those it has.
func (d *Driver) assignPorts(m *agent.Machine) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	for i := range m.NICs {
		for j := range m.NICs[i].PortForwards {
			f := &m.NICs[i].PortForwards[j]
			f.HostAddress = "127.0.0.1"
			if f.HostPort != 0 {
				if owner, ok := d.ports[f.HostPort]; !ok || owner == m.ID {
					d.ports[f.HostPort] = m.ID
					continue
				}
			}
			port, err := d.nextPort()
			if err != nil {
				return fmt.Errorf("sim vm %s: %w", m.ID, err)
			}
			d.ports[port] = m.ID
			f.HostPort = port
		}
	}
	return nil
}

// nextPort is the next free simulated port. The caller holds d.mu.
func (d *Driver) nextPort() (int, error) {
	for range lastSimPort - firstSimPort + 1 {
		p := d.cursor
		d.cursor++
		if d.cursor > lastSimPort {
			d.cursor = firstSimPort
		}
		if _, used := d.ports[p]; !used {
			return p, nil
		}
	}
	return 0, fmt.Errorf("all %d simulated host ports are in use", lastSimPort-firstSimPort+1)
}

// AdoptNetwork takes back the host ports a VM had under an earlier agent.
func (d *Driver) AdoptNetwork(_ context.Context, m *agent.Machine) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, n := range m.NICs {
		for _, f := range n.PortForwards {
			if f.HostPort != 0 {
				d.ports[f.HostPort] = m.ID
			}
		}
	}
	return nil
}

// ReleaseNetwork gives the VM's host ports back.
func (d *Driver) ReleaseNetwork(_ context.Context, m *agent.Machine) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	for p, owner := range d.ports {
		if owner == m.ID {
			delete(d.ports, p)
		}
	}
	return nil
}
