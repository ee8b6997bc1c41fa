package control

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/scheduler"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

const (
	// migrateTimeout bounds a migration asked for through the API; one
	// that has not completed by then is cancelled on the source, the VM
	// running there.
	migrateTimeout = 15 * time.Minute
	// migrationPoll is how often the source is asked how far it is.
	migrationPoll = 250 * time.Millisecond
)

// Agent migration states (the agent's migration API).
const (
	agentMigrationRunning   = agentapi.MigrationRunning
	agentMigrationCompleted = agentapi.MigrationCompleted
	agentMigrationCancelled = agentapi.MigrationCancelled
)

// peerRef is an agent as the control plane pinned it.
type peerRef struct {
	Address   string
	PublicKey string
}

// incomingSpec is what the target agent is told of a VM it is to receive.
type incomingSpec struct {
	Spec   agentapi.VMSpec
	Source peerRef
	Live   bool
}

// agentMigration is the source agent's answer about a migration.
type agentMigration struct {
	State       string
	Phase       string
	Transferred int64
	Total       int64
	DowntimeMS  int64
	Error       string
}

// errNoAgentMigration: the source agent has no migration of the VM.
var errNoAgentMigration = errors.New("the source agent has no migration of the vm")

// migrationCalls are the agent calls of a migration: the target prepares
// the incoming VM, the source streams it and reports how far it is.
// Addresses are agent addresses as hosts are registered with.
type migrationCalls interface {
	putIncoming(ctx context.Context, target, id string, spec incomingSpec) (agentapi.VM, error)
	migrate(ctx context.Context, source, id string, target peerRef, live bool) error
	migration(ctx context.Context, source, id string) (agentMigration, error)
	cancelMigration(ctx context.Context, source, id string) error
}

// MigrateVM moves VM id to another host (POST /v1/vms/{id}/migrate) and
// answers once it runs there (or, stopped, is recorded there):
//
//  1. reserve (DB): the target's share is held with the create's
//     conditional UPDATE, in the transaction that records the migration
//     (state reserved); the VM row still holds the source's share;
//  2. target agent PUT incoming, source agent POST migrate (moving);
//  3. the source is followed until it reports completed (the progress is
//     recorded for GET /v1/vms/{id});
//  4. switch (DB): the row points at the target and the source's share is
//     released in one transaction (switched);
//  5. source agent DELETE of its stopped copy, then the migration row goes.
//
// A failure before 4 deletes the incoming VM on the target and releases
// the target's share: the VM stays on the source. A crash at any step
// leaves the migration row, which the host monitor finishes or undoes from
// what the agents report (settleMigrations).
func (s *Service) MigrateVM(ctx context.Context, id string, in api.VMMigrate) (api.VM, error) {
	vm, err := s.visibleVM(ctx, id)
	if err != nil {
		return api.VM{}, fromStore(err, "read vm "+id)
	}
	ctx, cancel := detached(ctx, migrateTimeout)
	defer cancel()
	if _, err := s.migrateOnce(ctx, vm, in.Host, ""); err != nil {
		return api.VM{}, err
	}
	return s.GetVM(ctx, id)
}

// migrateOnce migrates vm to host (or to the scheduler's choice when host
// is ""), recording drain as the drain that asked for it; it returns the
// target.
func (s *Service) migrateOnce(ctx context.Context, vm store.VM, host, drain string) (string, error) {
	if err := s.migratable(ctx, vm, host); err != nil {
		return "", err
	}
	m, err := s.reserveTarget(ctx, vm, host, drain)
	if err != nil {
		return "", err
	}
	log := s.log.With("vm", vm.ID, "source", m.SourceHost, "target", m.TargetHost, "live", m.Live)
	log.Info("migration reserved on the target")
	if err := s.migrationStep(ctx, vm.ID, MigrationStepReserved); err != nil {
		return "", err
	}
	if err := s.runMigration(ctx, vm, m); err != nil {
		return "", err
	}
	log.Info("vm migrated")
	return m.TargetHost, nil
}

// Migration steps a test hook can stop a migration at (Hooks.MigrationStep):
// the process dies there, as far as this migration is concerned.
const (
	MigrationStepReserved  = "reserved"  // the target's share is held, no agent asked
	MigrationStepMoving    = "moving"    // the source streams the VM
	MigrationStepCompleted = "completed" // the source reported completed, the row not switched
	MigrationStepSwitched  = "switched"  // the row switched, the source's copy not deleted
)

// ErrSimulatedCrash is what a migration returns when a hook stopped it.
var errMigrationStopped = errors.New("migration stopped by a test hook")

func (s *Service) migrationStep(ctx context.Context, id, step string) error {
	if hook := s.hooks.MigrationStep; hook != nil {
		if err := hook(ctx, id, step); err != nil {
			return internal(fmt.Errorf("%w: %w", errMigrationStopped, err), "migrate vm "+id)
		}
	}
	return nil
}

// migratable refuses what no target could fix: a VM that is not settled,
// a target that is its own host, and a VM with a volume that cannot move
// with it (migrationVolumesRefusal).
func (s *Service) migratable(ctx context.Context, vm store.VM, host string) error {
	switch vm.ObservedState {
	case api.StateCreating:
		return conflictf("VM %s is still being created; migrate it once it is up", vm.ID)
	case api.StateMissing, api.StateLost:
		return conflictf("VM %s is %s on host %s; delete it and create it again", vm.ID, vm.ObservedState, vm.HostName)
	}
	if vm.ForkID != nil {
		return &Error{Code: api.CodeConflict, Details: map[string]any{"vm_id": vm.ID, "reason": "fork-child"},
			Message: fmt.Sprintf("VM %s is a child of fork %s: its disk sits on the fork's snapshot on host %s, so it does not migrate; "+
				"delete it and fork again on another host", vm.ID, *vm.ForkID, vm.HostName)}
	}
	if !vm.HoldsCapacity {
		return conflictf("VM %s holds no capacity on host %s (state %s); it cannot be migrated", vm.ID, vm.HostName, vm.ObservedState)
	}
	if p, pending := vm.Pending(); pending {
		return conflictf("VM %s is being resized to %d vCPUs and %d MiB; migrate it once that has settled", vm.ID, p.VCPUs, p.MemoryMiB)
	}
	if host == vm.HostName {
		return &Error{Code: api.CodeConflict, Details: map[string]any{"vm_id": vm.ID, "host": host, "reason": scheduler.ReasonSource},
			Message: fmt.Sprintf("VM %s runs on host %s already; name another host, or none to let the scheduler choose", vm.ID, host)}
	}
	if host != "" {
		if _, _, known := s.view.agent(host); !known {
			if err := s.refreshView(ctx); err != nil {
				return internal(err, "load hosts")
			}
			if _, _, known := s.view.agent(host); !known {
				return invalidf("host %q is not registered", host)
			}
		}
	}
	if err := s.migrationVolumesRefusal(ctx, vm); err != nil {
		return err
	}
	if m, err := s.store.GetMigration(ctx, vm.ID); err == nil {
		return conflictf("VM %s is being migrated from %s to %s already (%s); retry once that has finished", vm.ID, m.SourceHost, m.TargetHost, m.State)
	}
	if _, alive, _ := s.view.agent(vm.HostName); !alive {
		return unavailable(nil, "host %s of VM %s does not answer; its VM cannot be migrated until it is back (or retire the host)", vm.HostName, vm.ID)
	}
	return nil
}

// migrationRequest is the placement request of vm's target: its shape,
// image, constraints (with its project's host labels), networks and
// volumes, with its own host rejected and the VM counted out of its
// group's domain there.
func (s *Service) migrationRequest(ctx context.Context, vm store.VM, host string) (scheduler.Request, error) {
	req := scheduler.Request{Image: vm.Image, Host: host, Source: vm.HostName, Resources: schedResources(vm.Resources)}
	if img, err := s.store.GetImage(ctx, vm.Image); err == nil {
		req.ImageSHA256 = img.SHA256
	}
	project, err := s.store.GetProject(ctx, vm.Project)
	if err != nil {
		return req, fromStore(err, "read project "+vm.Project)
	}
	c := schedConstraints(projectConstraints(parseConstraints(vm.Constraints), project))
	if vm.Group.Name != "" {
		// The slot the VM holds decides its group, spread and cap.
		c.Group, c.SpreadBy, c.MaxPerDomain = vm.Group.Name, vm.Group.SpreadBy, vm.Group.Cap
	}
	req.Constraints = c
	if err := s.groupFacts(ctx, &req); err != nil {
		return req, err
	}
	if vm.Group.Name != "" && req.Constraints.Counts[vm.Group.Domain] > 0 {
		counts := maps.Clone(req.Constraints.Counts)
		counts[vm.Group.Domain]--
		req.Constraints.Counts = counts
	}
	nets := make([]store.Network, 0, len(vm.NICs))
	for _, nic := range vm.NICs {
		n, err := s.store.GetNetwork(ctx, nic.Network)
		if err != nil {
			return req, fromStore(err, "read network "+nic.Network)
		}
		nets = append(nets, n)
	}
	req.NetworkHosts = networkHosts(nets)
	atts, err := s.store.AttachmentsOfVMs(ctx, []string{vm.ID})
	if err != nil {
		return req, fromStore(err, "read volumes of vm "+vm.ID)
	}
	for _, a := range atts[vm.ID] {
		// The volumes move with the VM: the target must have room for
		// them too (store.BeginMigration reserves them with its disk).
		v, err := s.store.GetVolume(ctx, a.VolumeID)
		if err != nil {
			return req, fromStore(err, "read volume "+a.VolumeID)
		}
		req.Resources.DiskMiB += v.SizeMiB
	}
	return req, nil
}

// reserveTarget chooses the target (the best host that fits, or host) and
// reserves it (store.BeginMigration). No host that fits is 409
// no_capacity naming each host's reason.
func (s *Service) reserveTarget(ctx context.Context, vm store.VM, host, drain string) (store.Migration, error) {
	for range slowRounds {
		req, err := s.migrationRequest(ctx, vm, host)
		if err != nil {
			return store.Migration{}, err
		}
		res := s.view.rankAll(req)
		if len(res.Ranked) == 0 {
			return store.Migration{}, s.noTarget(vm, req, res)
		}
		for _, r := range res.Ranked[:min(len(res.Ranked), slowCandidates)] {
			target, _ := s.view.get(r.Host)
			domain := ""
			if vm.Group.Name != "" {
				domain, _ = req.Constraints.Domain(target)
			}
			m := store.Migration{VMID: vm.ID, SourceHost: vm.HostName, TargetHost: r.Host, DrainHost: drain,
				Live: vm.ObservedState != api.StateStopped, Owner: &s.replicaID}
			m, err := s.store.BeginMigration(ctx, m, domain)
			switch {
			case err == nil:
				s.refreshHost(ctx, r.Host)
				return m, nil
			case errors.Is(err, store.ErrNoRoom), errors.Is(err, store.ErrGroupCap):
				s.metrics.conflicts.Inc()
				s.refreshHost(ctx, r.Host)
				continue
			case errors.Is(err, store.ErrMigrating):
				return store.Migration{}, conflictf("VM %s is being migrated by another request; retry once that has finished", vm.ID)
			case errors.Is(err, store.ErrVolumeNotReady):
				return store.Migration{}, migrationVolumeConflict(vm, err)
			case errors.Is(err, store.ErrResizing):
				return store.Migration{}, conflictf("VM %s is being resized; migrate it once that has settled", vm.ID)
			case errors.Is(err, store.ErrNotFound):
				return store.Migration{}, conflictf("VM %s left host %s or released its capacity meanwhile; GET it to see where it is", vm.ID, vm.HostName)
			default:
				return store.Migration{}, internal(err, "reserve migration of vm "+vm.ID+" on host "+r.Host)
			}
		}
		if err := s.reloadViewSince(ctx, time.Now()); err != nil {
			return store.Migration{}, internal(err, "reload hosts for migration")
		}
	}
	return store.Migration{}, unavailable(nil, "migration of VM %s kept losing reservation races to other requests; retry", vm.ID)
}

// noTarget is the 409 of a migration no host can take: each host's reason.
func (s *Service) noTarget(vm store.VM, req scheduler.Request, res scheduler.Result) error {
	if req.Host != "" {
		res.Rejected = dropOtherHosts(res.Rejected, req.Host)
	}
	rejected := apiRejections(res.Rejected)
	msg := fmt.Sprintf("no host can take VM %s (%d vCPUs, %d MiB memory, %d MiB disk) from host %s: %d hosts rejected it (reasons per host in details)",
		vm.ID, vm.Resources.VCPUs, vm.Resources.MemoryMiB, vm.Resources.DiskMiB, vm.HostName, len(rejected))
	if req.Host != "" && len(res.Rejected) == 1 {
		msg = fmt.Sprintf("host %s cannot take VM %s: %s", req.Host, vm.ID, res.Rejected[0].Detail)
	}
	return &Error{Code: api.CodeNoCapacity, Message: msg,
		Details: map[string]any{"vm_id": vm.ID, "source": vm.HostName, "rejected": rejected, "rejected_total": len(rejected)}}
}

// runMigration runs a reserved migration m of vm on the agents (steps 2 to
// 5 of MigrateVM).
func (s *Service) runMigration(ctx context.Context, vm store.VM, m store.Migration) error {
	srcAddress, _, _ := s.view.agent(m.SourceHost)
	dstAddress, _, _ := s.view.agent(m.TargetHost)
	spec, err := s.incomingSpec(ctx, vm, m, srcAddress)
	if err != nil {
		return s.undoMigration(ctx, m, err)
	}
	if err := s.prepareTargetVolumes(ctx, m, srcAddress, dstAddress); err != nil {
		return s.undoMigration(ctx, m, err)
	}
	if _, err := s.migrations.putIncoming(ctx, dstAddress, vm.ID, spec); err != nil {
		return s.undoMigration(ctx, m, fromAgent(err, m.TargetHost, "prepare incoming VM "+vm.ID))
	}
	if ok, err := s.store.SetMigrationState(ctx, vm.ID, store.MigrationReserved, store.MigrationMoving); err != nil || !ok {
		if err == nil {
			err = fmt.Errorf("the migration of vm %s is no longer reserved", vm.ID)
		}
		return s.undoMigration(ctx, m, internal(err, "record migration of vm "+vm.ID))
	}
	target := peerRef{Address: agentURL(dstAddress), PublicKey: s.view.agentKey(m.TargetHost)}
	if err := s.migrations.migrate(ctx, srcAddress, vm.ID, target, m.Live); err != nil {
		// The source may or may not have started: ask it before undoing.
		return s.settleRunning(ctx, m, fromAgent(err, m.SourceHost, "start migration of VM "+vm.ID))
	}
	if err := s.migrationStep(ctx, vm.ID, MigrationStepMoving); err != nil {
		return err
	}
	for {
		st, err := s.migrations.migration(ctx, srcAddress, vm.ID)
		if err == nil {
			if perr := s.store.SetMigrationProgress(ctx, vm.ID, st.Phase, st.Transferred, st.Total); perr != nil {
				s.log.Warn("record migration progress", "vm", vm.ID, "err", perr)
			}
		}
		switch {
		case err == nil && st.State == agentMigrationCompleted:
			if err := s.migrationStep(ctx, vm.ID, MigrationStepCompleted); err != nil {
				return err
			}
			return s.switchMigration(ctx, m, st)
		case err == nil && st.State != agentMigrationRunning:
			return s.undoMigration(ctx, m, &Error{Code: api.CodeConflict, Details: map[string]any{"vm_id": vm.ID, "target": m.TargetHost},
				Message: fmt.Sprintf("migration of VM %s from %s to %s %s: %s; the VM stays on %s", vm.ID, m.SourceHost, m.TargetHost, st.State, st.Error, m.SourceHost)})
		case errors.Is(err, errNoAgentMigration):
			return s.undoMigration(ctx, m, unavailable(err, "host %s lost the migration of VM %s; the VM stays there", m.SourceHost, vm.ID))
		case err != nil && !errors.Is(err, agentapi.ErrUnavailable):
			return s.settleRunning(ctx, m, fromAgent(err, m.SourceHost, "follow migration of VM "+vm.ID))
		}
		select {
		case <-ctx.Done():
			return s.settleRunning(ctx, m, unavailable(ctx.Err(), "migration of VM %s did not complete in %s; cancelled, the VM stays on %s", vm.ID, migrateTimeout, m.SourceHost))
		case <-time.After(migrationPoll):
		}
	}
}

// incomingSpec is the VM as its target is to run it: the create's spec
// with the NICs it has (same MACs and addresses).
func (s *Service) incomingSpec(ctx context.Context, vm store.VM, m store.Migration, srcAddress string) (incomingSpec, error) {
	p := vmNICs{nics: vm.NICs}
	for _, nic := range vm.NICs {
		n, err := s.store.GetNetwork(ctx, nic.Network)
		if err != nil {
			return incomingSpec{}, fromStore(err, "read network "+nic.Network)
		}
		p.nets = append(p.nets, n)
	}
	spec := agentapi.VMSpec{Image: vm.Image, VCPUs: vm.Resources.VCPUs, MemoryMiB: vm.Resources.MemoryMiB,
		DiskMiB: vm.Resources.DiskMiB, Stopped: !m.Live, NICs: agentNICs(p), NoWarm: true, Seed: seedSpec(vm.ID, vm.Guest),
		HostCapacity: s.view.hostCapacity(m.TargetHost), GuestAgent: vm.GuestAgent, SecureBoot: vm.SecureBoot,
		Volumes: migrationAttachments(m)}
	if img, err := s.store.GetImage(ctx, vm.Image); err == nil {
		src := s.imageSource(img, m.TargetHost)
		spec.ImageSource = &src
		spec.Firmware = img.Firmware
	}
	return incomingSpec{Spec: spec, Live: m.Live,
		Source: peerRef{Address: agentURL(srcAddress), PublicKey: s.view.agentKey(m.SourceHost)}}, nil
}

// settleRunning ends a migration whose source did not answer plainly:
// the source is asked to cancel (a completed one is not undone) and then
// what it reports decides. cause is returned unless the VM moved after all.
func (s *Service) settleRunning(ctx context.Context, m store.Migration, cause error) error {
	ctx, cancel := detached(ctx, 2*s.opts.AgentTimeout+10*time.Second)
	defer cancel()
	srcAddress, _, _ := s.view.agent(m.SourceHost)
	if err := s.migrations.cancelMigration(ctx, srcAddress, m.VMID); err != nil && !errors.Is(err, errNoAgentMigration) &&
		!errors.Is(err, agentapi.ErrConflict) {
		s.log.Warn("migration outcome unknown; the host monitor settles it", "vm", m.VMID, "source", m.SourceHost, "err", err)
		return cause
	}
	st, err := s.migrations.migration(ctx, srcAddress, m.VMID)
	switch {
	case err == nil && st.State == agentMigrationCompleted:
		return s.switchMigration(ctx, m, st)
	case err == nil && st.State == agentMigrationRunning:
		s.log.Warn("migration still runs after a cancel; the host monitor settles it", "vm", m.VMID, "source", m.SourceHost)
		return cause
	case err == nil || errors.Is(err, errNoAgentMigration):
		return s.undoMigration(ctx, m, cause)
	}
	s.log.Warn("migration outcome unknown; the host monitor settles it", "vm", m.VMID, "source", m.SourceHost, "err", err)
	return cause
}

// undoMigration deletes the incoming VM on the target (and the copies of
// its volumes there) and then releases the target's share; the VM and its
// volumes stay on the source. If the target does not
// confirm the delete, the migration row stays for the host monitor.
func (s *Service) undoMigration(ctx context.Context, m store.Migration, cause error) error {
	ctx, cancel := detached(ctx, 2*s.opts.AgentTimeout+10*time.Second)
	defer cancel()
	// A target that runs the VM (running or paused: no longer incoming) has
	// it: the source committed it there and stopped its own copy, whatever
	// the source says now (one killed right after the commit comes back
	// without the record of its migration). That migration completed: it
	// is switched, never undone, which would delete the only running copy.
	if dst, _, known := s.view.agent(m.TargetHost); known {
		onTarget, err := s.agents.getVM(ctx, s.agents.client(dst), m.VMID)
		if err == nil && (onTarget.State == agentapi.StateRunning || onTarget.State == agentapi.StatePaused) {
			s.log.Warn("the migration's target runs the vm: switching to it instead of undoing", "vm", m.VMID,
				"source", m.SourceHost, "target", m.TargetHost, "state", onTarget.State, "cause", cause)
			return s.switchMigration(ctx, m, agentMigration{State: agentMigrationCompleted})
		}
	}
	if err := s.deleteOnAgent(ctx, m.TargetHost, m.VMID); err != nil {
		s.log.Warn("migration failed and the target did not confirm deleting the incoming VM; the host monitor retries",
			"vm", m.VMID, "target", m.TargetHost, "err", err, "cause", cause)
		return cause
	}
	if err := s.deleteMigrationVolumes(ctx, m, m.TargetHost); err != nil {
		s.log.Warn("migration failed and the target did not confirm deleting its copies of the VM's volumes; the host monitor retries",
			"vm", m.VMID, "target", m.TargetHost, "err", err, "cause", cause)
		return cause
	}
	if _, err := s.store.AbortMigration(ctx, m.VMID); err != nil {
		s.log.Error("release migration target", "vm", m.VMID, "target", m.TargetHost, "err", err)
		return cause
	}
	s.refreshHost(ctx, m.TargetHost)
	s.log.Warn("migration undone; the vm stays on its host", "vm", m.VMID, "source", m.SourceHost, "target", m.TargetHost, "cause", cause)
	return cause
}

// switchMigration is steps 4 and 5: the row moves to the target (and the
// source's share is released) once the target runs the VM, then the
// source's copy is deleted.
func (s *Service) switchMigration(ctx context.Context, m store.Migration, st agentMigration) error {
	dstAddress, _, _ := s.view.agent(m.TargetHost)
	onTarget, err := s.agents.getVM(ctx, s.agents.client(dstAddress), m.VMID)
	if err != nil {
		return unavailable(err, "VM %s moved to host %s, which did not confirm it runs it yet; the host monitor records the switch", m.VMID, m.TargetHost)
	}
	vm, switched, err := s.store.SwitchMigration(ctx, m.VMID)
	if err != nil {
		return fromStore(err, "switch vm "+m.VMID+" to host "+m.TargetHost)
	}
	if switched {
		s.refreshHost(ctx, m.SourceHost)
		s.refreshHost(ctx, m.TargetHost)
		if s.onOverlay(ctx, vm.NICs) {
			// Its NICs' entries point at the target from now on.
			s.kickOverlays()
		}
		s.log.Info("vm switched to its migration target", "vm", m.VMID, "source", m.SourceHost, "target", m.TargetHost,
			"downtime_ms", st.DowntimeMS, "state", onTarget.State)
	}
	if mergeAgentNICs(vm.NICs, onTarget.NICs) {
		if err := s.store.SetVMNICs(ctx, vm.ID, vm.NICs); err != nil {
			s.log.Warn("record the target's NICs; the next create or sync records them", "vm", vm.ID, "err", err)
		}
	}
	if err := s.store.SetVMState(ctx, vm.ID, onTarget.State, onTarget.Reason, ""); err != nil {
		s.log.Warn("record vm state after migration", "vm", vm.ID, "err", err)
	}
	if err := s.migrationStep(ctx, m.VMID, MigrationStepSwitched); err != nil {
		return err
	}
	return s.finishSource(ctx, m)
}

// finishSource deletes the source's stopped copy of a switched migration
// (the VM, then its volumes' old copies) and then its row; the host monitor retries when the source does not
// confirm.
func (s *Service) finishSource(ctx context.Context, m store.Migration) error {
	if err := s.deleteOnAgent(ctx, m.SourceHost, m.VMID); err != nil {
		s.log.Warn("vm migrated; its source did not confirm deleting the old copy, the host monitor retries", "vm", m.VMID,
			"source", m.SourceHost, "err", err)
		return nil
	}
	if err := s.deleteMigrationVolumes(ctx, m, m.SourceHost); err != nil {
		s.log.Warn("vm migrated; its source did not confirm deleting the old copies of its volumes, the host monitor retries", "vm", m.VMID,
			"source", m.SourceHost, "err", err)
		return nil
	}
	if _, err := s.store.FinishMigration(ctx, m.VMID); err != nil {
		s.log.Warn("finish migration row; the host monitor retries", "vm", m.VMID, "err", err)
	}
	return nil
}

// settleMigrations is the host monitor's end of migrations whose replica
// is gone (its lease lapsed) or that this replica's own request left
// unfinished for longer than the create grace: the agents' report decides.
// A switched migration only needs the source's copy deleted; an
// unswitched one is switched when the source completed it and the target
// runs the VM, and undone when the source reports none, failed or
// cancelled.
func (s *Service) settleMigrations(ctx context.Context, l leases) {
	ms, err := s.store.ListMigrations(ctx)
	if err != nil {
		if ctx.Err() == nil {
			s.log.Error("host monitor: list migrations", "err", err)
		}
		return
	}
	for _, m := range ms {
		row := store.VM{ID: m.VMID, Owner: m.Owner}
		if !s.abandoned(l, row, time.Since(m.UpdatedAt)) {
			continue
		}
		if !s.takeOverMigration(ctx, m) {
			continue
		}
		s.settleMigration(ctx, m)
	}
}

func (s *Service) takeOverMigration(ctx context.Context, m store.Migration) bool {
	settler := settlerPrefix + s.replicaID
	if m.Owner != nil && *m.Owner == settler {
		return true
	}
	ok, err := s.store.TakeMigration(ctx, m.VMID, m.Owner, settler)
	if err != nil {
		s.log.Error("host monitor: take over migration", "vm", m.VMID, "err", err)
		return false
	}
	return ok
}

func (s *Service) settleMigration(ctx context.Context, m store.Migration) {
	log := s.log.With("vm", m.VMID, "source", m.SourceHost, "target", m.TargetHost, "state", m.State)
	if m.State == store.MigrationSwitched {
		if err := s.finishSource(ctx, m); err == nil {
			log.Warn("host monitor: finished a migration left after its switch")
		}
		return
	}
	srcAddress, srcAlive, _ := s.view.agent(m.SourceHost)
	if !srcAlive {
		log.Warn("host monitor: migration left unfinished and its source does not answer; it is settled once the source is back")
		return
	}
	st, err := s.migrations.migration(ctx, srcAddress, m.VMID)
	switch {
	case err == nil && st.State == agentMigrationCompleted:
		if err := s.switchMigration(ctx, m, st); err != nil {
			log.Warn("host monitor: switch a completed migration; the next round retries", "err", err)
			return
		}
		log.Warn("host monitor: finished a migration left after the source completed it")
	case err == nil && st.State == agentMigrationRunning:
		// Still streaming: the next round looks again (the agent bounds it).
		if perr := s.store.SetMigrationProgress(ctx, m.VMID, st.Phase, st.Transferred, st.Total); perr != nil {
			log.Warn("record migration progress", "err", perr)
		}
	case err == nil || errors.Is(err, errNoAgentMigration):
		// Failed, cancelled, or never started on the source: undone (or,
		// when the target does not confirm the delete, retried next round).
		_ = s.undoMigration(ctx, m, errors.New("migration left unfinished by its replica"))
	default:
		log.Warn("host monitor: ask the source about a migration left unfinished; the next round retries", "err", err)
	}
}

// vmMigrations adds each VM's migration, while it runs, to its answer.
func (s *Service) vmMigrations(ctx context.Context, out []api.VM) {
	ids := make([]string, len(out))
	for i := range out {
		ids[i] = out[i].ID
	}
	ms, err := s.store.MigrationsOf(ctx, ids)
	if err != nil {
		s.log.Warn("read migrations of vms", "err", err)
		return
	}
	for i := range out {
		if m, ok := ms[out[i].ID]; ok {
			out[i].Migration = &api.VMMigration{State: m.State, Source: m.SourceHost, Target: m.TargetHost, Live: m.Live,
				Phase: m.Phase, Transferred: m.Transferred, Total: m.Total, Drain: m.DrainHost}
		}
	}
}

// agentMigrations are the migration calls over the agents' API
// (internal/agentapi), with the pool's clients (timeouts and token).
type agentMigrations struct{ pool *agentPool }

func (a agentMigrations) putIncoming(ctx context.Context, target, id string, spec incomingSpec) (agentapi.VM, error) {
	var out agentapi.VM
	err := a.pool.call("put_incoming", func() error {
		var err error
		out, err = a.pool.client(target).PutIncoming(ctx, id, agentapi.IncomingSpec{Spec: spec.Spec, Live: spec.Live,
			Source: agentapi.PeerRef{Address: spec.Source.Address, PublicKey: spec.Source.PublicKey}})
		return err
	})
	return out, err
}

func (a agentMigrations) migrate(ctx context.Context, source, id string, target peerRef, live bool) error {
	return a.pool.call("migrate", func() error {
		_, err := a.pool.client(source).Migrate(ctx, id, agentapi.MigrateSpec{Live: live,
			Target: agentapi.PeerRef{Address: target.Address, PublicKey: target.PublicKey}})
		return err
	})
}

func (a agentMigrations) migration(ctx context.Context, source, id string) (agentMigration, error) {
	var m agentapi.Migration
	err := a.pool.call("migration", func() error {
		var err error
		m, err = a.pool.client(source).Migration(ctx, id)
		return err
	})
	if errors.Is(err, agentapi.ErrNotFound) {
		return agentMigration{}, fmt.Errorf("vm %s: %w", id, errNoAgentMigration)
	}
	if err != nil {
		return agentMigration{}, err
	}
	return agentMigration{State: m.State, Phase: m.Phase, DowntimeMS: m.DowntimeMS, Error: m.Error,
		Transferred: m.Memory.Transferred + m.Disk.Transferred, Total: m.Memory.Total + m.Disk.Total}, nil
}

func (a agentMigrations) cancelMigration(ctx context.Context, source, id string) error {
	err := a.pool.call("cancel_migration", func() error { return a.pool.client(source).CancelMigration(ctx, id) })
	if errors.Is(err, agentapi.ErrNotFound) {
		return fmt.Errorf("vm %s: %w", id, errNoAgentMigration)
	}
	return err
}
