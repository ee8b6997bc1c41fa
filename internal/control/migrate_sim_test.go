package control

import (
	"context"
	"fmt"
	"sync"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// simMigrations stands in for the agents' migration API in the control
// tests, over real sim agents and real HTTP: the target's incoming VM is a
// stopped VM created there, and the migration completes on the source's
// third poll, when the source's copy is stopped and the target's started
// (a live one). It is a simulation of the agents' end, for the control
// plane's steps; the agents' own migration is tested with the agents.
type simMigrations struct {
	s  *Service
	mu sync.Mutex
	// by VM id
	runs map[string]*simRun
}

type simRun struct {
	source, target string // agent addresses
	live           bool
	polls          int
	state          string
}

// UseSimMigrations makes s migrate through simMigrations.
func UseSimMigrations(s *Service) {
	s.migrations = &simMigrations{s: s, runs: map[string]*simRun{}}
}

func (m *simMigrations) putIncoming(ctx context.Context, target, id string, spec incomingSpec) (agentapi.VM, error) {
	in := spec.Spec
	in.Stopped = true
	return m.s.agents.createVM(ctx, m.s.agents.client(target), id, in)
}

func (m *simMigrations) migrate(_ context.Context, source, id string, target peerRef, live bool) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if r, ok := m.runs[id]; ok && r.state == agentMigrationRunning {
		return nil
	}
	m.runs[id] = &simRun{source: source, target: target.Address, live: live, state: agentMigrationRunning}
	return nil
}

func (m *simMigrations) migration(ctx context.Context, source, id string) (agentMigration, error) {
	m.mu.Lock()
	r, ok := m.runs[id]
	m.mu.Unlock()
	if !ok || r.source != source {
		return agentMigration{}, errNoAgentMigration
	}
	m.mu.Lock()
	r.polls++
	complete := r.state == agentMigrationRunning && r.polls >= 3
	m.mu.Unlock()
	if complete {
		if _, err := m.s.agents.action(ctx, m.s.agents.client(source), id, agentapi.ActionStop); err != nil {
			return agentMigration{}, fmt.Errorf("sim migration: stop source copy: %w", err)
		}
		if r.live {
			if _, err := m.s.agents.action(ctx, m.s.agents.client(r.target), id, agentapi.ActionStart); err != nil {
				return agentMigration{}, fmt.Errorf("sim migration: start target copy: %w", err)
			}
		}
		m.mu.Lock()
		r.state = agentMigrationCompleted
		m.mu.Unlock()
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	out := agentMigration{State: r.state, Phase: "memory", Transferred: int64(r.polls) << 20, Total: 3 << 20}
	if r.state == agentMigrationCompleted {
		out.Phase, out.Transferred = "done", out.Total
	}
	return out, nil
}

func (m *simMigrations) cancelMigration(_ context.Context, source, id string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	r, ok := m.runs[id]
	if !ok || r.source != source {
		return errNoAgentMigration
	}
	if r.state == agentMigrationCompleted {
		return agentapi.ErrConflict
	}
	r.state = agentMigrationCancelled
	return nil
}
