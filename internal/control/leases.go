package control

import (
	"context"
	"errors"
	"strings"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// Replica leases (docs/guides/architecture.md, "Recovery"). Each replica
// renews a lease row every LeaseInterval. Creates, resizes and forks record
// the replica that runs them; once that replica's lease is older than
// LeaseLapse it is gone, and the host monitor of any replica settles what it
// left: a create from what the agent reports (recorded if the agent has the
// VM, cleaned up and released if not), a resize from the agent's shape, a
// fork by running its pass again. A replica on SQLite is the only one, so
// at start-up it settles everything the previous process left at once.
const (
	defaultLeaseInterval = 2 * time.Second
	defaultLeaseLapse    = 10 * time.Second
)

// ReplicaID is this replica's lease id (new for every process).
func (s *Service) ReplicaID() string { return s.replicaID }

// startLease writes the first heartbeat; on SQLite it also drops the
// leases of every earlier process, which cannot be running any more.
func (s *Service) startLease(ctx context.Context) error {
	if err := s.store.Heartbeat(ctx, s.replicaID, s.startedAt); err != nil {
		return err
	}
	if s.store.Dialect() != store.DialectSQLite {
		return nil
	}
	n, err := s.store.DropOtherReplicas(ctx, s.replicaID)
	if err != nil {
		return err
	}
	if n > 0 {
		s.log.Info("single replica on SQLite: the leases of earlier processes are dropped; what they left unfinished is settled now",
			"replica", s.replicaID, "dropped", n)
	}
	return nil
}

// heartbeat renews the lease every LeaseInterval until ctx ends, then drops
// it (a clean stop: what is left is the other replicas' at once).
func (s *Service) heartbeat(ctx context.Context) {
	tick := time.NewTicker(s.opts.LeaseInterval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			stop, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			defer cancel()
			if err := s.store.DropReplica(stop, s.replicaID); err != nil {
				s.log.Warn("drop replica lease at stop; it lapses by itself", "replica", s.replicaID, "err", err)
			}
			return
		case <-tick.C:
		}
		hctx, cancel := context.WithTimeout(ctx, s.opts.LeaseLapse)
		err := s.store.Heartbeat(hctx, s.replicaID, s.startedAt)
		cancel()
		if err != nil && ctx.Err() == nil {
			s.log.Error("renew replica lease; other replicas settle this replica's creates once it lapses",
				"replica", s.replicaID, "lapse", s.opts.LeaseLapse, "err", err)
		}
	}
}

// leases is what one monitor round knows of the replicas' leases.
type leases struct {
	self string
	live map[string]bool // nil: unknown (the read failed); nothing counts as lapsed
}

// readLeases reads the live replicas for one monitor round.
func (s *Service) readLeases(ctx context.Context) leases {
	live, err := s.store.LiveReplicas(ctx, s.opts.LeaseLapse)
	if err != nil {
		if ctx.Err() == nil {
			s.log.Warn("host monitor: read replica leases; unfinished creates wait for their grace period", "err", err)
		}
		return leases{self: s.replicaID}
	}
	live[s.replicaID] = true
	return leases{self: s.replicaID, live: live}
}

// lapsed reports whether owner's lease has lapsed: its replica is gone and
// will not finish what it started. A nil owner (a row from before leases)
// is not known to have lapsed.
func (l leases) lapsed(owner *string) bool {
	return owner != nil && l.live != nil && !l.live[*owner]
}

// settlerPrefix marks the owner of a VM row that a replica's host monitor
// took over to settle (settlerPrefix + replica id): that replica retries it
// every round until it is settled, and the others leave it alone while its
// lease is live.
const settlerPrefix = "settle:"

// abandoned reports whether VM row's unfinished create or resize was left
// by its replica: its owner's lease lapsed, or (no owner known, or the
// owner is this replica, whose requests clean up after themselves unless a
// database write failed) it is older than the grace period. A row this
// replica's monitor took over counts as abandoned, so that it tries again.
func (s *Service) abandoned(l leases, row store.VM, age time.Duration) bool {
	if row.Owner == nil || l.live == nil || *row.Owner == s.replicaID {
		return age >= s.opts.CreateGrace
	}
	owner := *row.Owner
	if settler, ok := strings.CutPrefix(owner, settlerPrefix); ok {
		return settler == s.replicaID || !l.live[settler]
	}
	return !l.live[owner]
}

// takeOver makes this replica's monitor the settler of a VM row left by a
// lapsed replica; false when another replica took it first (it settles it).
func (s *Service) takeOver(ctx context.Context, row store.VM) bool {
	settler := settlerPrefix + s.replicaID
	if row.Owner != nil && *row.Owner == settler {
		return true
	}
	ok, err := s.store.TakeVM(ctx, row.ID, row.Owner, settler)
	if err != nil {
		s.log.Error("host monitor: take over vm of a lapsed replica", "vm", row.ID, "owner", *row.Owner, "err", err)
		return false
	}
	return ok
}

// resumeLapsedForks runs, in the background, the pass of every unfinished
// fork whose replica's lease has lapsed, once per fork: the replica that
// takes the fork over (a conditional write) runs it. It also runs the due
// retries of this replica's own retrying forks (a failed pass of one of
// its requests, or of an earlier retry).
func (s *Service) resumeLapsedForks(ctx context.Context, l leases, run func(func())) {
	forks, err := s.store.UnfinishedForks(ctx, time.Now().Add(time.Minute))
	if err != nil {
		if ctx.Err() == nil {
			s.log.Error("host monitor: list unfinished forks", "err", err)
		}
		return
	}
	for _, f := range forks {
		if f.Phase == api.ForkRetrying && (f.Owner == nil || *f.Owner == s.replicaID) {
			s.log.Info("retrying a failed fork pass", "fork", f.ID, "failed_attempts", f.Attempts)
			run(func() { s.resumeFork(ctx, f.ID) })
			continue
		}
		if !l.lapsed(f.Owner) {
			continue
		}
		took, err := s.store.TakeFork(ctx, f.ID, f.Owner, s.replicaID)
		if err != nil {
			s.log.Error("host monitor: take over fork of a lapsed replica", "fork", f.ID, "err", err)
			continue
		}
		if !took {
			continue
		}
		s.log.Warn("fork pass left by a replica whose lease lapsed; resuming it here", "fork", f.ID, "owner", *f.Owner)
		run(func() { s.resumeFork(ctx, f.ID) })
	}
}

// deleteOnAgent deletes a VM on its agent; gone already is success.
func (s *Service) deleteOnAgent(ctx context.Context, host, id string) error {
	address, _, known := s.view.agent(host)
	if !known {
		return nil
	}
	err := s.agents.deleteVM(ctx, s.agents.client(address), id)
	if errors.Is(err, agentapi.ErrNotFound) {
		return nil
	}
	return err
}
