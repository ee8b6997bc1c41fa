package control

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/scheduler"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// Steps of a fork pass, as Hooks.ForkStep sees them.
const (
	ForkStepSnapshotStart = "snapshot_start" // before the agent snapshot call
	ForkStepSnapshotTaken = "snapshot_taken" // the agent has the snapshot; the flag is not written yet
	ForkStepFlagWritten   = "flag_written"   // snapshot_taken is durable; no child exists yet
	ForkStepChildReserve  = "child_reserve"  // before a child's reservation
	ForkStepChildReserved = "child_reserved" // the child's row and capacity exist; the agent is not asked yet
	ForkStepChildStart    = "child_start"    // right before the agent is asked to start the child
	ForkStepChildStarted  = "child_started"  // the agent started the child; its row is not updated yet
	ForkStepChildRecorded = "child_recorded" // the child's row says what the agent started
)

// ErrSimulatedCrash, returned by Hooks.ForkStep, stops a fork pass where it
// is, with no cleanup and no further database write: a process that dies.
var ErrSimulatedCrash = errors.New("simulated crash")

// forkConcurrency bounds the children a pass starts at once: each is an
// agent call that may pull a snapshot and restore a guest.
const forkConcurrency = 4

// forkPass brings a fork to its desired state (docs/guides/architecture.md):
// snapshot (idempotent on the fork id) -> snapshot_taken durable -> the
// children slot by slot, each reserved like any VM and recorded right
// after it starts. A child already there is kept and never started again.
// Any interrupted or failed pass can run again from the top. A request's
// pass (fresh) starts a new count of failed attempts; a retry of the host
// monitor continues the count (recordForkFailure).
func (s *Service) forkPass(ctx context.Context, id string, fresh bool) (api.Fork, error) {
	unlock := s.forkLocks.lock(id)
	defer unlock()
	return s.forkPassLocked(ctx, id, fresh)
}

// forkPassLocked is forkPass for a caller that holds the fork's lock.
func (s *Service) forkPassLocked(ctx context.Context, id string, fresh bool) (api.Fork, error) {
	f, err := s.store.GetFork(ctx, id)
	if err != nil {
		return api.Fork{}, fromStore(err, "read fork "+id)
	}
	failedBefore := f.Attempts
	if fresh {
		failedBefore = 0
	}
	// A simulated crash cancels the rest of the pass (the other children).
	ctx, crash := context.WithCancelCause(ctx)
	defer crash(nil)
	err = s.runForkPass(ctx, crash, id)
	if crashed(ctx) || errors.Is(err, ErrSimulatedCrash) {
		return api.Fork{}, internal(ErrSimulatedCrash, "fork "+id+": pass stopped by a simulated crash")
	}
	if err != nil {
		next := s.recordForkFailure(ctx, id, failedBefore+1, err)
		var e *Error
		if errors.As(err, &e) {
			e.Message += "; " + next
			if e.Details == nil {
				e.Details = map[string]any{}
			}
			e.Details["fork_id"] = id
		}
		return api.Fork{}, err
	}
	if err := s.store.SetForkReady(ctx, id); err != nil {
		return api.Fork{}, fromStore(err, "record fork "+id+" ready")
	}
	return s.GetFork(ctx, id)
}

// recordForkFailure records the attempts-th failed pass in a row: retrying
// with a backoff (ForkRetryBackoff, doubling) while attempts remain, else
// failed for good, so that no replica runs it again by itself. It returns
// what happens next, for the error message.
func (s *Service) recordForkFailure(ctx context.Context, id string, attempts int, cause error) string {
	phase, next := api.ForkFailed, fmt.Sprintf(
		"fork %s failed %d passes in a row and is kept in phase failed; a retry of the request, a PATCH or DELETE /v1/forks/%s continues",
		id, attempts, id)
	var retryAt *time.Time
	if attempts < api.MaxForkAttempts {
		at := time.Now().Add(s.opts.ForkRetryBackoff << (attempts - 1))
		phase, retryAt = api.ForkRetrying, &at
		next = fmt.Sprintf("fork %s is kept in phase retrying: attempt %d of %d failed, the next runs at %s (a retry, a PATCH or DELETE /v1/forks/%s continues now)",
			id, attempts, api.MaxForkAttempts, at.UTC().Format(time.RFC3339), id)
	}
	if err := s.store.RecordForkFailure(ctx, id, phase, cause.Error(), attempts, retryAt); err != nil {
		s.log.Error("record failed fork pass", "fork", id, "err", err)
	}
	if phase == api.ForkFailed {
		s.log.Warn("fork failed for good: no replica retries it by itself", "fork", id, "attempts", attempts, "err", cause)
	}
	return next
}

func crashed(ctx context.Context) bool { return errors.Is(context.Cause(ctx), ErrSimulatedCrash) }

// step runs the test hook of one step.
func (s *Service) step(ctx context.Context, crash context.CancelCauseFunc, id, step string, slot int) error {
	hook := s.hooks.ForkStep
	if hook == nil {
		return nil
	}
	err := hook(ctx, id, step, slot)
	if errors.Is(err, ErrSimulatedCrash) {
		crash(ErrSimulatedCrash)
	}
	return err
}

func (s *Service) runForkPass(ctx context.Context, crash context.CancelCauseFunc, id string) error {
	f, err := s.store.GetFork(ctx, id)
	if err != nil {
		return fromStore(err, "read fork "+id)
	}
	if f.Owner == nil || *f.Owner != s.replicaID {
		// This replica runs the pass now: should it die, its lease says so.
		if err := s.store.SetForkOwner(ctx, id, s.replicaID); err != nil {
			return fromStore(err, "record the replica running fork "+id)
		}
	}
	srcAddress, srcAlive, known := s.view.agent(f.SourceHost)
	if !known || !srcAlive {
		return unavailable(nil, "host %s of the source VM %s of fork %s does not answer; retry when it is back", f.SourceHost, f.SourceVMID, id)
	}
	if !f.SnapshotTaken {
		if err := s.takeForkSnapshot(ctx, crash, f, srcAddress); err != nil {
			return err
		}
	}
	if err := s.store.SetForkPhase(ctx, id, api.ForkSpawning, ""); err != nil {
		return fromStore(err, "record phase of fork "+id)
	}
	// The source's volumes as the snapshot took them (fork_volumes.go).
	snapVols, err := s.forkSnapshotVolumes(ctx, f, srcAddress)
	if err != nil {
		return err
	}
	children, err := s.forkChildren(ctx, id)
	if err != nil {
		return err
	}
	bySlot := map[int]store.VM{}
	for _, c := range children {
		bySlot[slotOf(c)] = c
	}
	// Fewer children: remove the highest slots first.
	for i := len(children) - 1; i >= 0; i-- {
		c := children[i]
		if slotOf(c) < f.Count {
			break
		}
		if err := s.DeleteVM(ctx, c.ID); err != nil && !isCode(err, api.CodeNotFound) {
			return err
		}
		delete(bySlot, slotOf(c))
	}
	var (
		starts  []store.VM
		failure error
	)
	for slot := range f.Count {
		if c, ok := bySlot[slot]; ok {
			switch c.ObservedState {
			case api.StateCreating:
				// Reserved by a pass that did not record the start: ask the
				// agent again; its create is idempotent on the child's id.
				starts = append(starts, c)
				continue
			case api.StateMissing, api.StateLost:
				// Its agent (or host) lost it and its capacity is released: make it again.
				if err := s.DeleteVM(ctx, c.ID); err != nil && !isCode(err, api.CodeNotFound) {
					return err
				}
			default:
				continue // there already: kept as it is, never started again
			}
		}
		vm, err := s.reserveChild(ctx, crash, f, slot, sharesVolumes(snapVols))
		if err != nil {
			failure = err
			break // later slots would fail the same way; those reserved still start
		}
		starts = append(starts, vm)
	}
	if crashed(ctx) {
		return ErrSimulatedCrash
	}
	errs := s.startChildren(ctx, crash, f, srcAddress, snapVols, starts)
	if crashed(ctx) {
		return ErrSimulatedCrash
	}
	if failure != nil {
		errs = append([]error{failure}, errs...)
	}
	return joinForkErrors(errs)
}

// takeForkSnapshot asks the source's agent for the snapshot (idempotent on
// the fork id: a second call returns the first snapshot), then makes
// snapshot_taken durable. Until that write commits no child may exist.
func (s *Service) takeForkSnapshot(ctx context.Context, crash context.CancelCauseFunc, f store.Fork, srcAddress string) error {
	if err := s.store.SetForkPhase(ctx, f.ID, api.ForkSnapshotting, ""); err != nil {
		return fromStore(err, "record phase of fork "+f.ID)
	}
	if err := s.step(ctx, crash, f.ID, ForkStepSnapshotStart, -1); err != nil {
		return internal(err, "snapshot for fork "+f.ID)
	}
	spec := agentapi.SnapshotSpec{VMID: f.SourceVMID, PauseSource: f.PauseSource}
	if _, err := s.agents.createSnapshot(ctx, s.agents.client(srcAddress), f.ID, spec); err != nil {
		return fromAgent(err, f.SourceHost, fmt.Sprintf("snapshot VM %s for fork %s", f.SourceVMID, f.ID))
	}
	if err := s.step(ctx, crash, f.ID, ForkStepSnapshotTaken, -1); err != nil {
		return internal(err, "record snapshot of fork "+f.ID)
	}
	if err := s.store.MarkForkSnapshotTaken(ctx, f.ID); err != nil {
		return fromStore(err, "record snapshot of fork "+f.ID)
	}
	s.log.Info("fork snapshot taken", "fork", f.ID, "source", f.SourceVMID, "host", f.SourceHost)
	return s.step(ctx, crash, f.ID, ForkStepFlagWritten, -1)
}

// reserveChild inserts slot's child row with its capacity reserved, exactly
// like a VM create: colocate pins the source host first and falls back to
// normal placement when it is full; spread uses normal placement. A child
// that shares read-only volumes with its source (pinned) is placed on the
// source's host only.
func (s *Service) reserveChild(ctx context.Context, crash context.CancelCauseFunc, f store.Fork, slot int, pinned bool) (store.VM, error) {
	if err := s.step(ctx, crash, f.ID, ForkStepChildReserve, slot); err != nil {
		return store.VM{}, internal(err, fmt.Sprintf("reserve child %d of fork %s", slot, f.ID))
	}
	forkID, slotN := f.ID, slot
	project, err := s.store.GetProject(ctx, f.Project)
	if err != nil {
		return store.VM{}, fromStore(err, fmt.Sprintf("read project %s of fork %s", f.Project, f.ID))
	}
	vm := store.VM{
		ID: newID(), Name: childName(f.ID, slot), Project: f.Project, Image: f.Image, Resources: f.Resources,
		PowerState: api.PowerRunning, ObservedState: api.StateCreating, ForkID: &forkID, ForkSlot: &slotN,
		Labels: map[string]string{}, Constraints: f.Constraints, GuestAgent: f.GuestAgent, SecureBoot: f.SecureBoot,
	}
	// A child is a new instance: a seed of its own (its id, its name), read
	// by cloud-init at the child's next boot.
	vm.Guest = childGuest(f.Guest, vm.Name)
	// Each child gets NICs of its own on the source's networks: its own
	// MACs, and addresses allocated with its reservation.
	nics, err := s.resolveNICs(ctx, vm.ID, f.Project, forkNICs(f.NICs))
	if err != nil {
		return store.VM{}, err
	}
	req := scheduler.Request{Image: f.Image, Resources: schedResources(f.Resources), Constraints: childConstraints(f, project)}
	if img, ierr := s.store.GetImage(ctx, f.Image); ierr == nil {
		req.ImageSHA256 = img.SHA256 // a registered image: any host fetches it
	}
	err = errNoPin
	if pinned {
		req.Host = f.SourceHost
	}
	if f.Placement == api.PlacementColocate && !pinned {
		pinned := req
		pinned.Host = f.SourceHost
		err = s.placeAndReserve(ctx, &vm, nics, pinned)
	}
	if isCode(err, api.CodeNoCapacity) || errors.Is(err, errNoPin) {
		err = s.placeAndReserve(ctx, &vm, nics, req)
	}
	if err != nil {
		return store.VM{}, err
	}
	if vm.HostName != f.SourceHost {
		// Recorded before the child is asked to pull, so that a delete
		// finds the copy whatever happens next.
		err := s.store.AddForkSnapshotHost(ctx, f.ID, vm.HostName)
		if err == nil {
			err = s.recordAncestorSnapshotHost(ctx, f, vm.HostName)
		}
		if err != nil {
			if uerr := s.forgetVM(ctx, vm.ID, vm.HostName); uerr != nil {
				s.log.Error("release child reservation", "vm", vm.ID, "err", uerr)
			}
			return store.VM{}, fromStore(err, "record snapshot host of fork "+f.ID)
		}
	}
	if err := s.step(ctx, crash, f.ID, ForkStepChildReserved, slot); err != nil {
		if !crashed(ctx) {
			if uerr := s.forgetVM(ctx, vm.ID, vm.HostName); uerr != nil {
				s.log.Error("release child reservation", "vm", vm.ID, "err", uerr)
			}
		}
		return store.VM{}, internal(err, fmt.Sprintf("start child %d of fork %s", slot, f.ID))
	}
	return vm, nil
}

var errNoPin = errors.New("no pinned placement")

// childNICs pairs a reserved child's stored NICs (MACs and addresses from
// its reservation) with their networks, for the agent's spawn spec.
func (s *Service) childNICs(ctx context.Context, vm store.VM) (vmNICs, error) {
	p := vmNICs{nics: vm.NICs}
	for _, nic := range vm.NICs {
		n, err := s.networks.get(ctx, s.store, nic.Network)
		if err != nil {
			return vmNICs{}, fromStore(err, fmt.Sprintf("read network %s of child %s", nic.Network, vm.Name))
		}
		p.nets = append(p.nets, n)
	}
	return p, nil
}

// childConstraints are the scheduler constraints of f's children: the
// fork's, in the group they name or else in a group of the fork's own
// (its id) when they spread or cap.
func childConstraints(f store.Fork, project store.Project) scheduler.Constraints {
	c := parseConstraints(f.Constraints)
	if c != nil && c.Group == "" && (c.SpreadBy != "" || c.MaxPerDomain > 0) {
		c.Group = "fork-" + f.ID
	}
	return schedConstraints(projectConstraints(c, project))
}

func childName(forkID string, slot int) string { return fmt.Sprintf("%s-%d", forkID, slot) }

// startChildren starts the reserved children, forkConcurrency at a time.
func (s *Service) startChildren(ctx context.Context, crash context.CancelCauseFunc, f store.Fork, srcAddress string, snapVols []agentapi.SnapshotVolume, vms []store.VM) []error {
	var (
		mu   sync.Mutex
		errs []error
		wg   sync.WaitGroup
	)
	sem := make(chan struct{}, forkConcurrency)
	for _, vm := range vms {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			if err := s.startChild(ctx, crash, f, srcAddress, snapVols, vm); err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return errs
}

// startChild asks the child's agent to start it from the snapshot and
// records the answer. A failure undoes it like a failed VM create: the
// agent deletes the child before its capacity is released.
func (s *Service) startChild(ctx context.Context, crash context.CancelCauseFunc, f store.Fork, srcAddress string, snapVols []agentapi.SnapshotVolume, vm store.VM) error {
	if crashed(ctx) {
		return ErrSimulatedCrash
	}
	slot := slotOf(vm)
	address, alive, _ := s.view.agent(vm.HostName)
	if !alive {
		return unavailable(nil, "host %s of child %s of fork %s does not answer; retry when it is back", vm.HostName, vm.Name, f.ID)
	}
	agent := s.agents.client(address)
	chain := &cleanup{log: s.log.With("vm", vm.ID, "host", vm.HostName, "fork", f.ID)}
	if len(snapVols) > 0 {
		// Last: once the child's row (which detaches them) is gone.
		chain.push("delete child volumes", func(ctx context.Context) error { return s.dropChildVolumes(ctx, f, vm) })
	}
	chain.push("release capacity", func(ctx context.Context) error { return s.forgetVM(ctx, vm.ID, vm.HostName) })
	chain.push("delete on agent", func(ctx context.Context) error {
		err := s.agents.deleteVM(ctx, agent, vm.ID)
		if errors.Is(err, agentapi.ErrNotFound) {
			return nil
		}
		return err
	})
	src := &agentapi.SnapshotSource{ID: f.ID}
	if vm.HostName != f.SourceHost {
		// The child's agent pulls from the source's, and sends its token
		// there only once the key pinned for the source host signs.
		src.Address, src.PublicKey = agentURL(srcAddress), s.view.agentKey(f.SourceHost)
	}
	nics, err := s.childNICs(ctx, vm)
	if err != nil {
		return s.failCreate(ctx, chain, vm, err)
	}
	spec := agentapi.VMSpec{Image: vm.Image, VCPUs: vm.Resources.VCPUs, MemoryMiB: vm.Resources.MemoryMiB,
		DiskMiB: vm.Resources.DiskMiB, Snapshot: src, NICs: agentNICs(nics), Seed: seedSpec(vm.ID, vm.Guest),
		HostCapacity: s.view.hostCapacity(vm.HostName), GuestAgent: vm.GuestAgent}
	if img, ierr := s.store.GetImage(ctx, vm.Image); ierr == nil {
		isrc := s.imageSource(img, vm.HostName)
		spec.ImageSource = &isrc
	}
	// Its volumes, made and attached before it starts (fork_volumes.go).
	if len(snapVols) > 0 {
		vols, err := s.forkChildVolumes(ctx, f, vm, snapVols, srcAddress)
		if err != nil {
			return s.failCreate(ctx, chain, vm, err)
		}
		spec.Volumes = vols
	}
	if err := s.step(ctx, crash, f.ID, ForkStepChildStart, slot); err != nil {
		if crashed(ctx) {
			return ErrSimulatedCrash
		}
		return s.failCreate(ctx, chain, vm, internal(err, "start child "+vm.Name))
	}
	created, err := s.agents.createVM(ctx, agent, vm.ID, spec)
	if crashed(ctx) {
		return ErrSimulatedCrash
	}
	if err != nil {
		return s.failCreate(ctx, chain, vm, fromAgent(err, vm.HostName, fmt.Sprintf("start child %s of fork %s", vm.Name, f.ID)))
	}
	if err := s.step(ctx, crash, f.ID, ForkStepChildStarted, slot); err != nil {
		if crashed(ctx) {
			return ErrSimulatedCrash
		}
		return s.failCreate(ctx, chain, vm, internal(err, "record started child "+vm.Name))
	}
	if err := s.recordAgentNICs(ctx, &vm, created); err != nil {
		return s.failCreate(ctx, chain, vm, fromStore(err, "record NICs of child "+vm.Name))
	}
	if err := s.store.MarkVMCreated(ctx, vm.ID, created.State, created.Reason, created.StartedFrom); err != nil {
		return s.failCreate(ctx, chain, vm, fromStore(err, "record started child "+vm.Name))
	}
	chain.commit()
	s.log.Info("fork child started", "fork", f.ID, "vm", vm.ID, "name", vm.Name, "host", vm.HostName, "state", created.State)
	return s.step(ctx, crash, f.ID, ForkStepChildRecorded, slot)
}

// joinForkErrors returns the first error (its code decides the answer) with
// the messages of the others appended.
func joinForkErrors(errs []error) error {
	if len(errs) == 0 {
		return nil
	}
	first := errs[0]
	if len(errs) == 1 {
		return first
	}
	var more []string
	for _, e := range errs[1:] {
		more = append(more, e.Error())
	}
	var e *Error
	if errors.As(first, &e) {
		e.Message += fmt.Sprintf(" (and %d more: %s)", len(more), strings.Join(more, "; "))
		return first
	}
	return errors.Join(errs...)
}
