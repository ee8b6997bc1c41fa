package control

// Hot attach and detach of volumes: POST /v1/vms/{id}/volumes and DELETE
// /v1/vms/{id}/volumes/{volume}. Each is a database step and an agent
// call; the attachment row says how far it got (attaching, detaching,
// owned by the replica that runs it), so that a replica killed in between
// leaves a row the host monitor settles against the agent's view of the
// VM (settleAttachments): the row never keeps claiming an attachment the
// agent does not have, nor misses one it has.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// AttachVolume attaches a ready volume of the VM's project to VM vmID:
// claim it (DB, attaching) -> agent PUT (hot when the VM runs; a stopped
// VM gets it at its next start) -> attached (DB). The same attachment
// again (same read_only) changes nothing and answers the VM. The answer
// is the VM with its volumes.
func (s *Service) AttachVolume(ctx context.Context, vmID string, in api.VMVolumeAttach) (api.VM, error) {
	if in.Volume == "" {
		return api.VM{}, invalidf("volume is required: a volume's name or id")
	}
	ctx, cancel := detached(ctx, volumeTimeout)
	defer cancel()
	vm, err := s.visibleVM(ctx, vmID)
	if err != nil {
		return api.VM{}, fromStore(err, "read vm "+vmID)
	}
	v, err := s.projectVolume(ctx, vm.Project, in.Volume)
	if err != nil {
		return api.VM{}, err
	}
	if v.HostName != vm.HostName {
		return api.VM{}, &Error{Code: api.CodeInvalid,
			Message: fmt.Sprintf("volume %s (%s) is on host %s and VM %s on host %s: a VM attaches volumes of its own host; move the volume to host %s first (while it is detached), or attach it to a VM on host %s",
				v.Name, v.ID, v.HostName, vm.ID, vm.HostName, vm.HostName, v.HostName),
			Details: map[string]any{"volume_id": v.ID, "volume_host": v.HostName, "vm_id": vm.ID, "vm_host": vm.HostName}}
	}
	if v.State != store.VolumeReady {
		return api.VM{}, conflictf("volume %s (%s) is %s, not ready; retry when it is", v.Name, v.ID, v.State)
	}
	address, alive, _ := s.view.agent(vm.HostName)
	if !alive {
		return api.VM{}, unavailable(nil, "host %s of VM %s does not answer, so nothing was attached; retry when it is back", vm.HostName, vm.ID)
	}
	done, err := s.store.BeginAttach(ctx, vm.ID, v.ID, in.ReadOnly, s.replicaID, api.MaxVMVolumes)
	if err != nil {
		return api.VM{}, s.attachRefused(vm, v, in.ReadOnly, err)
	}
	if done {
		return s.GetVM(ctx, vm.ID)
	}
	agent := s.agents.client(address)
	err = s.agents.call("attach_volume", func() error {
		_, err := agent.AttachVolume(ctx, vm.ID, v.ID, in.ReadOnly)
		return err
	})
	if err != nil {
		s.undoAttach(ctx, agent, vm, v.ID)
		return api.VM{}, fromAgent(err, vm.HostName, fmt.Sprintf("attach volume %s to VM %s", v.ID, vm.ID))
	}
	if err := s.store.FinishAttach(ctx, vm.ID, v.ID); err != nil {
		if errors.Is(err, store.ErrNotFound) {
			// The row went meanwhile (the VM was deleted, or a host
			// monitor undid a step it took for abandoned): the agent
			// must not keep what no row claims.
			s.undoAttach(ctx, agent, vm, v.ID)
			return api.VM{}, conflictf("the attach of volume %s to VM %s was undone meanwhile (the VM was deleted, or the attach was settled as abandoned); read the VM and retry", v.ID, vm.ID)
		}
		// The agent has it; the host monitor finishes the row.
		return api.VM{}, internal(err, "record attach of volume "+v.ID+" to vm "+vm.ID)
	}
	s.log.Info("volume attached", "vm", vm.ID, "volume", v.ID, "host", vm.HostName, "read_only", in.ReadOnly)
	return s.GetVM(ctx, vm.ID)
}

// undoAttach takes back an attach the agent refused or may not have
// finished: the agent detaches it (which also waits for an attach still
// running there), then the row and its claim go. When the agent does not
// confirm, the row stays attaching, handed to this replica's host monitor.
func (s *Service) undoAttach(ctx context.Context, agent *agentapi.Client, vm store.VM, volID string) {
	err := s.agents.call("detach_volume", func() error { return agent.DetachVolume(ctx, vm.ID, volID) })
	if err != nil && !errors.Is(err, agentapi.ErrNotFound) {
		s.log.Warn("undo volume attach: the agent did not confirm the detach; the host monitor settles it",
			"vm", vm.ID, "volume", volID, "host", vm.HostName, "err", err)
		s.handToMonitor(ctx, vm.ID, volID, store.AttachmentAttaching)
		return
	}
	if _, err := s.store.EndAttachment(ctx, vm.ID, volID, store.AttachmentAttaching); err != nil {
		s.log.Error("undo volume attach: give the volume back", "vm", vm.ID, "volume", volID, "err", err)
		s.handToMonitor(ctx, vm.ID, volID, store.AttachmentAttaching)
	}
}

// handToMonitor makes this replica's host monitor the owner of an
// unsettled attachment row, so it settles it at its next round instead of
// after the grace period of a request that might still run.
func (s *Service) handToMonitor(ctx context.Context, vmID, volID, state string) {
	if err := s.store.SetAttachmentOwner(ctx, vmID, volID, state, settlerPrefix+s.replicaID); err != nil {
		s.log.Error("hand an unsettled volume attachment to the host monitor", "vm", vmID, "volume", volID, "err", err)
	}
}

// attachRefused is the answer of an attach the database refused.
func (s *Service) attachRefused(vm store.VM, v store.Volume, readOnly bool, err error) error {
	var (
		ae *store.VolumeAttachedError
		me *store.AttachmentModeError
	)
	switch {
	case errors.As(err, &ae):
		return &Error{Code: api.CodeVolumeAttached, Err: err,
			Message: fmt.Sprintf("volume %s (%s) is attached %s to VM %s; a volume attached read-write belongs to one VM (detach it there first, or attach it read_only everywhere to share it)",
				v.Name, v.ID, attachedMode(ae.ReadOnly), ae.VM),
			Details: map[string]any{"volume_id": v.ID, "vm_id": ae.VM}}
	case errors.As(err, &me):
		return &Error{Code: api.CodeConflict, Err: err,
			Message: fmt.Sprintf("volume %s (%s) is attached to VM %s with read_only %t; detach it first to attach it with read_only %t",
				v.Name, v.ID, vm.ID, me.ReadOnly, readOnly),
			Details: map[string]any{"volume_id": v.ID, "vm_id": vm.ID, "read_only": me.ReadOnly}}
	case errors.Is(err, store.ErrAttachmentBusy):
		return conflictf("an attach or detach of volume %s on VM %s has not finished (or was left by a stopped control replica; the host monitor settles it within a few sync intervals); retry shortly", v.ID, vm.ID)
	case errors.Is(err, store.ErrTooManyVolumes):
		return &Error{Code: api.CodeInvalid, Err: err,
			Message: fmt.Sprintf("VM %s has %d volumes, the most a VM can have; detach one first", vm.ID, api.MaxVMVolumes),
			Details: map[string]any{"vm_id": vm.ID, "max_volumes": api.MaxVMVolumes}}
	case errors.Is(err, store.ErrVMNotAttachable):
		return conflictf("VM %s is %s: volumes attach to a VM that is created and not gone (%v)", vm.ID, vm.ObservedState, err)
	case errors.Is(err, store.ErrVolumeNotReady):
		return conflictf("volume %s (%s) is not ready on host %s (%v); retry when it is", v.Name, v.ID, vm.HostName, err)
	}
	return fromStore(err, fmt.Sprintf("attach volume %s to vm %s", v.ID, vm.ID))
}

func attachedMode(readOnly bool) string {
	if readOnly {
		return "read-only"
	}
	return "read-write"
}

// DetachVolume detaches volume ref from VM vmID: detaching (DB) -> agent
// DELETE (hot when the VM runs: the guest is told and QEMU closes the
// file) -> the row and the volume's claim go (DB). A volume that is not
// attached to the VM is no error (nothing changes); an unknown volume or
// VM is not_found.
func (s *Service) DetachVolume(ctx context.Context, vmID, ref string) error {
	ctx, cancel := detached(ctx, volumeTimeout)
	defer cancel()
	vm, err := s.visibleVM(ctx, vmID)
	if err != nil {
		return fromStore(err, "read vm "+vmID)
	}
	v, err := s.projectVolume(ctx, vm.Project, ref)
	if err != nil {
		return err
	}
	address, alive, _ := s.view.agent(vm.HostName)
	steps, err := s.store.AttachmentStepsOfVM(ctx, vm.ID)
	if err != nil {
		return fromStore(err, "read volumes of vm "+vm.ID)
	}
	attached := false
	for _, a := range steps {
		attached = attached || a.VolumeID == v.ID
	}
	if !attached {
		return nil
	}
	if !alive {
		return unavailable(nil, "host %s of VM %s does not answer, so volume %s stays attached; retry when it is back", vm.HostName, vm.ID, v.ID)
	}
	if _, err := s.store.BeginDetach(ctx, vm.ID, v.ID, s.replicaID); err != nil {
		switch {
		case errors.Is(err, store.ErrNotFound):
			return nil // detached meanwhile
		case errors.Is(err, store.ErrAttachmentBusy):
			return conflictf("volume %s is being attached to VM %s (or that attach was left by a stopped control replica; the host monitor settles it within a few sync intervals); retry shortly", v.ID, vm.ID)
		}
		return fromStore(err, fmt.Sprintf("detach volume %s from vm %s", v.ID, vm.ID))
	}
	agent := s.agents.client(address)
	err = s.agents.call("detach_volume", func() error { return agent.DetachVolume(ctx, vm.ID, v.ID) })
	if err != nil && !errors.Is(err, agentapi.ErrNotFound) {
		s.detachFailed(ctx, agent, vm, v.ID)
		return fromAgent(err, vm.HostName, fmt.Sprintf("detach volume %s from VM %s", v.ID, vm.ID))
	}
	if _, err := s.store.EndAttachment(ctx, vm.ID, v.ID, store.AttachmentDetaching); err != nil {
		s.handToMonitor(ctx, vm.ID, v.ID, store.AttachmentDetaching)
		return internal(err, "record detach of volume "+v.ID+" from vm "+vm.ID)
	}
	s.log.Info("volume detached", "vm", vm.ID, "volume", v.ID, "host", vm.HostName)
	return nil
}

// detachFailed settles a detach the agent refused or did not confirm by
// what the agent has now: still attached there (the agent detaches from
// the VMM before its record, so a refused detach left it whole), the row
// is attached again; gone there, the row goes; unknown, the row stays
// detaching for the host monitor.
func (s *Service) detachFailed(ctx context.Context, agent *agentapi.Client, vm store.VM, volID string) {
	var got agentapi.VM
	err := s.agents.call("get_vm", func() (err error) { got, err = agent.GetVM(ctx, vm.ID); return err })
	switch {
	case err == nil && agentHasVolume(got, volID):
		if err := s.store.RestoreAttached(ctx, vm.ID, volID, s.replicaID); err != nil {
			s.log.Error("record a refused volume detach", "vm", vm.ID, "volume", volID, "err", err)
			s.handToMonitor(ctx, vm.ID, volID, store.AttachmentDetaching)
		}
	case err == nil || errors.Is(err, agentapi.ErrNotFound):
		if _, err := s.store.EndAttachment(ctx, vm.ID, volID, store.AttachmentDetaching); err != nil {
			s.log.Error("record a volume detach", "vm", vm.ID, "volume", volID, "err", err)
			s.handToMonitor(ctx, vm.ID, volID, store.AttachmentDetaching)
		}
	default:
		s.handToMonitor(ctx, vm.ID, volID, store.AttachmentDetaching)
	}
}

func agentHasVolume(vm agentapi.VM, volID string) bool {
	for _, a := range vm.Volumes {
		if a.ID == volID {
			return true
		}
	}
	return false
}

// projectVolume reads a volume of project by id or name; anything else
// (another project's, unknown) is the same not_found.
func (s *Service) projectVolume(ctx context.Context, project, ref string) (store.Volume, error) {
	if _, err := uuid.Parse(ref); err == nil {
		v, err := s.store.GetVolume(ctx, ref)
		switch {
		case err == nil && v.Project == project:
			return v, nil
		case err != nil && !errors.Is(err, store.ErrNotFound):
			return store.Volume{}, fromStore(err, "read volume "+ref)
		}
	}
	v, err := s.store.GetVolumeByName(ctx, project, ref)
	if errors.Is(err, store.ErrNotFound) {
		return store.Volume{}, &Error{Code: api.CodeNotFound, Err: err,
			Message: fmt.Sprintf("volume %q does not exist in project %s", ref, project), Details: map[string]any{"volume": ref}}
	}
	if err != nil {
		return store.Volume{}, fromStore(err, "read volume "+ref)
	}
	return v, nil
}

// attachmentState is a row's state on the wire (rows of a VM's create
// read back before the state column existed are attached).
func attachmentState(state string) string {
	if state == "" {
		return api.AttachmentAttached
	}
	return state
}

// settleAttachments finishes or undoes the attach and detach steps a
// replica left on host h, by what its agent lists on each VM (vms, read
// by this round before the rows): an attaching row whose volume the agent
// has is attached again there (idempotent; it makes sure QEMU has it too)
// and marked attached, one the agent does not have is detached there
// (which waits for a call still in flight) and undone; a detaching row is
// detached there and removed.
func (s *Service) settleAttachments(ctx context.Context, h store.Host, c *agentapi.Client, l leases, vms []agentapi.VM) {
	rows, err := s.store.UnsettledAttachments(ctx, h.Name)
	if err != nil {
		s.log.Error("host monitor: read unsettled volume attachments", "host", h.Name, "err", err)
		return
	}
	onAgent := make(map[string]agentapi.VM, len(vms))
	for _, vm := range vms {
		onAgent[vm.ID] = vm
	}
	for _, r := range rows {
		if !s.attachmentAbandoned(l, r) {
			continue
		}
		log := s.log.With("host", h.Name, "vm", r.VMID, "volume", r.VolumeID, "state", r.State)
		// One monitor settles a row: another replica's might act on an
		// older view of the agent.
		if mine := settlerPrefix + s.replicaID; r.Owner == nil || *r.Owner != mine {
			took, err := s.store.TakeOverAttachment(ctx, r, mine)
			if err != nil || !took {
				log.Debug("host monitor: volume attachment taken by another replica or settled", "err", err)
				continue
			}
		}
		avm, known := onAgent[r.VMID]
		if r.State == store.AttachmentAttaching && known && agentHasVolume(avm, r.VolumeID) {
			if err := s.agents.call("attach_volume", func() error {
				_, err := c.AttachVolume(ctx, r.VMID, r.VolumeID, r.ReadOnly)
				return err
			}); err != nil {
				log.Warn("host monitor: finish a volume attach its replica left", "err", err)
				continue
			}
			if err := s.store.FinishAttach(ctx, r.VMID, r.VolumeID); err != nil {
				log.Error("host monitor: record a finished volume attach", "err", err)
				continue
			}
			log.Info("host monitor: finished a volume attach its replica left")
			continue
		}
		if known {
			err := s.agents.call("detach_volume", func() error { return c.DetachVolume(ctx, r.VMID, r.VolumeID) })
			if err != nil && !errors.Is(err, agentapi.ErrNotFound) {
				log.Warn("host monitor: detach a volume whose attach or detach its replica left", "err", err)
				continue
			}
		}
		if _, err := s.store.EndAttachment(ctx, r.VMID, r.VolumeID, r.State); err != nil {
			log.Error("host monitor: release a volume attachment", "err", err)
			continue
		}
		if r.State == store.AttachmentAttaching {
			log.Info("host monitor: undid a volume attach its replica left before the agent had it")
		} else {
			log.Info("host monitor: finished a volume detach its replica left")
		}
	}
}

// attachmentAbandoned reports whether an unsettled attachment row was
// left by its replica: its owner's lease lapsed, it was handed to this
// replica's monitor (or to a monitor whose replica is gone), or (no owner
// known, or this replica, whose requests settle their own rows) it is
// older than the grace period.
func (s *Service) attachmentAbandoned(l leases, r store.AttachmentStep) bool {
	if r.Owner != nil && *r.Owner == settlerPrefix+s.replicaID {
		return true
	}
	if r.Owner == nil || l.live == nil || *r.Owner == s.replicaID {
		return time.Since(r.Since()) >= s.opts.CreateGrace
	}
	return s.abandoned(l, store.VM{Owner: r.Owner}, 0)
}
