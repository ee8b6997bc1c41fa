package agent

// Attaching volumes to VMs: at create (VMSpec.Volumes, attached before the
// guest boots) and later (hot when the VM runs). An attachment is part of
// the VM's record; a VM's driver sees its volumes in Machine.Volumes.

import (
	"context"
	"fmt"
	"slices"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// machineVolumes are r's attachments as its driver sees them.
func (a *Agent) machineVolumes(r vmRecord) []MachineVolume {
	var out []MachineVolume
	for _, v := range r.Volumes {
		if mv, ok := a.machineVolume(v); ok {
			out = append(out, mv)
		} else {
			a.log.Error("vm names a volume this agent does not have", "vm", r.ID, "volume", v.ID)
		}
	}
	return out
}

// claimVolumes locks the volumes of a new VM, checks that each exists and
// is free for it, and returns the attachments, in slots 0, 1, ... The
// caller makes them visible in the VM's entry before it unlocks them.
func (a *Agent) claimVolumes(ctx context.Context, vm string, want []agentapi.VolumeAttachment) (volumeLocks, []vmVolume, error) {
	ids := make([]string, len(want))
	for i, v := range want {
		ids[i] = v.ID
	}
	held, _, err := a.lockVolumes(ctx, ids)
	if err != nil {
		return nil, nil, err
	}
	out := make([]vmVolume, len(want))
	for i, v := range want {
		if err := a.checkVolumeFree(v.ID, vm, v.ReadOnly); err != nil {
			held.unlock()
			return nil, nil, err
		}
		out[i] = vmVolume{ID: v.ID, ReadOnly: v.ReadOnly, Slot: i}
	}
	return held, out, nil
}

// claimIncomingVolumes claims the volumes of an incoming VM as claimVolumes
// does, each in the slot it has on the source (want: the source VM's
// attachments), so that the target's VMM has the source's device layout.
func (a *Agent) claimIncomingVolumes(ctx context.Context, vm string, want []agentapi.VolumeAttachment) (volumeLocks, []vmVolume, error) {
	held, out, err := a.claimVolumes(ctx, vm, want)
	if err != nil {
		return nil, nil, err
	}
	for i := range out {
		out[i].Slot = want[i].Slot
	}
	return held, out, nil
}

// sameVolumes says whether a VM's attachments are the ones a create asks for.
func sameVolumes(have []vmVolume, want []agentapi.VolumeAttachment) bool {
	return slices.EqualFunc(have, want, func(h vmVolume, w agentapi.VolumeAttachment) bool {
		return h.ID == w.ID && h.ReadOnly == w.ReadOnly
	})
}

func wireVolumes(vs []vmVolume) []agentapi.VolumeAttachment {
	var out []agentapi.VolumeAttachment
	for _, v := range vs {
		out = append(out, agentapi.VolumeAttachment{ID: v.ID, ReadOnly: v.ReadOnly, Slot: v.Slot})
	}
	return out
}

func isUp(state string) bool { return state == agentapi.StateRunning || state == agentapi.StatePaused }

// AttachVolume attaches volume vol to VM id: recorded first, then added to
// the running VMM (a stopped VM gets it at its next start). The same
// attachment again makes sure the VMM has it and changes nothing else, so
// a retry after a crash between the two steps completes the attach.
func (a *Agent) AttachVolume(ctx context.Context, id, vol string, readOnly bool) (agentapi.VM, error) {
	if err := checkID(id); err != nil {
		return agentapi.VM{}, err
	}
	if _, _, err := a.volumeRecordOf(vol); err != nil {
		return agentapi.VM{}, err
	}
	vd, err := a.volumer()
	if err != nil {
		return agentapi.VM{}, err
	}
	e, err := a.lockVM(ctx, id, "attach a volume")
	if err != nil {
		return agentapi.VM{}, err
	}
	defer e.unlock()
	r := a.refreshLocked(ctx, e)
	if i := slices.IndexFunc(r.Volumes, func(v vmVolume) bool { return v.ID == vol }); i >= 0 {
		if r.Volumes[i].ReadOnly != readOnly {
			return agentapi.VM{}, errConflict("volume %s is attached to vm %s with read_only %t: detach it first to change that",
				vol, id, r.Volumes[i].ReadOnly)
		}
		if isUp(r.State) {
			mv, _ := a.machineVolume(r.Volumes[i])
			if err := vd.AttachVolume(ctx, machineOf(a, r), mv); err != nil {
				return agentapi.VM{}, fmt.Errorf("attach volume %s to vm %s: %w", vol, id, err)
			}
		}
		return r.wire(), nil
	}
	switch {
	case r.State == agentapi.StateCreating:
		return agentapi.VM{}, errConflict("vm %s is still being created; attach the volume once it is up", id)
	case len(r.Volumes) >= MaxVolumesPerVM:
		return agentapi.VM{}, errInvalid("vm %s has %d volumes, the most a vm can have; detach one first", id, len(r.Volumes))
	case r.Snapshot != "":
		return agentapi.VM{}, errConflict("vm %s was started from a snapshot: volumes cannot be attached to it yet (issue 26)", id)
	}
	held, _, err := a.lockVolumes(ctx, []string{vol})
	if err != nil {
		return agentapi.VM{}, err
	}
	defer held.unlock()
	if err := a.checkVolumeFree(vol, id, readOnly); err != nil {
		return agentapi.VM{}, err
	}
	att := vmVolume{ID: vol, ReadOnly: readOnly, Slot: freeSlot(r.Volumes)}
	before := r
	r.Volumes = append(slices.Clone(r.Volumes), att)
	if err := a.saveRecord(&r); err != nil {
		return agentapi.VM{}, err
	}
	e.set(r)
	if isUp(r.State) {
		mv, _ := a.machineVolume(att)
		if err := vd.AttachVolume(ctx, machineOf(a, r), mv); err != nil {
			// Not attached: the record goes back to say so.
			if serr := a.saveRecord(&before); serr != nil {
				a.log.Error("record a failed volume attach", "vm", id, "volume", vol, "err", serr)
			} else {
				e.set(before)
			}
			return agentapi.VM{}, fmt.Errorf("attach volume %s to vm %s: %w", vol, id, err)
		}
	}
	a.log.Info("volume attached", "vm", id, "volume", vol, "read_only", readOnly, "slot", att.Slot, "hot", isUp(r.State))
	return r.wire(), nil
}

// freeSlot is the lowest hot-plug slot no attachment takes.
func freeSlot(vs []vmVolume) int {
	for s := 0; ; s++ {
		if !slices.ContainsFunc(vs, func(v vmVolume) bool { return v.Slot == s }) {
			return s
		}
	}
}

// DetachVolume detaches volume vol from VM id: removed from the running
// VMM first (which closes its files), then from the record. A volume that
// is not attached is no error.
func (a *Agent) DetachVolume(ctx context.Context, id, vol string) error {
	if err := checkID(id); err != nil {
		return err
	}
	if err := checkVolumeID(vol); err != nil {
		return err
	}
	e, err := a.lockVM(ctx, id, "detach a volume")
	if err != nil {
		return err
	}
	defer e.unlock()
	r := a.refreshLocked(ctx, e)
	i := slices.IndexFunc(r.Volumes, func(v vmVolume) bool { return v.ID == vol })
	if i < 0 {
		return nil
	}
	if r.State == agentapi.StateCreating {
		return errConflict("vm %s is still being created; detach the volume once it is up", id)
	}
	if isUp(r.State) {
		vd, err := a.volumer()
		if err != nil {
			return err
		}
		mv, _ := a.machineVolume(r.Volumes[i])
		mv.ID, mv.Serial, mv.Slot = vol, agentapi.VolumeSerial(vol), r.Volumes[i].Slot
		if err := vd.DetachVolume(ctx, machineOf(a, r), mv); err != nil {
			return fmt.Errorf("detach volume %s from vm %s: %w", vol, id, err)
		}
	}
	r.Volumes = slices.Delete(slices.Clone(r.Volumes), i, i+1)
	if err := a.saveRecord(&r); err != nil {
		return err
	}
	e.set(r)
	a.log.Info("volume detached", "vm", id, "volume", vol, "hot", isUp(r.State))
	return nil
}

// checkCreateVolumes validates the volumes of a new VM before anything is
// made for it.
func (a *Agent) checkCreateVolumes(spec agentapi.VMSpec) error {
	if len(spec.Volumes) == 0 {
		return nil
	}
	if err := checkVolumeAttachments(spec.Volumes); err != nil {
		return err
	}
	// A VM started from a snapshot has them checked against the
	// snapshot's once it is here (checkChildVolumes).
	if _, err := a.volumer(); err != nil {
		return err
	}
	for _, v := range spec.Volumes {
		if _, _, err := a.volumeRecordOf(v.ID); err != nil {
			return errVolumeUnknown(v.ID)
		}
	}
	return nil
}

// volumesDiskMiB is the disk the volumes take: their sizes, as the
// control plane reserves them.
func (a *Agent) volumesDiskMiB() int64 {
	var sum int64
	for _, e := range a.vols.all() {
		if r, _, gone := e.state(); !gone && r != nil {
			sum += r.SizeMiB
		}
	}
	return sum
}
