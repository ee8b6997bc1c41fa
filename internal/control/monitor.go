package control

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
	"github.com/kvmfleet/terraform-provider-kvm/internal/version"
)

const (
	// maxConcurrentSyncs bounds the agents asked at once in a round.
	maxConcurrentSyncs = 64
	// keyCleanupEvery is how often expired idempotency keys are deleted.
	keyCleanupEvery = time.Hour
)

// Run is the host monitor: every SyncInterval it asks each agent for its
// info and its whole VM list (concurrently, each call with a timeout),
// records what it finds, and reloads the host view. It returns when ctx
// ends. A host that misses DeadAfter syncs in a row is marked dead; in the
// first round after start-up one miss is enough, so a host that is down
// when the control API starts is not offered for placement. A dead host
// never delays start-up or the other hosts.
func (s *Service) Run(ctx context.Context) error {
	tick := time.NewTicker(s.opts.SyncInterval)
	defer tick.Stop()
	var lastKeyCleanup time.Time
	// Forks left unfinished by a crash resume once the hosts are known.
	var resume sync.WaitGroup
	defer resume.Wait()
	started := time.Now()
	resume.Go(func() { s.heartbeat(ctx) })
	resume.Go(func() { s.serveOverlayKicks(ctx) })
	for first := true; ; first = false {
		l := s.syncHosts(ctx, first)
		if first {
			resume.Go(func() { s.ResumeForks(ctx, started) })
		} else {
			s.resumeLapsedForks(ctx, l, resume.Go)
		}
		s.resumeDrains(ctx, l, resume.Go)
		if time.Since(lastKeyCleanup) >= keyCleanupEvery {
			if n, err := s.store.DeleteExpiredIdempotencyKeys(ctx); err != nil {
				s.log.Warn("delete expired idempotency keys", "err", err)
			} else if n > 0 {
				s.log.Info("deleted expired idempotency keys", "count", n)
			}
			if n, err := s.store.DeleteExpiredUISessionRevocations(ctx); err != nil {
				s.log.Warn("delete expired fleet page session revocations", "err", err)
			} else if n > 0 {
				s.log.Info("deleted expired fleet page session revocations", "count", n)
			}
			if n, err := s.store.DeleteOldTombstones(ctx, tombstoneAge); err != nil {
				s.log.Warn("delete old vm tombstones", "err", err)
			} else if n > 0 {
				s.log.Info("deleted old vm tombstones", "count", n)
			}
			lastKeyCleanup = time.Now()
		}
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		case <-s.drains.kick:
			// A drain was asked for: start its pass now, not a round later.
			s.resumeDrains(ctx, s.readLeases(ctx), resume.Go)
			select {
			case <-ctx.Done():
				return nil
			case <-tick.C:
			}
		}
	}
}

// SyncNow runs one round of the host monitor (for tools and tests).
func (s *Service) SyncNow(ctx context.Context) { s.syncHosts(ctx, false) }

func (s *Service) syncHosts(ctx context.Context, first bool) leases {
	// Leases are read before any host's rows: an owner live now that
	// finishes its create meanwhile has changed the row, which the settle
	// writes check.
	l := s.readLeases(ctx)
	hosts, err := s.store.AllHosts(ctx)
	if err != nil {
		if ctx.Err() == nil {
			s.log.Error("host monitor: read hosts", "err", err)
		}
		return l
	}
	sem := make(chan struct{}, maxConcurrentSyncs)
	var wg sync.WaitGroup
	for _, h := range hosts {
		if h.RetiredAt != nil {
			continue // its agent is gone for good: nothing to ask
		}
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			s.syncHost(ctx, h, first, l)
		})
	}
	wg.Wait()
	s.settleMigrations(ctx, l)
	s.pushOverlays(ctx, true)
	s.metrics.vmStates.keepHosts(hosts)
	s.refreshProjectMetrics(ctx)
	if err := s.refreshView(ctx); err != nil && ctx.Err() == nil {
		s.log.Error("host monitor: refresh the host view", "err", err)
	}
	return l
}

func (s *Service) syncHost(ctx context.Context, h store.Host, first bool, l leases) {
	log := s.log.With("host", h.Name, "address", h.Address)
	// The rows are read before the agent is asked: a VM that was past
	// "creating" here must be in the agent's list unless it is gone.
	readAt := time.Now()
	rows, err := s.store.ListVMs(ctx, store.VMFilter{Host: h.Name})
	if err != nil {
		log.Error("host monitor: read vms", "err", err)
		return
	}
	s.metrics.vmStates.setHost(h.Name, readAt, rows)
	c := s.agents.syncClient(h.Address)
	// A host registered before agents joined proves itself first: nothing
	// goes to it with the agent token until its key is pinned.
	err = s.joinUnpinned(ctx, h)
	var info agentapi.Info
	if err == nil {
		info, err = s.agents.info(ctx, c)
	}
	if err == nil {
		if peer := version.FromInfo(info.Release, info.APILevel); !version.Serves(peer.Level) {
			s.refuseAgent(ctx, h, peer)
			return
		}
	}
	var vms []agentapi.VM
	if err == nil {
		vms, err = s.agents.listVMs(ctx, c)
	}
	if err != nil {
		if ctx.Err() != nil {
			return
		}
		deadAfter := s.opts.DeadAfter
		if first || h.AgentKey == "" {
			// An address that has not proved itself is no host to place on.
			deadAfter = 1
		}
		alive, rerr := s.store.RecordHostMissed(ctx, h.Name, deadAfter)
		switch {
		case rerr != nil:
			log.Error("host monitor: record missed sync", "err", rerr)
		case h.Alive && !alive:
			log.Warn("host marked dead: its agent does not answer", "err", err)
			s.refreshHost(ctx, h.Name)
		default:
			log.Debug("host missed a sync", "err", err)
		}
		return
	}
	facts := store.HostFacts{Total: agentResources(info.Capacity), Accel: info.Accel, Driver: info.Driver, Images: info.Images,
		Warm: agentResources(info.Warm), Isolation: info.Isolation, Release: info.Release, APILevel: info.APILevel}
	if err := s.store.RecordHostSeen(ctx, h.Name, facts, capacityOf); err != nil {
		if !errors.Is(err, store.ErrNotFound) {
			log.Error("host monitor: record sync", "err", err)
		}
		return
	}
	if !h.Alive {
		log.Info("host alive: its agent answers again")
		s.refreshHost(ctx, h.Name)
	}
	// Errors are logged inside; the next sync tries again.
	s.syncWarmPool(ctx, h, info.Pool)
	s.syncPrefetch(ctx, h.Name, info.ImageCache)
	s.reconcileVMs(ctx, h.Name, rows, vms, l)
	s.deleteOrphans(ctx, h, c, rows, vms)
	s.settleVolumes(ctx, h, c, l)
	s.settleAttachments(ctx, h, c, l, vms)
	s.settleVolumeMoves(ctx, h, l)
}

// refuseAgent marks a host whose agent is outside the skew contract dead,
// with why on the host (agent_refused), instead of sending it specs it
// cannot read. Its VMs stay as they are; the next sync after the agent is
// upgraded (or rolled back) brings the host back.
func (s *Service) refuseAgent(ctx context.Context, h store.Host, peer version.Peer) {
	why := version.SkewError("control", peer, "agent of host "+h.Name)
	wasAlive, err := s.store.RecordHostRefused(ctx, h.Name, peer.Release, peer.Level, why)
	if err != nil {
		if ctx.Err() == nil {
			s.log.Error("host monitor: record refused agent", "host", h.Name, "err", err)
		}
		return
	}
	if wasAlive || h.AgentRefused != why {
		s.log.Warn("host refused: its agent is outside the version skew contract", "host", h.Name,
			"agent_release", peer.Release, "agent_api_level", peer.Level, "err", why)
		s.refreshHost(ctx, h.Name)
	}
}

// joinUnpinned challenges the agent of a host that has no pinned key
// (registered before agents joined) and pins the key it proves with a join
// proof. A host with a key has nothing to do here.
func (s *Service) joinUnpinned(ctx context.Context, h store.Host) error {
	if h.AgentKey != "" {
		return nil
	}
	key, err := s.agents.verify(ctx, h.Name, h.Address, h.UnderlayAddress, nil, s.agents.syncTimeout)
	if err != nil {
		s.log.Warn("host monitor: the host's address did not prove it is an agent; no calls with the agent token go there",
			"host", h.Name, "address", h.Address, "err", err)
		return err
	}
	if err := s.store.PinHostKey(ctx, h.Name, h.Address, agentapi.EncodeKey(key)); err != nil {
		return err
	}
	s.log.Info("host agent joined: identity key pinned", "host", h.Name, "address", h.Address, "key", agentapi.KeyFingerprint(key))
	return nil
}

// reconcileVMs records the agent's state of each VM and marks the VMs it
// does not have as missing, releasing their capacity.
func (s *Service) reconcileVMs(ctx context.Context, host string, rows []store.VM, vms []agentapi.VM, l leases) {
	onAgent := make(map[string]agentapi.VM, len(vms))
	for _, v := range vms {
		onAgent[v.ID] = v
	}
	for _, row := range rows {
		if row.ObservedState == api.StateMissing {
			if a, ok := onAgent[row.ID]; ok {
				s.reclaimReappeared(ctx, host, row, a)
			}
			continue
		}
		a, ok := onAgent[row.ID]
		if cleanupPending(row) {
			s.finishFailedCreate(ctx, host, row, ok)
			continue
		}
		if _, pending := row.Pending(); pending && ok {
			row = s.settleResize(ctx, host, row, a, l)
		}
		creating := row.ObservedState == api.StateCreating
		switch {
		case !ok && creating && (row.ForkID != nil || !s.abandoned(l, row, time.Since(row.CreatedAt))):
			// Its create is still running (its replica's lease is live);
			// the create records the outcome. A fork's child belongs to its
			// fork's pass, which resumes after a crash (ResumeForks, or
			// resumeLapsedForks on another replica).
		case !ok && creating:
			s.dropUnfinishedCreate(ctx, host, row)
		case !ok:
			reason := fmt.Sprintf("the agent of host %s does not have this VM", host)
			_, released, err := s.store.ReleaseVM(ctx, row.ID, api.StateMissing, reason)
			if err != nil && !errors.Is(err, store.ErrNotFound) {
				s.log.Error("host monitor: mark vm missing", "vm", row.ID, "host", host, "err", err)
			}
			if released {
				s.log.Warn("vm missing on its host; capacity released", "vm", row.ID, "name", row.Name, "host", host)
				s.refreshHost(ctx, host)
			}
		case creating:
			s.settleStuckCreate(ctx, host, row, a, l)
		case a.State == agentapi.StateMigrated:
			// Its migration completed: the switch (the request, or
			// settleMigrations) records the state the target reports.
		case a.State != row.ObservedState || a.Reason != row.Reason || (a.StartedFrom != "" && a.StartedFrom != row.StartedFrom):
			if err := s.store.SetVMState(ctx, row.ID, a.State, a.Reason, a.StartedFrom); err != nil {
				s.log.Error("host monitor: record vm state", "vm", row.ID, "err", err)
			}
		}
	}
}
