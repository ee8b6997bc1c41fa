package control

// Volumes of fork children (issue 26). The fork's snapshot took a frozen
// point of each read-write volume of the source (the agent's
// volume_fork.go); its answer lists the source's volumes with their
// slots. Each child gets, before its agent starts it:
//
//   - for a read-write volume, a volume of its own named
//     "<volume name>-<child name>" in the fork's project, on the child's
//     host: a copy-on-write clone of the frozen point there, or a copy
//     pulled from the source's agent for a spilled child. Its disk is
//     reserved on the child's host and in the project (disk_mib) right
//     after the child's reservation, and it is attached read-write to the
//     child's row. It is a normal volume afterwards: deleting the child
//     detaches it and keeps it, like any VM's volume (volumes are deleted
//     explicitly, DELETE /v1/volumes/{id}).
//   - for a read-only volume, the same volume, attached read-only: the
//     children share it. Such children are placed on the volume's host
//     (the source's) only.
//
// A child's volume rows exist while its row is creating; a child whose
// start fails loses them with its reservation. A pass that dies leaves
// them to the next pass (ResumeForks), which finds them by name and asks
// the agent again (idempotent on the volume's id); a volume row whose
// replica died is finished by the host monitor (settleVolumes) with the
// same source, since the row records the snapshot (source_snapshot).

import (
	"context"
	"errors"
	"fmt"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// forkSnapshotVolumes reads the volumes the fork's snapshot recorded from
// the source's agent.
func (s *Service) forkSnapshotVolumes(ctx context.Context, f store.Fork, srcAddress string) ([]agentapi.SnapshotVolume, error) {
	c := s.agents.client(srcAddress)
	var snap agentapi.Snapshot
	err := s.agents.call("get_snapshot", func() (err error) { snap, err = c.GetSnapshot(ctx, f.ID); return err })
	if err != nil {
		return nil, fromAgent(err, f.SourceHost, "read snapshot of fork "+f.ID)
	}
	return snap.Volumes, nil
}

// sharesVolumes says whether the children share a read-only volume of the
// source, which pins them to its host.
func sharesVolumes(vols []agentapi.SnapshotVolume) bool {
	for _, v := range vols {
		if v.ReadOnly {
			return true
		}
	}
	return false
}

// childVolumeName is the name of child's volume made from source volume
// name.
func childVolumeName(volume, child string) string { return volume + "-" + child }

// forkChildVolumes makes and attaches the volumes of child vm (reserved,
// not started) and returns its attachments for the agent, in the
// snapshot's order.
func (s *Service) forkChildVolumes(ctx context.Context, f store.Fork, vm store.VM, snapVols []agentapi.SnapshotVolume, srcAddress string) ([]agentapi.VolumeAttachment, error) {
	var out []agentapi.VolumeAttachment
	for _, sv := range snapVols {
		if sv.ReadOnly {
			if vm.HostName != f.SourceHost {
				return nil, conflictf("child %s of fork %s is on host %s, but shares read-only volume %s with its source on host %s; children of a vm with read-only volumes run on its host",
					vm.Name, f.ID, vm.HostName, sv.ID, f.SourceHost)
			}
			if err := s.store.AttachForkVolume(ctx, vm.ID, vm.HostName, sv.ID, true); err != nil {
				return nil, s.forkVolumeError(err, vm, sv.ID)
			}
			out = append(out, agentapi.VolumeAttachment{ID: sv.ID, ReadOnly: true})
			continue
		}
		v, err := s.forkChildVolume(ctx, f, vm, sv, srcAddress)
		if err != nil {
			return nil, err
		}
		if err := s.store.AttachForkVolume(ctx, vm.ID, vm.HostName, v.ID, false); err != nil {
			return nil, s.forkVolumeError(err, vm, v.ID)
		}
		out = append(out, agentapi.VolumeAttachment{ID: v.ID})
	}
	return out, nil
}

func (s *Service) forkVolumeError(err error, vm store.VM, vol string) error {
	var ae *store.VolumeAttachedError
	if errors.As(err, &ae) {
		return conflictf("volume %s of child %s is attached to vm %s", vol, vm.Name, ae.VM)
	}
	return fromStore(err, fmt.Sprintf("attach volume %s to child %s", vol, vm.Name))
}

// forkChildVolume makes (or finds, for a retried pass) child vm's volume
// from the frozen point of sv: reserved on the child's host, made by its
// agent, ready.
func (s *Service) forkChildVolume(ctx context.Context, f store.Fork, vm store.VM, sv agentapi.SnapshotVolume, srcAddress string) (store.Volume, error) {
	srcName := sv.ID
	if src, err := s.store.GetVolume(ctx, sv.ID); err == nil {
		srcName = src.Name
	}
	name := childVolumeName(srcName, vm.Name)
	v, err := s.store.GetVolumeByName(ctx, f.Project, name)
	if err == nil && v.State == store.VolumeDeleting && v.SourceSnapshot == f.ID && v.RWVM == nil {
		// A drop of a failed child's volume that a crash cut short:
		// finished here, then the volume is made again.
		if derr := s.finishVolumeDelete(ctx, v); derr != nil {
			return store.Volume{}, derr
		}
		v, err = store.Volume{}, store.ErrNotFound
	}
	switch {
	case err == nil:
		if v.SourceSnapshot != f.ID || v.SourceVolume != sv.ID || v.HostName != vm.HostName ||
			(v.RWVM != nil && *v.RWVM != vm.ID) || v.State == store.VolumeDeleting {
			return store.Volume{}, &Error{Code: api.CodeConflict,
				Message: fmt.Sprintf("volume name %q, for the clone of volume %s that child %s of fork %s gets, is taken by volume %s; delete or rename it and retry the fork",
					name, srcName, vm.Name, f.ID, v.ID),
				Details: map[string]any{"volume": v.ID, "name": name}}
		}
	case errors.Is(err, store.ErrNotFound):
		v = store.Volume{ID: newVolumeID(), Project: f.Project, Name: name, HostName: vm.HostName, SizeMiB: sv.SizeMiB,
			SourceVolume: sv.ID, SourceSnapshot: f.ID, State: store.VolumeCreating, Owner: &s.replicaID}
		if err := s.store.ReserveAndInsertVolume(ctx, v); err != nil {
			return store.Volume{}, s.withShortfall(fromStore(err, fmt.Sprintf("reserve volume %s for child %s on host %s", name, vm.Name, vm.HostName)), sv.SizeMiB)
		}
		s.refreshHost(ctx, vm.HostName)
	default:
		return store.Volume{}, fromStore(err, "read volume "+name)
	}
	// Asked also when the row is ready: the agent's create is idempotent,
	// and makes the volume again from the frozen point should it be gone.
	address, alive, _ := s.view.agent(vm.HostName)
	if !alive {
		return store.Volume{}, unavailable(nil, "host %s of child %s of fork %s does not answer; retry when it is back", vm.HostName, vm.Name, f.ID)
	}
	spec := volumeSpec(v)
	if vm.HostName != f.SourceHost {
		spec.Source.Peer = s.forkVolumePeer(f.SourceHost, srcAddress)
	}
	c := s.agents.client(address)
	err = s.agents.call("create_volume", func() error { _, err := c.CreateVolume(ctx, v.ID, spec); return err })
	if err != nil {
		return store.Volume{}, fromAgent(err, vm.HostName, fmt.Sprintf("make volume %s of child %s of fork %s", name, vm.Name, f.ID))
	}
	if v.State != store.VolumeReady {
		if err := s.store.MarkVolumeReady(ctx, v.ID); err != nil && !s.volumeReadyNow(ctx, v.ID, err) {
			return store.Volume{}, fromStore(err, "record volume "+name+" ready")
		}
	}
	v.State = store.VolumeReady
	s.log.Info("fork child volume made", "fork", f.ID, "vm", vm.ID, "volume", v.ID, "name", name, "host", vm.HostName,
		"pulled", vm.HostName != f.SourceHost)
	return v, nil
}

// volumeReadyNow reports whether a volume that MarkVolumeReady did not
// find creating (err) is ready after all: the host monitor, finishing the
// create a dead replica left, may have marked it ready while a resumed
// fork pass made the same volume (the agent's create is idempotent).
func (s *Service) volumeReadyNow(ctx context.Context, id string, err error) bool {
	if !errors.Is(err, store.ErrNotFound) {
		return false
	}
	cur, gerr := s.store.GetVolume(ctx, id)
	return gerr == nil && cur.State == store.VolumeReady
}

// forkVolumePeer is the source's agent that a spilled child's volume is
// pulled from: it proves the key pinned for its host before it gets the
// token.
func (s *Service) forkVolumePeer(srcHost, srcAddress string) *agentapi.VolumePeer {
	return &agentapi.VolumePeer{Agent: agentURL(srcAddress), PublicKey: s.view.agentKey(srcHost)}
}

// forkVolumeSpec is volumeSpec for whoever finishes a volume's create (the
// host monitor): a fork child's volume on another host than its fork's
// source is pulled from the source's agent, as the fork pass asks.
func (s *Service) forkVolumeSpec(ctx context.Context, v store.Volume) agentapi.VolumeSpec {
	spec := volumeSpec(v)
	if v.SourceSnapshot == "" {
		return spec
	}
	f, err := s.store.GetFork(ctx, v.SourceSnapshot)
	if err != nil || f.SourceHost == v.HostName {
		return spec
	}
	if address, _, known := s.view.agent(f.SourceHost); known {
		spec.Source.Peer = s.forkVolumePeer(f.SourceHost, address)
	}
	return spec
}

// dropChildVolumes removes the volumes made for child vm of fork f (after
// its row and agent VM are gone: a failed start) as a volume's delete
// does: marked deleting (owned by this replica), deleted on the agent,
// then the row and its reservation go. A crash in between leaves a
// deleting row that the host monitor (or the next pass) finishes.
func (s *Service) dropChildVolumes(ctx context.Context, f store.Fork, vm store.VM) error {
	vols, err := s.store.ListVolumes(ctx, store.VolumeFilter{Host: vm.HostName})
	if err != nil {
		return fromStore(err, "read volumes of child "+vm.Name)
	}
	var errs []error
	for _, v := range vols {
		if v.SourceSnapshot != f.ID || v.Project != f.Project || v.RWVM != nil || !isChildVolumeOf(v, vm) {
			continue
		}
		d, err := s.store.BeginDeleteVolume(ctx, v.ID, s.replicaID)
		if err != nil {
			errs = append(errs, fromStore(err, "delete volume "+v.Name))
			continue
		}
		if err := s.finishVolumeDelete(ctx, d); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func isChildVolumeOf(v store.Volume, vm store.VM) bool {
	n := len(v.Name) - len(vm.Name) - 1
	return n > 0 && v.Name[n:] == "-"+vm.Name
}
