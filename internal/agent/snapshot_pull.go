package agent

// Pulling a snapshot from another agent, after it proved the identity the
// control plane pinned for it.

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

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
		s.set(rec)
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

// pullWatch is a pull under way, for the children of its snapshot that
// start from its files before it ends (snapshot_spawn.go). Once it is
// ready, the pull directory at holds the snapshot's disk files, checked
// and adopted, and its RAM image (if any) at its full size, still being
// written; rec is then a copy of the snapshot's metadata. done is closed
// when the pull ended, ok (under Agent.pullsMu) when the snapshot is
// verified and in place. A child opens files in at only between joinPull
// and leavePull: the pull moves or removes the directory only after every
// child that joined has left.
type pullWatch struct {
	at   string
	rec  snapshotRecord
	done chan struct{}

	// Under Agent.pullsMu.
	ready, committing, ok bool
	opening               sync.WaitGroup
}

// pullWaiters are the channels that hear of the next pull of a snapshot
// that gets ready, by snapshot id, under Agent.pullsMu.
type pullWaiters map[string][]chan *pullWatch

// awaitPull returns a channel that hears of the first pull of snapshot id
// that is ready (one under way and ready already, or a later one), and a
// function that stops listening.
func (a *Agent) awaitPull(id string) (<-chan *pullWatch, func()) {
	ch := make(chan *pullWatch, 1)
	a.pullsMu.Lock()
	defer a.pullsMu.Unlock()
	if w := a.pulls[id]; w != nil && w.ready && !w.committing {
		ch <- w
		return ch, func() {}
	}
	if a.pullWaiters == nil {
		a.pullWaiters = pullWaiters{}
	}
	a.pullWaiters[id] = append(a.pullWaiters[id], ch)
	return ch, func() {
		a.pullsMu.Lock()
		defer a.pullsMu.Unlock()
		a.pullWaiters[id] = slices.DeleteFunc(a.pullWaiters[id], func(c chan *pullWatch) bool { return c == ch })
		if len(a.pullWaiters[id]) == 0 {
			delete(a.pullWaiters, id)
		}
	}
}

// watchPull registers the pull of snapshot id that begins.
func (a *Agent) watchPull(id string) *pullWatch {
	w := &pullWatch{done: make(chan struct{})}
	a.pullsMu.Lock()
	defer a.pullsMu.Unlock()
	if a.pulls == nil {
		a.pulls = map[string]*pullWatch{}
	}
	a.pulls[id] = w
	return w
}

// readyPull tells the waiters of snapshot id that w is ready.
func (a *Agent) readyPull(id string, w *pullWatch) {
	a.pullsMu.Lock()
	defer a.pullsMu.Unlock()
	w.ready = true
	for _, ch := range a.pullWaiters[id] {
		ch <- w // buffered, and each hears once
	}
	delete(a.pullWaiters, id)
}

// joinPull says whether a child may open the files of w's pull directory;
// it must then call leavePull once it opened them or gave up.
func (a *Agent) joinPull(w *pullWatch) bool {
	a.pullsMu.Lock()
	defer a.pullsMu.Unlock()
	if w.committing {
		return false
	}
	w.opening.Add(1)
	return true
}

func (a *Agent) leavePull(w *pullWatch) { w.opening.Done() }

// closePull lets no more children join w and waits for those that did to
// leave.
func (a *Agent) closePull(w *pullWatch) {
	a.pullsMu.Lock()
	w.committing = true
	a.pullsMu.Unlock()
	w.opening.Wait()
}

// endPull ends the pull of snapshot id that w watches.
func (a *Agent) endPull(id string, w *pullWatch, ok bool) {
	a.pullsMu.Lock()
	if a.pulls[id] == w {
		delete(a.pulls, id)
	}
	w.ok = ok
	a.pullsMu.Unlock()
	close(w.done)
}

// pullOK says whether w's pull ended with the snapshot in place.
func (a *Agent) pullOK(w *pullWatch) bool {
	a.pullsMu.Lock()
	defer a.pullsMu.Unlock()
	return w.ok
}

// pullSnapshot copies snapshot id from the agent at address into a pull
// directory, checks every file's size and digest against the metadata, and
// renames the directory into place only when all match. The RAM image
// streams beside the disk chain; the pull is ready (see pullWatch) once the
// disk chain is checked, then the device state comes, and the pull ends
// when the RAM image is in too. The caller holds the snapshot's lock.
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
		Origin: address, CreatedAt: meta.CreatedAt, NICs: meta.NICs, SeedDisk: meta.SeedDisk,
		GuestAgent: meta.GuestAgent, FSFrozen: meta.FSFrozen,
		SecureBoot: meta.SecureBoot, Volumes: pulledSnapshotVolumes(meta.Volumes),
	}
	if meta.Firmware == agentapi.FirmwareUEFI {
		rec.Firmware = meta.Firmware
	}
	if err := rec.validate(id); err != nil {
		return nil, errPull(id, address, fmt.Errorf("its metadata is not usable: %w", err))
	}
	// A chain deeper than this agent's bound is refused before a byte
	// moves (disk_chain.go): its source flattens its chains.
	if n := countDiskFiles(rec.Files); n > a.cfg.DiskChainDepth {
		e := errConflict("snapshot %s on agent %s has a disk chain of %d files, more than this agent's depth of %d; its source flattens chains past its own depth (kvmd agent --disk-chain-depth): take a new snapshot there, or raise the depth here",
			id, address, n, a.cfg.DiskChainDepth)
		e.Details = map[string]any{"snapshot": id, "disk_files": n, "depth": a.cfg.DiskChainDepth}
		return nil, e
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
	w := a.watchPull(id)
	defer func() {
		// After the removal below: a child that started from the pull
		// directory learns the outcome only once it is settled.
		defer a.endPull(id, w, done)
		if !done {
			// Children that are opening the files go first: QEMU would
			// create a RAM image missing from a directory being removed.
			a.closePull(w)
			if err := os.RemoveAll(dir); err != nil {
				a.log.Warn("remove unfinished pull", "snapshot", id, "dir", dir, "err", err)
			}
		}
	}()
	// The RAM image exists at its full size (a hole) before anything may
	// map it; pullFile then fills it in.
	for _, f := range rec.Files {
		if f.Kind == agentapi.SnapshotFileRAM {
			if err := createSized(filepath.Join(dir, f.Name), f.SizeBytes); err != nil {
				return nil, fmt.Errorf("pull snapshot %s: %w", id, err)
			}
		}
	}
	// pull streams the files of one kind (the disk chain, the device state,
	// the RAM image), one at a time, and returns the bytes it moved.
	isRAM := func(f agentapi.SnapshotFile) bool { return f.Kind == agentapi.SnapshotFileRAM }
	pull := func(ctx context.Context, kind func(agentapi.SnapshotFile) bool) (int64, error) {
		var n int64
		for _, f := range rec.Files {
			if !kind(f) {
				continue
			}
			if err := a.pullFile(ctx, c, id, dir, f, isRAM(f)); err != nil {
				a.log.Warn("snapshot pull rejected", "snapshot", id, "from", address, "file", f.Name, "err", err)
				return n, errPull(id, address, err)
			}
			n += f.SizeBytes
		}
		return n, nil
	}
	// A uefi VM's variables come with the disks: a child started early
	// boots with its copy of them.
	isEarly := func(f agentapi.SnapshotFile) bool { return isDiskFile(f) || f.Kind == agentapi.SnapshotFileVars }
	isState := func(f agentapi.SnapshotFile) bool { return !isEarly(f) && !isRAM(f) }
	// The RAM image, by far the largest file, streams while the disk chain
	// arrives and is checked: nothing reads it before the whole pull is
	// verified. The device state, small, comes once the pull is ready and
	// children may start early.
	ramCtx, stopRAM := context.WithCancel(ctx)
	var (
		ramBytes int64
		ramErr   error
	)
	ramDone := make(chan struct{})
	go func() {
		defer close(ramDone)
		ramBytes, ramErr = pull(ramCtx, isRAM)
	}()
	// Every return from here ends that stream first: the deferred removal
	// of dir must not race its writes.
	defer func() {
		stopRAM()
		<-ramDone
	}()
	bytes, err := pull(ctx, isEarly)
	if err != nil {
		return nil, err
	}
	if err := a.adoptPulled(ctx, dir, rec); err != nil {
		a.log.Warn("snapshot pull refused: its disk chain", "snapshot", id, "from", address, "err", err)
		e := errConflict("snapshot %s from agent %s refused: %v", id, address, err)
		e.Details = map[string]any{"snapshot": id}
		return nil, e
	}
	disks := time.Since(start)
	w.at, w.rec = dir, *rec
	w.rec.Files, w.rec.NICs = slices.Clone(rec.Files), cloneNICs(rec.NICs)
	a.readyPull(id, w)
	n, err := pull(ctx, isState)
	if err != nil {
		return nil, err
	}
	<-ramDone
	if ramErr != nil {
		return nil, ramErr
	}
	bytes += n + ramBytes
	for _, f := range rec.Files {
		// The RAM image is read-only, as at the source (adoptPulled did
		// the disks).
		if f.Kind == agentapi.SnapshotFileRAM {
			if err := os.Chmod(filepath.Join(dir, f.Name), 0o444); err != nil {
				return nil, fmt.Errorf("pull snapshot %s: %w", id, err)
			}
		}
	}
	closePull := time.Now()
	a.closePull(w)
	opening := time.Since(closePull)
	if err := a.commitSnapshotDir(dir, rec); err != nil {
		return nil, fmt.Errorf("pull snapshot %s: %w", id, err)
	}
	done = true
	a.log.Info("snapshot pulled", "snapshot", id, "from", address, "bytes", bytes, "disks_ms", disks.Milliseconds(),
		"children_opening_ms", opening.Milliseconds(),
		"ms", time.Since(start).Milliseconds())
	return rec, nil
}

// pullFile streams one file into dir and checks it against f. created
// says that the pull made the file already (createSized), to be filled in:
// written only by this pull, in a directory of its own.
func (a *Agent) pullFile(ctx context.Context, c *agentapi.Client, id, dir string, f agentapi.SnapshotFile, created bool) error {
	body, _, err := c.OpenSnapshotFile(ctx, id, f.Name)
	if err != nil {
		return fmt.Errorf("open file %s: %w", f.Name, err)
	}
	defer func() { _ = body.Close() }()
	path := filepath.Join(dir, f.Name)
	flags := os.O_CREATE | os.O_EXCL | os.O_WRONLY
	if created {
		flags = os.O_WRONLY
	}
	out, err := os.OpenFile(path, flags, 0o640)
	if err != nil {
		return err
	}
	var n int64
	var sum string
	newHash, want := ramHash(f)
	if f.Kind == agentapi.SnapshotFileRAM {
		sum, n, err = ReadSparse(out, body, f.SizeBytes, newHash)
	} else {
		h := newHash()
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
	case sum != want:
		return fmt.Errorf("file %s: %s %s, the metadata says %s: corrupted in transit or changed at the source", f.Name, digestName(f), sum, want)
	}
	return nil
}

// isDiskFile says whether f is a file of a snapshot's disk chain.
func isDiskFile(f agentapi.SnapshotFile) bool {
	return f.Kind == agentapi.SnapshotFileDisk || f.Kind == agentapi.SnapshotFileBacking
}

// countDiskFiles is how many files of a snapshot's disk chain files lists.
func countDiskFiles(files []agentapi.SnapshotFile) int {
	n := 0
	for _, f := range files {
		if isDiskFile(f) {
			n++
		}
	}
	return n
}

// createSized creates the file path with size bytes, all a hole.
func createSized(path string, size int64) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o640)
	if err != nil {
		return err
	}
	err = f.Truncate(size)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
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
			size, sum, err := digestFile(path, f, "")
			if err != nil {
				return fmt.Errorf("digest of rewritten %s: %w", f.Name, err)
			}
			rec.Files[i].SizeBytes = size
			setDigest(&rec.Files[i], sum)
		}
		if isDiskFile(f) {
			if err := os.Chmod(path, 0o444); err != nil {
				return err
			}
		}
	}
	return nil
}
