package agent

// The registry of snapshots by id, what start-up finds in the state
// directory, and reads and deletes of snapshots.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// loadSnapshots registers the snapshots in the state directory and removes
// the leftovers of snapshots, pulls and deletions that a crash interrupted.
// A snapshot whose metadata cannot be read stays, reported corrupt, so that
// its files (which children may use) are only removed by a delete.
func (a *Agent) loadSnapshots() error {
	if err := os.MkdirAll(a.snapsDir(), 0o750); err != nil {
		return fmt.Errorf("create snapshot directory %s: %w", a.snapsDir(), err)
	}
	entries, err := os.ReadDir(a.snapsDir())
	if err != nil {
		return fmt.Errorf("read snapshot directory %s: %w", a.snapsDir(), err)
	}
	for _, de := range entries {
		name := de.Name()
		dir := filepath.Join(a.snapsDir(), name)
		if !de.IsDir() {
			continue
		}
		if strings.HasPrefix(name, ".") {
			a.log.Warn("remove an unfinished snapshot, pull or deletion", "dir", dir)
			if err := os.RemoveAll(dir); err != nil {
				a.log.Warn("remove snapshot leftovers", "dir", dir, "err", err)
			}
			continue
		}
		s := a.snaps.entry(name)
		b, err := os.ReadFile(filepath.Join(dir, snapshotMetaFile))
		var rec snapshotRecord
		if err == nil {
			err = json.Unmarshal(b, &rec)
		}
		if err == nil {
			err = rec.validate(name)
		}
		if err != nil {
			reason := fmt.Sprintf("metadata %s cannot be used (%v); delete the snapshot", filepath.Join(dir, snapshotMetaFile), err)
			s.setCorrupt(nil, reason)
			a.log.Error("corrupt snapshot metadata", "snapshot", name, "reason", reason)
			continue
		}
		if rec.Unsynced {
			if err := a.recoverUnsynced(dir, &rec); err != nil {
				s.setCorrupt(nil, err.Error())
				a.log.Error("snapshot files lost", "snapshot", name, "reason", err.Error())
				continue
			}
		}
		s.set(&rec)
	}
	return nil
}

// GetSnapshot returns a snapshot's metadata.
func (a *Agent) GetSnapshot(_ context.Context, id string) (agentapi.Snapshot, error) {
	if err := checkSnapshotID(id); err != nil {
		return agentapi.Snapshot{}, err
	}
	s := a.snaps.lookup(id)
	if s == nil {
		return agentapi.Snapshot{}, errSnapshotNotFound(id)
	}
	rec, corrupt, _ := s.state()
	switch {
	case corrupt != "":
		return agentapi.Snapshot{}, errConflict("snapshot %s exists but %s", id, corrupt)
	case rec == nil:
		return agentapi.Snapshot{}, errSnapshotNotFound(id)
	}
	return rec.wire(), nil
}

// openSnapshotFile opens one file that the snapshot's metadata lists.
func (a *Agent) openSnapshotFile(id, name string) (*os.File, agentapi.SnapshotFile, error) {
	if err := checkSnapshotID(id); err != nil {
		return nil, agentapi.SnapshotFile{}, err
	}
	s := a.snaps.lookup(id)
	if s == nil {
		return nil, agentapi.SnapshotFile{}, errSnapshotNotFound(id)
	}
	rec, corrupt, _ := s.state()
	switch {
	case corrupt != "":
		return nil, agentapi.SnapshotFile{}, errConflict("snapshot %s exists but %s", id, corrupt)
	case rec == nil:
		return nil, agentapi.SnapshotFile{}, errSnapshotNotFound(id)
	}
	for _, f := range rec.Files {
		if f.Name == name {
			fh, err := os.Open(filepath.Join(a.snapDir(id), f.Name))
			if err != nil {
				return nil, f, fmt.Errorf("open file %s of snapshot %s: %w", name, id, err)
			}
			return fh, f, nil
		}
	}
	var names []string
	for _, f := range rec.Files {
		names = append(names, f.Name)
	}
	return nil, agentapi.SnapshotFile{}, &Error{Status: http.StatusNotFound, Code: CodeNotFound,
		Message: fmt.Sprintf("snapshot %s has no file %q; it has %v", id, name, names)}
}

// snapshotUsers lists what needs snapshot id's files: VMs started from it
// (their disks sit on its frozen disk) and snapshots whose frozen disk does.
func (a *Agent) snapshotUsers(id string) (vms, snaps []string) {
	for _, e := range a.vms.all() {
		if r, _, gone := e.state(); !gone && r.Snapshot == id {
			vms = append(vms, e.id)
		}
	}
	for _, s := range a.snaps.all() {
		if rec, _, gone := s.state(); !gone && rec != nil && rec.Parent == id {
			snaps = append(snaps, s.id)
		}
	}
	sort.Strings(vms)
	sort.Strings(snaps)
	return vms, snaps
}

// DeleteSnapshot removes a snapshot and its files; an unknown id is not an
// error. It refuses (409) while a VM on this agent was started from the
// snapshot or another snapshot's disk sits on it: their disks read its
// frozen disk. The source VM does not count: its disk chain keeps its own
// links to the frozen files.
func (a *Agent) DeleteSnapshot(ctx context.Context, id string) error {
	if err := checkSnapshotID(id); err != nil {
		return err
	}
	s, err := a.snaps.acquire(ctx, id)
	if s == nil || err != nil {
		return err
	}
	defer s.unlock()
	if rec, corrupt, _ := s.state(); rec == nil && corrupt == "" {
		return nil
	}
	if vms, snaps := a.snapshotUsers(id); len(vms)+len(snaps) > 0 {
		e := errConflict("snapshot %s is in use: vms %v were started from it and snapshots %v build on it; delete those first", id, vms, snaps)
		e.Details = map[string]any{"id": id, "vms": vms, "snapshots": snaps}
		return e
	}
	trash := filepath.Join(a.snapsDir(), fmt.Sprintf("%s%s-%d", trashPrefix, id, time.Now().UnixNano()))
	if err := os.Rename(a.snapDir(id), trash); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove snapshot %s: %w", id, err)
	}
	if err := os.RemoveAll(trash); err != nil {
		a.log.Warn("remove files of deleted snapshot", "snapshot", id, "dir", trash, "err", err)
	}
	a.snaps.drop(s)
	a.collectBases() // the frozen points of its volumes (volume_fork.go)
	a.log.Info("snapshot deleted", "snapshot", id)
	return nil
}
