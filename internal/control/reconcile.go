package control

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// settleStuckCreate records the agent's state of a VM whose row is still
// "creating" although its agent has it, once the replica that ran the
// create is gone (its lease lapsed; for a row without an owner, past
// CreateGrace): the create died (its replica was killed, or its last
// database write failed and so did the cleanup) after the agent had created
// the VM. The VM runs and its capacity is held, so the row takes the
// agent's state instead of staying "creating" for ever.
func (s *Service) settleStuckCreate(ctx context.Context, host string, row store.VM, a agentapi.VM, l leases) {
	if row.ForkID != nil || !s.abandoned(l, row, time.Since(row.CreatedAt)) {
		return // its create (or its fork's pass) may still run and record the outcome
	}
	if a.State == api.StateCreating {
		return // the agent is still making it: the next round records what it made
	}
	if !s.takeOver(ctx, row) {
		return
	}
	// The forwarded host ports the agent chose were in the answer the dead
	// create never recorded: take them from the agent's report.
	if err := s.recordAgentNICs(ctx, &row, a); err != nil && !errors.Is(err, store.ErrNotFound) {
		s.log.Error("host monitor: record NICs of a stuck create", "vm", row.ID, "host", host, "err", err)
	}
	if err := s.store.MarkVMCreated(ctx, row.ID, a.State, a.Reason, a.StartedFrom); err != nil {
		if !errors.Is(err, store.ErrNotFound) {
			s.log.Error("host monitor: settle stuck create", "vm", row.ID, "host", host, "err", err)
		}
		return
	}
	s.log.Warn("vm create had not finished; recorded the state its agent reports", "vm", row.ID, "name", row.Name,
		"host", host, "state", a.State)
}

// deleteOrphans deletes, on the agent, the VMs that have no row and are
// older than OrphanGrace: nothing accounts for their capacity and no user
// can see them (e.g. a create whose cleanup removed the row while the
// agent was still booting the VM). Only a VM whose row was deleted on
// purpose (it has a tombstone) is deleted; any other may be an
// acknowledged create that the database lost, and is kept for an operator
// (deletedOnPurpose). The rows were read before the agent's
// list, so a VM created since then is young and kept; each candidate's row
// is looked up once more before the delete.
func (s *Service) deleteOrphans(ctx context.Context, h store.Host, c *agentapi.Client, rows []store.VM, vms []agentapi.VM) {
	known := make(map[string]bool, len(rows))
	for _, row := range rows {
		known[row.ID] = true
	}
	unaccounted := 0
	defer func() { s.metrics.unaccounted.WithLabelValues(h.Name).Set(float64(unaccounted)) }()
	for _, v := range vms {
		if known[v.ID] || v.CreatedAt.IsZero() || time.Since(v.CreatedAt) < s.opts.OrphanGrace {
			continue
		}
		row, err := s.store.GetVM(ctx, v.ID)
		if err == nil {
			s.deleteMigrationLeftover(ctx, h, c, row, v)
			continue
		}
		if !errors.Is(err, store.ErrNotFound) {
			s.log.Error("host monitor: look up orphan candidate", "vm", v.ID, "host", h.Name, "err", err)
			continue
		}
		if !s.deletedOnPurpose(ctx, h.Name, v) {
			unaccounted++
			continue
		}
		if err := s.agents.deleteVM(ctx, c, v.ID); err != nil && !errors.Is(err, agentapi.ErrNotFound) {
			s.log.Error("host monitor: delete orphan VM on its agent; the next round retries", "vm", v.ID, "host", h.Name, "err", err)
			continue
		}
		s.log.Warn("deleted a VM that its agent ran without a row in the database", "vm", v.ID, "host", h.Name,
			"created_at", v.CreatedAt)
	}
}

// deleteMigrationLeftover deletes the copy v that agent c of host h has of
// VM row, whose row names another host: a migration's incoming copy that
// its undo could not see (the target made it after the undo's delete), or
// a source's stopped copy that outlived its migration. Only a copy in a
// migration state goes (incoming, migrated, failed: none of them runs the
// guest, and the row's host holds the VM), and only while no migration of
// the VM involves h: an unfinished one settles its own copies. A copy that
// runs is never deleted here.
func (s *Service) deleteMigrationLeftover(ctx context.Context, h store.Host, c *agentapi.Client, row store.VM, v agentapi.VM) {
	switch v.State {
	case agentapi.StateIncoming, agentapi.StateMigrated, agentapi.StateFailed:
	default:
		return
	}
	m, err := s.store.GetMigration(ctx, v.ID)
	switch {
	case err == nil && (m.SourceHost == h.Name || m.TargetHost == h.Name):
		return
	case err != nil && !errors.Is(err, store.ErrNotFound):
		s.log.Error("host monitor: look up the migration of a copy on another host", "vm", v.ID, "host", h.Name, "err", err)
		return
	}
	if err := s.agents.deleteVM(ctx, c, v.ID); err != nil && !errors.Is(err, agentapi.ErrNotFound) {
		s.log.Error("host monitor: delete a migration's leftover copy; the next round retries", "vm", v.ID, "host", h.Name, "err", err)
		return
	}
	s.log.Warn("deleted a copy a migration left on a host the VM does not run on", "vm", v.ID, "host", h.Name,
		"state", v.State, "vm_host", row.HostName)
}

// reclaimReappeared handles a VM marked missing that its agent runs after
// all: an agent that finished a create after the control API had given up
// on it (e.g. killed mid-create), or that re-adopted its VMs late after a
// restart. The VM takes its capacity back if its host still has room;
// otherwise it stays missing, and the reason says how to resolve it.
func (s *Service) reclaimReappeared(ctx context.Context, host string, row store.VM, a agentapi.VM) {
	ok, err := s.store.ReclaimVM(ctx, row.ID, a.State, a.Reason, a.StartedFrom)
	switch {
	case errors.Is(err, store.ErrNoRoom) || errors.Is(err, store.ErrGroupCap):
		lost := "its capacity went to other VMs meanwhile; delete it (or free room on the host)"
		if errors.Is(err, store.ErrGroupCap) {
			lost = fmt.Sprintf("its slot in group %q went to another VM of the group meanwhile (max_per_domain); delete it or another VM of the group", row.Group.Name)
		}
		reason := fmt.Sprintf("the agent of host %s runs this VM again, but %s", host, lost)
		if row.Reason != reason {
			if err := s.store.SetMissingReason(ctx, row.ID, reason); err != nil {
				s.log.Error("host monitor: record reason", "vm", row.ID, "err", err)
			}
			s.log.Error("vm missing but running on its host, which has no room left for it", "vm", row.ID, "host", host)
		}
	case errors.Is(err, store.ErrAddressTaken), errors.Is(err, store.ErrMACTaken):
		reason := fmt.Sprintf("the agent of host %s runs this VM again, but its address or MAC went to another VM meanwhile (%v); delete it", host, err)
		if row.Reason != reason {
			if err := s.store.SetMissingReason(ctx, row.ID, reason); err != nil {
				s.log.Error("host monitor: record reason", "vm", row.ID, "err", err)
			}
			s.log.Error("vm missing but running on its host, and its address is taken", "vm", row.ID, "host", host)
		}
	case err != nil:
		if !errors.Is(err, store.ErrNotFound) {
			s.log.Error("host monitor: reclaim vm", "vm", row.ID, "host", host, "err", err)
		}
	case ok:
		s.log.Warn("vm marked missing runs on its host again; capacity reserved again", "vm", row.ID, "name", row.Name,
			"host", host, "state", a.State)
		s.refreshHost(ctx, host)
	}
}

// dropUnfinishedCreate removes the row of a create whose replica is gone
// (lease lapsed, or past CreateGrace without an owner) and that its agent
// does not have: the create died
// before the agent made the VM (or its cleanup could not reach the
// database), and no caller was ever told it exists. Removing the row, as
// the create's own cleanup would have, frees its capacity and its name
// for the caller's retry. Should the agent still make the VM later, it is
// a VM without a row, which deleteOrphans removes.
func (s *Service) dropUnfinishedCreate(ctx context.Context, host string, row store.VM) {
	if !s.takeOver(ctx, row) {
		return
	}
	// The dead replica's PUT may still be finishing on the agent: delete it
	// there first (as the create's own cleanup would), so that no VM is
	// left running without a row.
	if err := s.deleteOnAgent(ctx, host, row.ID); err != nil {
		s.log.Warn("host monitor: delete unfinished create on its agent; the next round retries", "vm", row.ID, "host", host, "err", err)
		return
	}
	if err := s.forgetVM(ctx, row.ID, host); err != nil {
		s.log.Error("host monitor: drop unfinished create", "vm", row.ID, "host", host, "err", err)
		return
	}
	s.log.Warn("vm create never reached its agent; row removed and capacity released", "vm", row.ID, "name", row.Name, "host", host)
}
