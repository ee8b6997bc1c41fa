package agent

// Snapshots (docs/guides/architecture.md): the memory and disk of a running VM taken
// in one paused window, children started from them, and pulls of a snapshot
// from another agent so that a child can start on another host.
//
// A snapshot lives in <state>/snapshots/<id>/: the files its driver made
// (for QEMU memory.state and the frozen disk chain, hard-linked from the
// source VM, so that taking it copies no disk data) and snapshot.json, its
// metadata with the size and sha256 of every file. Work in progress is done
// in a <state>/snapshots/.partial-* or .pull-* directory that is renamed
// into place whole, so a snapshot directory either is complete or does not
// exist; start-up removes what a crash left of such work.

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

const (
	snapshotMetaFile = "snapshot.json"
	snapshotVersion  = 1
	partialPrefix    = ".partial-"
	pullPrefix       = ".pull-"
	// snapshotTimeout and pullTimeout bound taking a snapshot and pulling
	// one. Both go on when the caller gives up (a retry then waits for
	// them and finds the snapshot), so that a client timeout never costs a
	// second pause of the source or a second transfer.
	snapshotTimeout = 10 * time.Minute
	pullTimeout     = 10 * time.Minute
	// maxSnapshotDepth bounds a chain of parent snapshots (a fork of a
	// fork of ...) that one pull follows.
	maxSnapshotDepth = 16
)

// Snapshotter is a Driver that can snapshot a VM and start VMs from a
// snapshot. The agent owns the snapshot directories and their metadata; the
// driver makes and reads the files in them.
type Snapshotter interface {
	// Snapshot saves m's memory and device state and freezes its disk, both
	// at one point in time, into dir: an empty directory on the same
	// filesystem as m.Dir. The VM is paused meanwhile and continued at the
	// end unless opts.KeepPaused. A VM with a disk goes on writing to a new
	// overlay on the frozen disk: Snapshot calls opts.RecordDisk with its
	// name before the VM writes to it, and sets m.Disk. Files in dir are
	// never written again.
	Snapshot(ctx context.Context, m *Machine, dir string, opts SnapshotOptions) (SnapshotFiles, error)
	// Spawn makes m's disk, an overlay of its own on the frozen disk in
	// dir, and starts m running from the memory state, with a new identity
	// (vmgenid). m.Process is set as by Boot.
	Spawn(ctx context.Context, m *Machine, dir string, files SnapshotFiles) error
	// AdoptPulled checks the disk chain of a snapshot pulled from another
	// agent into dir before anything opens it: each disk file may name as
	// its backing file only another file of the snapshot, a file of its
	// parent snapshot (from.ParentDir) or the base disk of its image on
	// this agent, and the driver rewrites every name to this agent's own
	// file. Anything else is refused: a peer must not make this host's
	// VMs read files of its choosing. It returns the files it rewrote.
	AdoptPulled(ctx context.Context, dir string, files SnapshotFiles, from PulledFrom) ([]string, error)
}

// PulledFrom is what AdoptPulled may let a pulled snapshot's disks sit on.
type PulledFrom struct {
	Image string // the snapshot's image, on this agent
	// ParentDir and ParentFiles are the parent snapshot, already here
	// (ParentDir "" without one).
	ParentDir   string
	ParentFiles SnapshotFiles
}

// SnapshotOptions tunes Snapshotter.Snapshot.
type SnapshotOptions struct {
	// KeepPaused leaves the VM paused after the snapshot.
	KeepPaused bool
	// RecordDisk durably records the disk file the VM is about to write
	// to. An error stops the snapshot before the VM is switched.
	RecordDisk func(disk string) error
}

// SnapshotFiles names the files of a snapshot in its directory.
type SnapshotFiles struct {
	Memory string // device state, and the RAM when RAM is ""
	// RAM is the guest's RAM image, which children map copy-on-write
	// instead of loading it; RAMDigest is its SparseDigest, which the
	// driver computed while writing it ("" lets the agent compute it).
	RAM, RAMDigest string
	Disk           string   // frozen disk that children's overlays sit on; "" without a disk
	Backing        []string // files below Disk in its backing chain, also in the directory
}

// ErrSnapshotConflict is what a driver returns when the VM is in a state in
// which it cannot be snapshotted (a 409 with the message).
func ErrSnapshotConflict(format string, args ...any) error { return errConflict(format, args...) }

// snapshotRecord is the durable metadata of one snapshot,
// <state>/snapshots/<id>/snapshot.json.
type snapshotRecord struct {
	Version   int                     `json:"version"`
	ID        string                  `json:"id"`
	VMID      string                  `json:"vm_id"`
	Image     string                  `json:"image"`
	VCPUs     int64                   `json:"vcpus"`
	MemoryMiB int64                   `json:"memory_mib"`
	DiskMiB   int64                   `json:"disk_mib"`
	Files     []agentapi.SnapshotFile `json:"files"`
	Parent    string                  `json:"parent,omitempty"`
	// Origin is the agent the snapshot was pulled from; empty when taken here.
	Origin string `json:"origin,omitempty"`
	// Unsynced says that the files may not have reached the disk yet
	// (snapshot_sync.go): a background sync clears it, and an agent that
	// starts and finds it set checks every file against its digest.
	Unsynced  bool      `json:"unsynced,omitempty"`
	CreatedAt time.Time `json:"created_at"`
	// NICs are the source's NICs as its guest sees them: a VM started
	// from the snapshot keeps that view inside (Machine.GuestNICs).
	NICs []agentapi.NIC `json:"nics,omitempty"`
}

func (r *snapshotRecord) wire() agentapi.Snapshot {
	s := agentapi.Snapshot{
		ID: r.ID, VMID: r.VMID, Image: r.Image, VCPUs: r.VCPUs, MemoryMiB: r.MemoryMiB, DiskMiB: r.DiskMiB,
		CreatedAt: r.CreatedAt, Files: slices.Clone(r.Files), Parent: r.Parent, NICs: cloneNICs(r.NICs),
	}
	h := sha256.New()
	for _, f := range r.Files {
		s.SizeBytes += f.SizeBytes
		fmt.Fprintf(h, "%s %s %d %s\n", f.Kind, f.Name, f.SizeBytes, f.SHA256)
	}
	s.SHA256 = hex.EncodeToString(h.Sum(nil))
	return s
}

func (r *snapshotRecord) files() SnapshotFiles {
	var out SnapshotFiles
	for _, f := range r.Files {
		switch f.Kind {
		case agentapi.SnapshotFileMemory:
			out.Memory = f.Name
		case agentapi.SnapshotFileRAM:
			out.RAM = f.Name
		case agentapi.SnapshotFileDisk:
			out.Disk = f.Name
		case agentapi.SnapshotFileBacking:
			out.Backing = append(out.Backing, f.Name)
		}
	}
	return out
}

var (
	fileNamePattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)
	sha256Pattern   = regexp.MustCompile(`^[0-9a-f]{64}$`)
)

// validate checks metadata read from disk or sent by another agent: its
// file names become paths here, so they must be plain names.
func (r *snapshotRecord) validate(id string) error {
	switch {
	case r.Version != snapshotVersion:
		return fmt.Errorf("version %d, want %d", r.Version, snapshotVersion)
	case r.ID != id:
		return fmt.Errorf("id %q, want %q", r.ID, id)
	case r.Image == "" || r.VCPUs < 1 || r.MemoryMiB < 1 || r.DiskMiB < 0:
		return errors.New("image or shape missing")
	case r.Parent != "" && checkSnapshotID(r.Parent) != nil:
		return fmt.Errorf("parent %q is not a valid snapshot id", r.Parent)
	}
	seen := map[string]bool{snapshotMetaFile: true}
	kinds := map[string]int{}
	for _, f := range r.Files {
		if !fileNamePattern.MatchString(f.Name) || seen[f.Name] {
			return fmt.Errorf("file name %q is not a plain name or is listed twice", f.Name)
		}
		seen[f.Name] = true
		if f.SizeBytes < 0 || !sha256Pattern.MatchString(f.SHA256) {
			return fmt.Errorf("file %s: bad size or sha256", f.Name)
		}
		switch f.Kind {
		case agentapi.SnapshotFileMemory, agentapi.SnapshotFileRAM, agentapi.SnapshotFileDisk, agentapi.SnapshotFileBacking:
			kinds[f.Kind]++
		default:
			return fmt.Errorf("file %s: unknown kind %q", f.Name, f.Kind)
		}
	}
	switch {
	case kinds[agentapi.SnapshotFileMemory] != 1:
		return errors.New("want exactly one memory file")
	case kinds[agentapi.SnapshotFileRAM] > 1:
		return errors.New("more than one ram file")
	case kinds[agentapi.SnapshotFileDisk] > 1:
		return errors.New("more than one frozen disk")
	case kinds[agentapi.SnapshotFileBacking] > 0 && kinds[agentapi.SnapshotFileDisk] == 0:
		return errors.New("backing files without a frozen disk")
	}
	return nil
}

// snapEntry is one snapshot id in the registry. Like vmEntry, op is held
// while the snapshot is taken, pulled or deleted.
type snapEntry struct {
	id string
	op chan struct{}

	mu      sync.Mutex
	rec     *snapshotRecord // nil until complete
	corrupt string          // its metadata cannot be read: only delete works
	gone    bool            // dropped from the registry; a waiter must look again
}

func (s *snapEntry) lock(ctx context.Context) error {
	select {
	case s.op <- struct{}{}:
		return nil
	case <-ctx.Done():
		return &Error{Status: http.StatusServiceUnavailable, Code: CodeUnavailable,
			Message: fmt.Sprintf("snapshot %s is busy with another operation; retry later", s.id), Err: ctx.Err()}
	}
}

func (s *snapEntry) unlock() { <-s.op }

func (s *snapEntry) state() (*snapshotRecord, string, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.rec, s.corrupt, s.gone
}

// snapshotRegistry holds the snapshots of an agent by id.
type snapshotRegistry struct {
	mu      sync.Mutex
	entries map[string]*snapEntry
}

func (g *snapshotRegistry) lookup(id string) *snapEntry {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.entries[id]
}

// entry returns the entry of id, making an empty one when there is none.
func (g *snapshotRegistry) entry(id string) *snapEntry {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.entries == nil {
		g.entries = map[string]*snapEntry{}
	}
	s := g.entries[id]
	if s == nil {
		s = &snapEntry{id: id, op: make(chan struct{}, 1)}
		g.entries[id] = s
	}
	return s
}

// drop removes s from the registry. The caller holds s's lock.
func (g *snapshotRegistry) drop(s *snapEntry) {
	g.mu.Lock()
	if g.entries[s.id] == s {
		delete(g.entries, s.id)
	}
	g.mu.Unlock()
	s.mu.Lock()
	s.gone = true
	s.mu.Unlock()
}

func (g *snapshotRegistry) all() []*snapEntry {
	g.mu.Lock()
	defer g.mu.Unlock()
	out := make([]*snapEntry, 0, len(g.entries))
	for _, s := range g.entries {
		out = append(out, s)
	}
	return out
}

func checkSnapshotID(id string) *Error {
	if !idPattern.MatchString(id) {
		return errInvalid("snapshot id %q is not valid: use 1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit", id)
	}
	return nil
}

// checkSnapshotSource validates the snapshot part of a VM spec.
func checkSnapshotSource(spec agentapi.VMSpec) error {
	if err := checkSnapshotID(spec.Snapshot.ID); err != nil {
		return err
	}
	if spec.Stopped {
		return errInvalid("a vm started from a snapshot cannot be created stopped: it continues the snapshot's running guest")
	}
	if _, err := peerOf(spec.Snapshot); err != nil {
		return err
	}
	return nil
}

// peer is another agent a snapshot is pulled from: its address and the
// identity key the control plane pinned for it.
type peer struct {
	address string
	key     ed25519.PublicKey
}

// peerOf is the agent src names; nil when the snapshot is to be here.
func peerOf(src *agentapi.SnapshotSource) (*peer, error) {
	if src.Address == "" {
		if src.PublicKey != "" {
			return nil, errInvalid("snapshot.public_key without snapshot.address")
		}
		return nil, nil
	}
	addr, err := agentapi.CheckAddress(src.Address)
	if err != nil {
		return nil, errInvalid("snapshot.address: %v", err)
	}
	if src.PublicKey == "" {
		return nil, errInvalid("snapshot.address %s needs snapshot.public_key, the identity key the control plane pinned for that agent: "+
			"this agent sends its token only to an agent that proves it", src.Address)
	}
	key, err := agentapi.DecodeKey(src.PublicKey)
	if err != nil {
		return nil, errInvalid("snapshot.public_key: %v", err)
	}
	return &peer{address: addr, key: key}, nil
}

// peerClient is a client of the agent p after it proved its pinned
// identity at its address: only then does the agent token go there.
func (a *Agent) peerClient(ctx context.Context, p *peer) (*agentapi.Client, error) {
	if err := a.verifyPeer(ctx, p); err != nil {
		return nil, err
	}
	return agentapi.NewClient(p.address, a.cfg.Token, a.peerOptions()...), nil
}

// peerOptions are the client options of calls to other agents: the
// configured peer client, which never follows a redirect (the token goes
// only to the address that proved itself).
func (a *Agent) peerOptions() []agentapi.Option {
	hc := &http.Client{}
	if a.cfg.PeerHTTPClient != nil {
		c := *a.cfg.PeerHTTPClient
		hc = &c
	}
	hc.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	return []agentapi.Option{agentapi.WithTimeout(30 * time.Second), agentapi.WithHTTPClient(hc)}
}

// verifyPeer challenges the agent p at its address (no token sent) and
// fails unless it signs with the key the control plane pinned for it.
func (a *Agent) verifyPeer(ctx context.Context, p *peer) error {
	nonce := make([]byte, 32)
	if _, err := rand.Read(nonce); err != nil {
		return err
	}
	ch := agentapi.IdentityChallenge{Nonce: agentapi.NewNonce(nonce), Address: p.address}
	proof, err := agentapi.NewClient(p.address, "", a.peerOptions()...).Identity(ctx, ch)
	if err == nil {
		_, err = agentapi.VerifyIdentity(ch, proof, p.key, "")
	}
	if err != nil {
		return fmt.Errorf("the agent at %s did not prove the identity the control plane pinned for it (%s): %w",
			p.address, agentapi.KeyFingerprint(p.key), err)
	}
	return nil
}

func errSnapshotNotFound(id string) *Error {
	return &Error{Status: http.StatusNotFound, Code: CodeNotFound,
		Message: fmt.Sprintf("snapshot %s does not exist on this agent", id), Details: map[string]any{"id": id}}
}

func (a *Agent) snapsDir() string         { return filepath.Join(a.cfg.StateDir, "snapshots") }
func (a *Agent) snapDir(id string) string { return filepath.Join(a.snapsDir(), id) }

func (a *Agent) snapshotter() (Snapshotter, error) {
	sn, ok := a.cfg.Driver.(Snapshotter)
	if !ok {
		return nil, errConflict("the %s driver of this agent cannot take snapshots or start vms from them", a.cfg.Driver.Name())
	}
	return sn, nil
}

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
			s.corrupt = fmt.Sprintf("metadata %s cannot be used (%v); delete the snapshot", filepath.Join(dir, snapshotMetaFile), err)
			a.log.Error("corrupt snapshot metadata", "snapshot", name, "reason", s.corrupt)
			continue
		}
		if rec.Unsynced {
			if err := a.recoverUnsynced(dir, &rec); err != nil {
				s.corrupt = err.Error()
				a.log.Error("snapshot files lost", "snapshot", name, "reason", s.corrupt)
				continue
			}
		}
		s.rec = &rec
	}
	return nil
}

// CreateSnapshot takes snapshot id of a running (or paused) VM, or returns
// the snapshot when it exists: a retried or concurrent PUT waits for the
// first and never pauses the VM again. The bool is true when this call took it.
func (a *Agent) CreateSnapshot(ctx context.Context, id string, spec agentapi.SnapshotSpec) (agentapi.Snapshot, bool, error) {
	if err := checkSnapshotID(id); err != nil {
		return agentapi.Snapshot{}, false, err
	}
	if spec.VMID == "" {
		return agentapi.Snapshot{}, false, errInvalid("vm_id is required: the id of the vm to snapshot")
	}
	if err := checkID(spec.VMID); err != nil {
		return agentapi.Snapshot{}, false, err
	}
	sn, err := a.snapshotter()
	if err != nil {
		return agentapi.Snapshot{}, false, err
	}
	for {
		s := a.snaps.entry(id)
		if err := s.lock(ctx); err != nil {
			return agentapi.Snapshot{}, false, err
		}
		rec, corrupt, gone := s.state()
		switch {
		case gone:
			s.unlock()
			continue
		case corrupt != "":
			s.unlock()
			return agentapi.Snapshot{}, false, errConflict("snapshot %s exists but %s", id, corrupt)
		case rec != nil:
			s.unlock()
			if rec.VMID != spec.VMID {
				e := errConflict("snapshot %s already exists, of vm %s, not of vm %s; choose another snapshot id", id, rec.VMID, spec.VMID)
				e.Details = map[string]any{"id": id, "vm_id": rec.VMID}
				return agentapi.Snapshot{}, false, e
			}
			return rec.wire(), false, nil
		}
		tctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), snapshotTimeout)
		rec, err := a.takeSnapshot(tctx, sn, id, spec)
		cancel()
		if err != nil {
			a.snaps.drop(s)
			s.unlock()
			return agentapi.Snapshot{}, false, err
		}
		s.mu.Lock()
		s.rec = rec
		s.mu.Unlock()
		s.unlock()
		return rec.wire(), true, nil
	}
}

// takeSnapshot snapshots the VM into a partial directory, describes the
// files, writes the metadata and renames the directory into place. The
// caller holds the snapshot's lock.
func (a *Agent) takeSnapshot(ctx context.Context, sn Snapshotter, id string, spec agentapi.SnapshotSpec) (*snapshotRecord, error) {
	e := a.lookup(spec.VMID)
	if e == nil {
		return nil, errNotFound(spec.VMID)
	}
	if err := e.lock(ctx); err != nil {
		return nil, err
	}
	locked := true
	defer func() {
		if locked {
			e.unlock()
		}
	}()
	if r, corrupt, gone := e.snapshot(); gone {
		return nil, errNotFound(spec.VMID)
	} else if corrupt {
		return nil, errConflict("vm %s cannot be snapshotted: %s; delete it and create it again", spec.VMID, r.Reason)
	}
	r := a.refreshLocked(ctx, e)
	if r.State != agentapi.StateRunning && r.State != agentapi.StatePaused {
		err := errConflict("vm %s is %s: only a running or paused vm can be snapshotted; start it first", r.ID, r.State)
		err.Details = map[string]any{"vm_id": r.ID, "state": r.State}
		return nil, err
	}
	partial, err := os.MkdirTemp(a.snapsDir(), partialPrefix+id+"-")
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: %w", id, err)
	}
	done := false
	defer func() {
		if !done {
			if err := os.RemoveAll(partial); err != nil {
				a.log.Warn("remove unfinished snapshot", "snapshot", id, "dir", partial, "err", err)
			}
		}
	}()
	m := machineOf(a, r)
	opts := SnapshotOptions{
		KeepPaused: spec.PauseSource || r.State == agentapi.StatePaused,
		RecordDisk: func(disk string) error {
			next, _, _ := e.snapshot()
			next.Disk = disk
			if err := a.saveRecord(&next); err != nil {
				return err
			}
			e.set(next)
			return nil
		},
	}
	start := time.Now()
	files, err := sn.Snapshot(ctx, m, partial, opts)
	window := time.Since(start)
	// Whatever happened, record what the VM is now.
	after := a.refreshLocked(ctx, e)
	if err != nil {
		return nil, fmt.Errorf("snapshot %s of vm %s: %w", id, r.ID, err)
	}
	e.unlock()
	locked = false

	rec := &snapshotRecord{
		Version: snapshotVersion, ID: id, VMID: r.ID, Image: r.Image, VCPUs: r.VCPUs,
		MemoryMiB: r.MemoryMiB, DiskMiB: r.DiskMiB, CreatedAt: time.Now().UTC().Truncate(time.Millisecond),
		NICs: guestView(r),
	}
	if files.Disk != "" {
		// The frozen disk sits on the disk of the snapshot the VM came from.
		rec.Parent = r.Snapshot
	}
	if rec.Files, err = a.describeFiles(partial, files); err != nil {
		return nil, fmt.Errorf("snapshot %s of vm %s: %w", id, r.ID, err)
	}
	if err := a.commitSnapshotDir(partial, rec); err != nil {
		return nil, fmt.Errorf("snapshot %s of vm %s: %w", id, r.ID, err)
	}
	done = true
	w := rec.wire()
	a.log.Info("snapshot taken", "snapshot", id, "vm", r.ID, "vm_state", after.State, "disk", after.Disk,
		"paused_ms", window.Milliseconds(), "total_ms", time.Since(start).Milliseconds(), "bytes", w.SizeBytes)
	return rec, nil
}

// describeFiles sizes and hashes the snapshot's files, and syncs them.
func (a *Agent) describeFiles(dir string, files SnapshotFiles) ([]agentapi.SnapshotFile, error) {
	if files.Memory == "" {
		return nil, errors.New("the driver made no memory file")
	}
	list := []agentapi.SnapshotFile{{Name: files.Memory, Kind: agentapi.SnapshotFileMemory}}
	if files.RAM != "" {
		list = append(list, agentapi.SnapshotFile{Name: files.RAM, Kind: agentapi.SnapshotFileRAM, SHA256: files.RAMDigest})
	}
	if files.Disk != "" {
		list = append(list, agentapi.SnapshotFile{Name: files.Disk, Kind: agentapi.SnapshotFileDisk})
	}
	for _, b := range files.Backing {
		list = append(list, agentapi.SnapshotFile{Name: b, Kind: agentapi.SnapshotFileBacking})
	}
	for i := range list {
		size, sum, err := hashFile(filepath.Join(dir, list[i].Name), list[i].Kind, list[i].SHA256)
		if err != nil {
			return nil, err
		}
		list[i].SizeBytes, list[i].SHA256 = size, sum
	}
	return list, nil
}

// hashFile sizes and checksums one snapshot file (a ram file in its sparse
// form, unless its digest is known).
func hashFile(path, kind, known string) (int64, string, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, "", err
	}
	defer func() { _ = f.Close() }()
	fi, err := f.Stat()
	if err != nil {
		return 0, "", err
	}
	n, sum := fi.Size(), known
	switch {
	case kind == agentapi.SnapshotFileRAM && sum == "":
		sum, err = SparseDigest(f, n)
	case kind != agentapi.SnapshotFileRAM:
		h := sha256.New()
		n, err = io.Copy(h, f)
		sum = digestOf(h)
	}
	if err != nil {
		return 0, "", fmt.Errorf("read %s: %w", path, err)
	}
	return n, sum, nil
}

// commitSnapshotDir writes the metadata into the finished directory dir and
// renames it to the snapshot's place: from then on the snapshot exists. Its
// files are synced to disk in the background (snapshot_sync.go).
func (a *Agent) commitSnapshotDir(dir string, rec *snapshotRecord) error {
	rec.Unsynced = !a.cfg.NoSync
	if err := a.writeSnapshotMeta(dir, rec); err != nil {
		return fmt.Errorf("write snapshot metadata: %w", err)
	}
	if err := os.Rename(dir, a.snapDir(rec.ID)); err != nil {
		return fmt.Errorf("move the snapshot into place: %w", err)
	}
	if a.cfg.NoSync {
		return nil
	}
	if err := syncDir(a.snapsDir()); err != nil {
		return err
	}
	a.syncLater(rec)
	return nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer func() { _ = d.Close() }()
	return d.Sync()
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
	a.mu.Lock()
	entries := make([]*vmEntry, 0, len(a.vms))
	for _, e := range a.vms {
		entries = append(entries, e)
	}
	a.mu.Unlock()
	for _, e := range entries {
		if r, _, gone := e.snapshot(); !gone && r.Snapshot == id {
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
	s := a.snaps.lookup(id)
	if s == nil {
		return nil
	}
	if err := s.lock(ctx); err != nil {
		return err
	}
	defer s.unlock()
	rec, corrupt, gone := s.state()
	if gone || (rec == nil && corrupt == "") {
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
	a.log.Info("snapshot deleted", "snapshot", id)
	return nil
}

// spawnLocked creates VM e from a snapshot: the snapshot is made local
// (pulled from spec.Snapshot.Address when it is not here), then the driver
// starts the VM from it. The caller holds e's operation lock.
func (a *Agent) spawnLocked(ctx context.Context, e *vmEntry, spec agentapi.VMSpec) (agentapi.VM, error) {
	src := *spec.Snapshot
	r := vmRecord{
		Version: metaVersion, ID: e.id, Image: spec.Image, VCPUs: spec.VCPUs, MemoryMiB: spec.MemoryMiB,
		DiskMiB: spec.DiskMiB, State: agentapi.StateCreating, StartedFrom: agentapi.StartedSnapshot,
		Snapshot: src.ID, CreatedAt: time.Now().UTC().Truncate(time.Millisecond), NICs: requestedNICs(spec.NICs),
	}
	// Set before the snapshot is looked at, so that from here on a delete
	// of the snapshot sees this VM and refuses.
	e.set(r)
	fail := func(err error) (agentapi.VM, error) {
		return a.abandonCreate(ctx, e, r, fmt.Errorf("create vm %s from snapshot %s: %w", e.id, src.ID, err))
	}
	sn, err := a.snapshotter()
	if err != nil {
		return fail(err)
	}
	start := time.Now()
	from, err := peerOf(&src)
	if err != nil {
		return fail(err)
	}
	rec, err := a.ensureSnapshot(ctx, src.ID, from, nil)
	if err != nil {
		return fail(err)
	}
	pulled := time.Since(start)
	if rec.Image != spec.Image || rec.VCPUs != spec.VCPUs || rec.MemoryMiB != spec.MemoryMiB || rec.DiskMiB != spec.DiskMiB {
		return fail(errInvalid("snapshot %s is of a vm with image %s, %d vcpus, %d MiB memory, %d MiB disk: a vm started from it must have that shape",
			src.ID, rec.Image, rec.VCPUs, rec.MemoryMiB, rec.DiskMiB))
	}
	if err := checkChildNICs(src.ID, rec.NICs, spec.NICs); err != nil {
		return fail(err)
	}
	r.GuestNICs = cloneNICs(rec.NICs)
	e.set(r)
	a.pool.makeRoom(e.id)
	if err := os.MkdirAll(a.vmDir(e.id), 0o750); err != nil {
		return fail(err)
	}
	if err := a.saveRecord(&r); err != nil {
		return fail(err)
	}
	m := machineOf(a, r)
	if err := sn.Spawn(ctx, m, a.snapDir(src.ID), rec.files()); err != nil {
		return fail(err)
	}
	r.State, r.Process, r.Disk, r.NICs = agentapi.StateRunning, m.Process, m.Disk, m.NICs
	if err := a.saveRecord(&r); err != nil {
		return fail(err)
	}
	e.set(r)
	a.log.Info("vm started from snapshot", "vm", e.id, "snapshot", src.ID, "pid", r.Process.PID,
		"snapshot_ready_ms", pulled.Milliseconds(), "total_ms", time.Since(start).Milliseconds())
	return r.wire(), nil
}

// guestView is a VM's NICs as its guest sees them.
func guestView(r vmRecord) []agentapi.NIC {
	if len(r.GuestNICs) > 0 {
		return cloneNICs(r.GuestNICs)
	}
	return requestedNICs(r.NICs)
}

// checkChildNICs checks that a VM started from snapshot id has a NIC of
// the same network and mode for each NIC of the snapshot's guest: the
// guest's devices come back from the memory state, only their host side is
// the child's own.
func checkChildNICs(id string, guest, child []agentapi.NIC) error {
	if len(guest) != len(child) {
		return errInvalid("snapshot %s is of a vm with %d nics: a vm started from it needs %d nics (on the same networks), got %d",
			id, len(guest), len(guest), len(child))
	}
	for i := range guest {
		if guest[i].Network != child[i].Network || guest[i].Mode != child[i].Mode {
			return errInvalid("snapshot %s: nics[%d] of its vm is on network %s (mode %s): the child's nics[%d] must be too, got %s (mode %s)",
				id, i, guest[i].Network, guest[i].Mode, i, child[i].Network, child[i].Mode)
		}
		if guest[i].Mode == agentapi.NetworkNAT && guest[i].CIDR != child[i].CIDR {
			return errInvalid("snapshot %s: nics[%d] of its vm is on %s, the child's on %s: a child keeps its guest's network",
				id, i, guest[i].CIDR, child[i].CIDR)
		}
	}
	return nil
}

// ensureSnapshot returns snapshot id, pulling it (and the snapshots it builds
// on) from the agent at address when it is not here. Concurrent callers
// needing the same pull wait for one. chain holds the ids being pulled
// further up, against cycles in metadata sent by another agent.
func (a *Agent) ensureSnapshot(ctx context.Context, id string, from *peer, chain []string) (*snapshotRecord, error) {
	if slices.Contains(chain, id) || len(chain) >= maxSnapshotDepth {
		return nil, errConflict("snapshot %s: its parents %v form a cycle or are more than %d deep", id, chain, maxSnapshotDepth)
	}
	for {
		s := a.snaps.entry(id)
		if err := s.lock(ctx); err != nil {
			return nil, err
		}
		rec, corrupt, gone := s.state()
		switch {
		case gone:
			s.unlock()
			continue
		case rec != nil:
			s.unlock()
			return rec, nil
		case corrupt != "":
			s.unlock()
			return nil, errConflict("snapshot %s exists but %s", id, corrupt)
		case from == nil:
			a.snaps.drop(s)
			s.unlock()
			e := errConflict("snapshot %s does not exist on this agent; give snapshot.address to pull it from the agent that has it", id)
			e.Details = map[string]any{"snapshot": id}
			return nil, e
		}
		rec, err := a.pullSnapshot(ctx, id, from, append(slices.Clone(chain), id))
		if err != nil {
			a.snaps.drop(s)
			s.unlock()
			return nil, err
		}
		s.mu.Lock()
		s.rec = rec
		s.mu.Unlock()
		s.unlock()
		return rec, nil
	}
}

// errPull is the error of a pull that failed because of the other agent or
// the transfer (a 502: retrying may help).
func errPull(id, address string, err error) *Error {
	return &Error{Status: http.StatusBadGateway, Code: CodeUnavailable,
		Message: fmt.Sprintf("pull snapshot %s from agent %s failed", id, address), Err: err}
}

// pullSnapshot copies snapshot id from the agent at address into a pull
// directory, checks every file's size and sha256 against the metadata, and
// renames the directory into place only when all match. The caller holds
// the snapshot's lock.
func (a *Agent) pullSnapshot(ctx context.Context, id string, from *peer, chain []string) (*snapshotRecord, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), pullTimeout)
	defer cancel()
	start := time.Now()
	address := from.address
	c, err := a.peerClient(ctx, from)
	if err != nil {
		return nil, errPull(id, address, err)
	}
	meta, err := c.GetSnapshot(ctx, id)
	if errors.Is(err, agentapi.ErrNotFound) {
		e := errConflict("snapshot %s does not exist on agent %s either", id, address)
		e.Details = map[string]any{"snapshot": id, "address": address}
		return nil, e
	}
	if err != nil {
		return nil, errPull(id, address, fmt.Errorf("read its metadata: %w", err))
	}
	rec := &snapshotRecord{
		Version: snapshotVersion, ID: meta.ID, VMID: meta.VMID, Image: meta.Image, VCPUs: meta.VCPUs,
		MemoryMiB: meta.MemoryMiB, DiskMiB: meta.DiskMiB, Files: meta.Files, Parent: meta.Parent,
		Origin: address, CreatedAt: meta.CreatedAt, NICs: meta.NICs,
	}
	if err := rec.validate(id); err != nil {
		return nil, errPull(id, address, fmt.Errorf("its metadata is not usable: %w", err))
	}
	if _, err := a.cfg.Driver.Image(rec.Image); err != nil {
		return nil, errConflict("snapshot %s is of image %s, which this agent does not have: %v", id, rec.Image, err)
	}
	if rec.Parent != "" {
		if _, err := a.ensureSnapshot(ctx, rec.Parent, from, chain); err != nil {
			return nil, fmt.Errorf("snapshot %s builds on snapshot %s: %w", id, rec.Parent, err)
		}
	}
	dir, err := os.MkdirTemp(a.snapsDir(), pullPrefix+id+"-")
	if err != nil {
		return nil, fmt.Errorf("pull snapshot %s: %w", id, err)
	}
	done := false
	defer func() {
		if !done {
			if err := os.RemoveAll(dir); err != nil {
				a.log.Warn("remove unfinished pull", "snapshot", id, "dir", dir, "err", err)
			}
		}
	}()
	var bytes int64
	for _, f := range rec.Files {
		if err := a.pullFile(ctx, c, id, dir, f); err != nil {
			a.log.Warn("snapshot pull rejected", "snapshot", id, "from", address, "file", f.Name, "err", err)
			return nil, errPull(id, address, err)
		}
		bytes += f.SizeBytes
	}
	if err := a.adoptPulled(ctx, dir, rec); err != nil {
		a.log.Warn("snapshot pull refused: its disk chain", "snapshot", id, "from", address, "err", err)
		e := errConflict("snapshot %s from agent %s refused: %v", id, address, err)
		e.Details = map[string]any{"snapshot": id}
		return nil, e
	}
	if err := a.commitSnapshotDir(dir, rec); err != nil {
		return nil, fmt.Errorf("pull snapshot %s: %w", id, err)
	}
	done = true
	a.log.Info("snapshot pulled", "snapshot", id, "from", address, "bytes", bytes, "ms", time.Since(start).Milliseconds())
	return rec, nil
}

// pullFile streams one file into dir and checks it against f.
func (a *Agent) pullFile(ctx context.Context, c *agentapi.Client, id, dir string, f agentapi.SnapshotFile) error {
	body, _, err := c.OpenSnapshotFile(ctx, id, f.Name)
	if err != nil {
		return fmt.Errorf("open file %s: %w", f.Name, err)
	}
	defer func() { _ = body.Close() }()
	path := filepath.Join(dir, f.Name)
	out, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o640)
	if err != nil {
		return err
	}
	var n int64
	var sum string
	if f.Kind == agentapi.SnapshotFileRAM {
		sum, n, err = ReadSparse(out, body, f.SizeBytes)
	} else {
		h := sha256.New()
		// One byte more than announced, to see a file that is too long.
		n, err = io.Copy(io.MultiWriter(out, h), io.LimitReader(body, f.SizeBytes+1))
		sum = digestOf(h)
		if err == nil && n != f.SizeBytes {
			err = fmt.Errorf("got %d bytes, the metadata says %d", n, f.SizeBytes)
		}
	}
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	switch {
	case err != nil:
		return fmt.Errorf("file %s (%d bytes): transfer failed after %d bytes: %w", f.Name, f.SizeBytes, n, err)
	case sum != f.SHA256:
		return fmt.Errorf("file %s: sha256 %s, the metadata says %s: corrupted in transit or changed at the source", f.Name, sum, f.SHA256)
	}
	return nil
}

// adoptPulled has the driver check the disk chain of a pulled snapshot and
// rewrite its backing file names to this agent's files (Snapshotter), then
// records the new digests of the files it rewrote and makes the frozen
// disks and RAM image read-only, as at the source.
func (a *Agent) adoptPulled(ctx context.Context, dir string, rec *snapshotRecord) error {
	sn, err := a.snapshotter()
	if err != nil {
		return err
	}
	from := PulledFrom{Image: rec.Image}
	if rec.Parent != "" {
		p := a.snaps.lookup(rec.Parent)
		if p == nil {
			return fmt.Errorf("its parent snapshot %s is not here", rec.Parent)
		}
		prec, _, gone := p.state()
		if prec == nil || gone {
			return fmt.Errorf("its parent snapshot %s is not here", rec.Parent)
		}
		from.ParentDir, from.ParentFiles = a.snapDir(rec.Parent), prec.files()
	}
	rewritten, err := sn.AdoptPulled(ctx, dir, rec.files(), from)
	if err != nil {
		return err
	}
	for i, f := range rec.Files {
		path := filepath.Join(dir, f.Name)
		if slices.Contains(rewritten, f.Name) {
			size, sum, err := hashFile(path, f.Kind, "")
			if err != nil {
				return fmt.Errorf("digest of rewritten %s: %w", f.Name, err)
			}
			rec.Files[i].SizeBytes, rec.Files[i].SHA256 = size, sum
		}
		if f.Kind != agentapi.SnapshotFileMemory {
			if err := os.Chmod(path, 0o444); err != nil {
				return err
			}
		}
	}
	return nil
}
