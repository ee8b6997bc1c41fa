package agent

// The target's side of a migration: PUT /v1/vms/{id}/incoming prepares
// the VM (its record, in state incoming), the source's files channel
// brings its files (and, for a live migration, the target's VMM then
// starts waiting for the stream, paused), the memory and disk channels go
// to the driver, and POST /v1/vms/{id}/incoming/commit runs it (live) or
// records it stopped (cold) once the stream completed.

import (
	"archive/tar"
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// incomingRecord is what a target keeps of a VM prepared for a migration
// (vmRecord.Incoming).
type incomingRecord struct {
	Source agentapi.PeerRef `json:"source"`
	Live   bool             `json:"live"`
	// Files says that the files channel completed: a cold VM is complete;
	// a live one's VMM was started waiting for the stream (Prepared).
	Files    bool `json:"files,omitempty"`
	Prepared bool `json:"prepared,omitempty"`
}

// maxIncomingFiles bounds the files channel of one VM.
const maxIncomingFiles = 64

// PutIncoming prepares VM id for a migration from spec.Source. A second
// call with the same source returns the VM as it is (also once the
// migration completed); another VM or source holding the id is a 409.
func (a *Agent) PutIncoming(ctx context.Context, id string, in agentapi.IncomingSpec) (agentapi.VM, bool, error) {
	if err := checkID(id); err != nil {
		return agentapi.VM{}, false, err
	}
	if _, err := a.migrator(); err != nil {
		return agentapi.VM{}, false, err
	}
	addr, err := agentapi.CheckAddress(in.Source.Address)
	if err != nil {
		return agentapi.VM{}, false, errInvalid("source.address: %v", err)
	}
	key, err := agentapi.DecodeKey(in.Source.PublicKey)
	if err != nil {
		return agentapi.VM{}, false, errInvalid("source.public_key: %v", err)
	}
	if key.Equal(a.PublicKey()) {
		return agentapi.VM{}, false, migrationRefusal(id, ReasonMigrationState, "vm %s: the source of a migration is this agent itself; migrate to another host", id)
	}
	in.Source.Address = addr
	spec := in.Spec
	spec.HostCapacity = nil
	if err := checkMovable(id, spec.Volumes, snapshotID(spec.Snapshot), ""); err != nil {
		return agentapi.VM{}, false, err
	}
	src := spec.ImageSource
	if spec, err = a.resolveImage(spec); err != nil {
		return agentapi.VM{}, false, err
	}
	if err := checkFirmwareField(spec); err != nil {
		return agentapi.VM{}, false, err
	}
	if e := a.lookup(id); e != nil {
		if err := e.lock(ctx); err != nil {
			return agentapi.VM{}, false, err
		}
		r, corrupt, gone := e.state()
		e.unlock()
		if !gone {
			if corrupt == "" && r.Image == spec.Image && r.VCPUs == spec.VCPUs && r.MemoryMiB == spec.MemoryMiB && r.DiskMiB == spec.DiskMiB &&
				(r.Incoming == nil || (r.Incoming.Source == in.Source && r.Incoming.Live == in.Live)) && sameVolumeSet(wireVolumes(r.Volumes), spec.Volumes) &&
				r.State != agentapi.StateFailed && r.State != agentapi.StateMigrated {
				cur := a.current(ctx, e)
				return cur.wire(), false, nil
			}
			e := errConflict("vm %s already exists on this agent (state %s): delete it before preparing a migration of it here", id, r.State)
			e.Details = map[string]any{"vm": id, "state": r.State}
			return agentapi.VM{}, false, e
		}
	}
	if err := a.ensureImage(ctx, src); err != nil {
		return agentapi.VM{}, false, err
	}
	if spec.Firmware == "" {
		if img, err := a.cfg.Driver.Image(spec.Image); err == nil {
			spec.Firmware = img.Firmware
		}
	}
	if _, err := a.checkSpec(spec); err != nil {
		return agentapi.VM{}, false, err
	}
	if err := checkSeed(id, spec); err != nil {
		return agentapi.VM{}, false, err
	}
	// The source proves its identity before this agent sends it the
	// token, and tells what its VM is (the MACs its guest has).
	c, err := a.peerClient(ctx, &peer{address: addr, key: key})
	if err != nil {
		return agentapi.VM{}, false, errPull(id, addr, err)
	}
	srcVM, err := c.GetVM(ctx, id)
	if errors.Is(err, agentapi.ErrNotFound) {
		return agentapi.VM{}, false, errConflict("vm %s does not exist on its source agent %s", id, addr)
	}
	if err != nil {
		return agentapi.VM{}, false, errPull(id, addr, fmt.Errorf("read the vm there: %w", err))
	}
	switch {
	case srcVM.VCPUs != spec.VCPUs || srcVM.MemoryMiB != spec.MemoryMiB || srcVM.DiskMiB != spec.DiskMiB:
		return agentapi.VM{}, false, errConflict("vm %s on its source %s has %d vcpus, %d MiB memory, %d MiB disk; the spec says %d, %d, %d",
			id, addr, srcVM.VCPUs, srcVM.MemoryMiB, srcVM.DiskMiB, spec.VCPUs, spec.MemoryMiB, spec.DiskMiB)
	case len(srcVM.NICs) != len(spec.NICs):
		return agentapi.VM{}, false, errConflict("vm %s on its source %s has %d nics; the spec says %d", id, addr, len(srcVM.NICs), len(spec.NICs))
	case in.Live && srcVM.State != agentapi.StateRunning && srcVM.State != agentapi.StatePaused:
		return agentapi.VM{}, false, migrationRefusal(id, ReasonMigrationState, "vm %s is %s on its source %s: a live migration needs it running; migrate it cold", id, srcVM.State, addr)
	case !in.Live && srcVM.State != agentapi.StateStopped:
		return agentapi.VM{}, false, migrationRefusal(id, ReasonMigrationState, "vm %s is %s on its source %s: a cold migration needs it stopped; stop it or migrate it live", id, srcVM.State, addr)
	}
	if !sameVolumeSet(srcVM.Volumes, spec.Volumes) {
		return agentapi.VM{}, false, errConflict("vm %s on its source %s has volumes %s; the spec says %s", id, addr,
			volumeIDs(srcVM.Volumes), volumeIDs(spec.Volumes))
	}
	nics := requestedNICs(spec.NICs)
	for i := range nics {
		// The guest keeps the MACs it has (a warm VM's differ from those
		// its create asked for).
		if m := srcVM.NICs[i].MACAddress; m != "" {
			nics[i].MACAddress = m
		}
	}
	e := a.vms.create(id)
	if e == nil {
		return agentapi.VM{}, false, errConflict("vm %s is being created on this agent by another call; retry", id)
	}
	defer e.unlock()
	r := vmRecord{
		Version: metaVersion, ID: id, Image: spec.Image, VCPUs: spec.VCPUs, MemoryMiB: spec.MemoryMiB, DiskMiB: spec.DiskMiB,
		State: agentapi.StateIncoming, StartedFrom: srcVM.StartedFrom, CreatedAt: srcVM.CreatedAt, NICs: nics, Seed: spec.Seed,
		GuestAgent: spec.GuestAgent, Firmware: spec.Firmware, SecureBoot: spec.SecureBoot,
		Incoming: &incomingRecord{Source: in.Source, Live: in.Live},
	}
	if r.StartedFrom == "" || r.StartedFrom == agentapi.StartedWarm {
		r.StartedFrom = agentapi.StartedCold
	}
	if len(srcVM.Volumes) > 0 {
		// The control plane made this agent's copy of each volume first;
		// claimed under the volumes' locks, as a create's.
		held, vols, err := a.claimIncomingVolumes(ctx, id, srcVM.Volumes)
		if err != nil {
			a.vms.drop(e)
			return agentapi.VM{}, false, err
		}
		r.Volumes = vols
		e.set(r)
		held.unlock()
	}
	if err := os.MkdirAll(a.vmDir(id), 0o750); err != nil {
		a.vms.drop(e)
		return agentapi.VM{}, false, fmt.Errorf("prepare incoming vm %s: %w", id, err)
	}
	if err := a.saveRecord(&r); err != nil {
		_ = os.RemoveAll(a.vmDir(id))
		a.vms.drop(e)
		return agentapi.VM{}, false, err
	}
	e.set(r)
	a.log.Info("vm prepared for an incoming migration", "vm", id, "source", addr, "live", in.Live)
	return r.wire(), true, nil
}

// sameVolumeSet says whether two lists name the same attachments, in any
// order (the control plane lists a migration's volumes by id, the source
// in its slots' order).
func sameVolumeSet(a, b []agentapi.VolumeAttachment) bool {
	key := func(vs []agentapi.VolumeAttachment) []string {
		out := make([]string, len(vs))
		for i, v := range vs {
			out[i] = fmt.Sprintf("%s/%t", v.ID, v.ReadOnly)
		}
		slices.Sort(out)
		return out
	}
	return slices.Equal(key(a), key(b))
}

func volumeIDs(vs []agentapi.VolumeAttachment) string {
	ids := make([]string, len(vs))
	for i, v := range vs {
		ids[i] = v.ID
	}
	return "[" + strings.Join(ids, ", ") + "]"
}

func snapshotID(s *agentapi.SnapshotSource) string {
	if s == nil {
		return ""
	}
	return s.ID
}

// incomingFor returns the incoming record of VM id, for a stream channel:
// a 404 when there is no such VM, a 409 when it is not waiting for one.
func (a *Agent) incomingFor(id string) (incomingRecord, error) {
	e := a.lookup(id)
	if e == nil {
		return incomingRecord{}, errNotFound(id)
	}
	r, corrupt, gone := e.state()
	switch {
	case gone:
		return incomingRecord{}, errNotFound(id)
	case corrupt != "" || r.State != agentapi.StateIncoming || r.Incoming == nil:
		return incomingRecord{}, errConflict("vm %s is %s on this agent, not waiting for a migration stream", id, r.State)
	}
	return *r.Incoming, nil
}

// receiveChannel runs the target's end of one authenticated channel.
func (a *Agent) receiveChannel(ctx context.Context, id, channel string, conn net.Conn) error {
	if channel == agentapi.ChannelFiles {
		return a.receiveFiles(ctx, id, conn)
	}
	mg, err := a.migrator()
	if err != nil {
		return err
	}
	e := a.lookup(id)
	if e == nil {
		return errNotFound(id)
	}
	r, _, _ := e.state()
	if r.Incoming == nil || !r.Incoming.Prepared {
		return fmt.Errorf("vm %s: channel %s before its files", id, channel)
	}
	return mg.Receive(ctx, machineOf(a, r), channel, conn)
}

// receiveFiles takes the files channel: a tar of the VM's files, written
// into its directory; for a live migration it then starts the VMM waiting
// for the stream. It answers "ok\n" or "error: <why>\n".
func (a *Agent) receiveFiles(ctx context.Context, id string, conn net.Conn) error {
	err := a.receiveFilesLocked(ctx, id, conn)
	answer := "ok\n"
	if err != nil {
		answer = "error: " + strings.ReplaceAll(err.Error(), "\n", " ") + "\n"
	}
	_, _ = io.WriteString(conn, answer)
	return err
}

func (a *Agent) receiveFilesLocked(ctx context.Context, id string, conn net.Conn) error {
	mg, err := a.migrator()
	if err != nil {
		return err
	}
	lctx, cancel := context.WithTimeout(ctx, time.Minute)
	e, err := a.lockVM(lctx, id, "receive migrated files")
	cancel()
	if err != nil {
		return err
	}
	defer e.unlock()
	r, _, _ := e.state()
	if r.State != agentapi.StateIncoming || r.Incoming == nil || r.Incoming.Files {
		return errConflict("vm %s is %s on this agent: it takes its files once, while it is incoming", id, r.State)
	}
	dir := a.vmDir(id)
	var names []string
	tr := tar.NewReader(bufio.NewReader(conn))
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fmt.Errorf("files of vm %s: %w", id, err)
		}
		name := h.Name
		if h.Typeflag != tar.TypeReg || name != filepath.Base(name) || name == metaFile || strings.HasPrefix(name, ".") || name == "" {
			return fmt.Errorf("files of vm %s: %q is not a plain file name the agent takes", id, name)
		}
		if len(names) >= maxIncomingFiles {
			return fmt.Errorf("files of vm %s: more than %d files", id, maxIncomingFiles)
		}
		tmp := filepath.Join(dir, ".in-"+name)
		if err := writeSparse(tmp, tr, h.Size); err != nil {
			return fmt.Errorf("files of vm %s: %s: %w", id, name, err)
		}
		names = append(names, name)
	}
	for _, n := range names {
		if err := os.Rename(filepath.Join(dir, ".in-"+n), filepath.Join(dir, n)); err != nil {
			return fmt.Errorf("files of vm %s: %w", id, err)
		}
	}
	m := machineOf(a, r)
	if err := mg.AdoptIncomingFiles(ctx, m, names); err != nil {
		return fmt.Errorf("files of vm %s refused: %w", id, err)
	}
	if err := a.ensureSeed(r); err != nil {
		return err
	}
	r.Incoming.Files = true
	if r.Incoming.Live {
		if err := a.cfg.Driver.Create(ctx, m); err != nil {
			return fmt.Errorf("prepare incoming vm %s: %w", id, err)
		}
		// Recorded first: a crash while the VMM starts leaves a record
		// that finds (and fails) whatever process is left.
		r.Incoming.Prepared = true
		if err := a.saveRecord(&r); err != nil {
			return err
		}
		e.set(r)
		if err := mg.PrepareIncoming(ctx, m); err != nil {
			r.State, r.Reason = agentapi.StateFailed, "its vmm did not start for the incoming stream: "+err.Error()
			_ = a.cfg.Driver.Kill(ctx, m)
			_ = a.saveRecord(&r)
			e.set(r)
			return fmt.Errorf("start incoming vm %s: %w", id, err)
		}
		r.Process, r.NICs = m.Process, m.NICs
	}
	if err := a.saveRecord(&r); err != nil {
		return err
	}
	e.set(r)
	a.log.Info("incoming vm files in place", "vm", id, "files", names, "live", r.Incoming.Live, "pid", r.Process.PID)
	return nil
}

// writeSparse writes n bytes of r to a new file at path, leaving runs of
// zeros as holes (disk images are mostly holes), and syncs it.
func writeSparse(path string, r io.Reader, n int64) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o640)
	if err != nil {
		return err
	}
	buf := make([]byte, 1<<20)
	var off int64
	for off < n {
		k, err := io.ReadFull(r, buf[:min(int64(len(buf)), n-off)])
		if k > 0 {
			if isZero(buf[:k]) {
				_, err2 := f.Seek(int64(k), io.SeekCurrent)
				if err2 != nil {
					err = err2
				}
			} else if _, err2 := f.Write(buf[:k]); err2 != nil {
				err = err2
			}
			off += int64(k)
		}
		if err != nil && off < n {
			_ = f.Close()
			return err
		}
	}
	if err := f.Truncate(n); err != nil {
		_ = f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}

func isZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// CommitIncoming runs VM id (live) or records it stopped (cold) once its
// stream completed: called by its source once the source's copy is
// stopped for good; paused keeps a live VM paused (it was paused there).
// Committing a committed VM returns it.
func (a *Agent) CommitIncoming(ctx context.Context, id string, paused bool) (agentapi.VM, error) {
	e, err := a.lockVM(ctx, id, "be committed")
	if err != nil {
		return agentapi.VM{}, err
	}
	defer e.unlock()
	r := a.refreshLocked(ctx, e)
	if r.Incoming == nil {
		switch r.State {
		case agentapi.StateRunning, agentapi.StatePaused, agentapi.StateStopped:
			return r.wire(), nil // committed before
		}
		return agentapi.VM{}, errConflict("vm %s is %s on this agent, not an incoming migration", id, r.State)
	}
	if r.State == agentapi.StateFailed {
		return agentapi.VM{}, migrationRefusal(id, ReasonMigrationState, "vm %s: its incoming migration failed (%s); it cannot run here: delete it", id, r.Reason)
	}
	m := machineOf(a, r)
	if r.Incoming.Live {
		mg, err := a.migrator()
		if err != nil {
			return agentapi.VM{}, err
		}
		st, reason := IncomingActive, "its files did not arrive"
		if r.Incoming.Prepared {
			st, reason = mg.IncomingState(ctx, m)
		}
		if st != IncomingCompleted {
			return agentapi.VM{}, migrationRefusal(id, ReasonMigrationState, "vm %s: its incoming stream has not completed (%s %s); it does not run", id, st, reason)
		}
		r.State = agentapi.StatePaused
		if !paused {
			if err := a.cfg.Driver.Resume(ctx, m); err != nil {
				return agentapi.VM{}, fmt.Errorf("run migrated vm %s: %w", id, err)
			}
			r.State = agentapi.StateRunning
		}
	} else {
		if !r.Incoming.Files {
			return agentapi.VM{}, migrationRefusal(id, ReasonMigrationState, "vm %s: its files have not all arrived; it cannot be committed", id)
		}
		r.State = agentapi.StateStopped
	}
	r.Incoming, r.Reason = nil, ""
	if err := a.saveRecord(&r); err != nil {
		return agentapi.VM{}, err
	}
	e.set(r)
	a.log.Info("migrated vm committed", "vm", id, "state", r.State, "pid", r.Process.PID)
	return r.wire(), nil
}

// refreshIncomingLocked observes an incoming VM: its VMM gone or its
// stream failed makes it failed (and its process is ended), never run.
func (a *Agent) refreshIncomingLocked(ctx context.Context, e *vmEntry, r vmRecord) vmRecord {
	if r.State != agentapi.StateIncoming || r.Incoming == nil || !r.Incoming.Prepared {
		return r
	}
	mg, err := a.migrator()
	if err != nil {
		return r
	}
	m := machineOf(a, r)
	st, reason := mg.IncomingState(ctx, m)
	if st != IncomingFailed {
		return r
	}
	if err := a.cfg.Driver.Kill(ctx, m); err != nil {
		a.log.Warn("end the vmm of a failed incoming vm", "vm", r.ID, "err", err)
	}
	r.State, r.Reason, r.Process = agentapi.StateFailed, "its incoming migration failed: "+reason, Process{}
	if err := a.saveRecord(&r); err != nil {
		a.log.Error("save failed incoming vm", "vm", r.ID, "err", err)
	}
	e.set(r)
	a.log.Warn("incoming migration failed", "vm", r.ID, "reason", reason)
	return r
}
