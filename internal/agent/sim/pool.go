package sim

import (
	"context"
	"fmt"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

var _ agent.WarmDriver = (*Driver)(nil)

// WaitReady: a simulated guest is up once its boot returned (BootDelay
// stands for the guest's boot) and it runs.
func (d *Driver) WaitReady(_ context.Context, m *agent.Machine) error {
	d.mu.Lock()
	st := d.state[m.ID]
	d.mu.Unlock()
	if st != agentapi.StateRunning {
		return fmt.Errorf("sim vm %s is not running (%q): it cannot become ready", m.ID, st)
	}
	return nil
}

// Handover moves the simulated VM from from's id to to's.
func (d *Driver) Handover(from, to *agent.Machine) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	st, ok := d.state[from.ID]
	if !ok {
		return fmt.Errorf("sim vm %s does not run: nothing to hand over", from.ID)
	}
	delete(d.state, from.ID)
	d.state[to.ID] = st
	to.Process = from.Process
	return nil
}

// KillOrphan forgets a warm VM a previous agent left.
func (d *Driver) KillOrphan(_ context.Context, m *agent.Machine) error {
	d.forget(m.ID)
	return nil
}

// SetNice has no process to change.
func (d *Driver) SetNice(*agent.Machine, int) error { return nil }

// VMNice is the agent's own priority: simulated VMs have no process.
func (d *Driver) VMNice() int { return 0 }
