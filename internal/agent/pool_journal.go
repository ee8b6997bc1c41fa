package agent

// The handover journal: a warm handover made durable with one sync.
//
// A handover makes warm VM W the user's VM X: X's metadata is written into
// pool/W, pool/W is renamed to vms/X, and pool/W becomes a link to it. Made
// durable step by step, that is a file fsync and three directory fsyncs
// (vms/X, vms/, pool/), most of a warm create's time in the agent. Here
// the handover is instead one record (W and X's whole metadata) appended to
// pool-journal in the state directory and synced once (fdatasync of one
// file, the only sync a create waits for); the file moves behind it are
// plain, unsynced. Once the record is durable the handover is: whatever
// part of the moves a crash loses, the next start replays the record
// (replayHandovers) before it loads the VMs, and the replay is idempotent:
//
//   - vms/X absent and pool/W a directory: the moves never happened; they
//     are done again (metadata, rename, link);
//   - vms/X present: its metadata is written again only when missing or
//     unreadable (an unsynced write lost), never over a valid one, which
//     may be newer (a power action since) or another VM of the same id
//     (X deleted and created again: its created_at differs, the record is
//     stale and skipped); the pool/W link is made when missing;
//   - neither: X was deleted since (or the handover aborted); nothing to do.
//
// A handover that fails after its record appends an abort record, so that
// no replay brings back a VM whose create failed. A record torn by a crash
// fails its checksum: its write never returned, so its create was never
// answered, and the warm VM it names is an orphan that the pool's
// reconcile destroys.
//
// Compaction makes the moves of the records in the file durable (the
// metadata files and the three directories, the same fsyncs as before,
// but batched and off the create's path: the filler runs it once a burst
// of creates pauses, or when many records wait) and then truncates the
// file. The truncation needs no sync of its own: the next record's sync
// covers it, and a replay of records already compacted changes nothing.
//
// Other designs with one sync were set aside: syncfs(2) of the state
// directory's file system syncs every guest's dirty disk pages too, its
// cost unbounded; writing the metadata into pool/W synced and leaving the
// renames unsynced needs a sync of pool/W too (where the file's entry
// is), and an fsync of a new file and of its directory are two syncs.

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"syscall"
)

const (
	poolJournalName = "pool-journal"

	journalHandover = "handover"
	journalAbort    = "abort"

	// journalMaxPending is how many records make the filler compact even
	// while creates keep coming.
	journalMaxPending = 64
)

// Hold points of a handover (Config.handoverHook): tests stop the agent there.
const (
	HoldBeforeJournal    = "before-journal"    // the warm VM resumed, its record not written
	HoldAfterJournal     = "after-journal"     // the record durable, the files not moved
	HoldAfterMove        = "after-move"        // the files moved, the create not answered
	HoldBeforeCompaction = "before-compaction" // answered; the record not compacted
)

var journalCRC = crc32.MakeTable(crc32.Castagnoli)

// journalRecord is one line of pool-journal, after its checksum.
type journalRecord struct {
	Op     string   `json:"op"` // handover or abort
	WarmVM string   `json:"warm_vm"`
	VM     vmRecord `json:"vm"` // abort: only its id
}

// handoverJournal is the open pool-journal.
type handoverJournal struct {
	path     string
	vmsDir   string
	poolDir  string
	sync     bool
	log      *slog.Logger
	hold     func(step string)
	compacts sync.Mutex // one compaction at a time

	mu sync.Mutex // guards the fields below and the writes
	f  *os.File   // nil once closed
	// pending are the VM ids of the records in the file; moving those of
	// records whose files are not moved yet.
	pending []string
	moving  int
}

func encodeJournalRecord(r *journalRecord) ([]byte, error) {
	b, err := json.Marshal(r)
	if err != nil {
		return nil, err
	}
	line := fmt.Appendf(nil, "%08x ", crc32.Checksum(b, journalCRC))
	line = append(line, b...)
	return append(line, '\n'), nil
}

// append writes one record in one write and, for a handover, counts it
// as moving until moved is called.
func (j *handoverJournal) append(r *journalRecord) error {
	line, err := encodeJournalRecord(r)
	if err != nil {
		return err
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.f == nil {
		return errors.New("the handover journal is closed: the agent stops")
	}
	if _, err := j.f.Write(line); err != nil {
		return err
	}
	j.pending = append(j.pending, r.VM.ID)
	if r.Op == journalHandover {
		j.moving++
	}
	return nil
}

// syncFile makes what was appended durable. Concurrent handovers sync
// outside the lock: one fdatasync covers every record written before it.
func (j *handoverJournal) syncFile() error {
	if !j.sync {
		return nil
	}
	j.mu.Lock()
	f := j.f
	j.mu.Unlock()
	if f == nil {
		return errors.New("the handover journal is closed: the agent stops")
	}
	// Through the file's raw connection: its descriptor stays valid
	// during the call even if the journal closes meanwhile.
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) { serr = syscall.Fdatasync(int(fd)) }); err != nil {
		return err
	}
	return serr
}

// begin records the handover of warm VM warm as VM r, durably: the one
// sync of a warm create.
func (j *handoverJournal) begin(warm string, r *vmRecord) error {
	if err := j.append(&journalRecord{Op: journalHandover, WarmVM: warm, VM: *r}); err != nil {
		return fmt.Errorf("append to handover journal %s: %w", j.path, err)
	}
	if err := j.syncFile(); err != nil {
		// The record may still reach the disk: abort it.
		j.moved()
		j.abort(warm, r.ID)
		return fmt.Errorf("sync handover journal %s: %w", j.path, err)
	}
	return nil
}

// moved says one handover's files were moved, or its moves given up.
func (j *handoverJournal) moved() {
	j.mu.Lock()
	j.moving--
	j.mu.Unlock()
}

// abort records that the handover of warm to vm failed, so that no replay
// brings the VM back; it is synced, a failure only logged (a replay of the
// handover then makes a VM that the control plane deletes as an orphan).
func (j *handoverJournal) abort(warm, vm string) {
	err := j.append(&journalRecord{Op: journalAbort, WarmVM: warm, VM: vmRecord{ID: vm}})
	if err == nil {
		err = j.syncFile()
	}
	if err != nil {
		j.log.Error("record an aborted handover in the journal; a restart may bring the vm back, and the control plane then deletes it",
			"vm", vm, "warm_vm", warm, "path", j.path, "err", err)
	}
}

// due says whether the filler should compact even while creates go on.
func (j *handoverJournal) due() bool {
	j.mu.Lock()
	defer j.mu.Unlock()
	return len(j.pending) >= journalMaxPending
}

// compact makes the moves of the records in the file durable and empties
// the file. It does nothing while a handover is between its record and its
// moves; records appended meanwhile wait for the next compaction.
func (j *handoverJournal) compact() {
	j.compacts.Lock()
	defer j.compacts.Unlock()
	j.mu.Lock()
	ids := append([]string(nil), j.pending...)
	idle := j.moving == 0 && j.f != nil
	j.mu.Unlock()
	if len(ids) == 0 || !idle {
		return
	}
	if j.hold != nil {
		j.hold(HoldBeforeCompaction)
	}
	if j.sync {
		j.syncMoves(ids)
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.f == nil || j.moving > 0 || len(j.pending) != len(ids) {
		return // a handover came meanwhile: the next compaction takes all
	}
	if err := j.f.Truncate(0); err != nil {
		j.log.Warn("truncate the handover journal; it is compacted at the next chance", "path", j.path, "err", err)
		return
	}
	j.pending = nil
}

// syncMoves fsyncs what the handovers of VMs ids wrote and renamed: each
// VM's metadata and directory, vms/ and pool/. A VM deleted since is
// skipped.
func (j *handoverJournal) syncMoves(ids []string) {
	seen := map[string]bool{}
	var wg sync.WaitGroup
	for _, id := range ids {
		if seen[id] {
			continue
		}
		seen[id] = true
		wg.Add(1)
		go func() {
			defer wg.Done()
			for _, path := range []string{filepath.Join(j.vmsDir, id, metaFile), filepath.Join(j.vmsDir, id)} {
				f, err := os.Open(path)
				if errors.Is(err, os.ErrNotExist) {
					return
				}
				if err == nil {
					err = f.Sync()
					_ = f.Close()
				}
				if err != nil {
					j.log.Warn("sync a handed-over vm's files", "vm", id, "path", path, "err", err)
				}
			}
		}()
	}
	wg.Wait()
	syncDirs(j.log, j.vmsDir, j.poolDir)
}

// close compacts and closes the file.
func (j *handoverJournal) close() {
	j.compact()
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.f != nil {
		_ = j.f.Close()
		j.f = nil
	}
}

// openHandoverJournal replays pool-journal (the handovers a previous agent
// recorded), compacts it and opens it for this agent's handovers. It runs
// before the VMs are loaded: a replayed handover makes a VM directory.
func openHandoverJournal(a *Agent) (*handoverJournal, error) {
	j := &handoverJournal{
		path: filepath.Join(a.cfg.StateDir, poolJournalName), vmsDir: a.vmsDir(),
		poolDir: filepath.Join(a.cfg.StateDir, poolDirName), sync: !a.cfg.NoSync,
		log: a.log.With("component", "pool"), hold: a.cfg.handoverHook,
	}
	ids, err := j.replay()
	if err != nil {
		return nil, err
	}
	f, err := os.OpenFile(j.path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open handover journal %s: %w", j.path, err)
	}
	j.f, j.pending = f, ids
	j.compact()
	return j, nil
}

// replay reads the journal and finishes each handover it records. It
// returns the ids of the VMs it names, for compaction.
func (j *handoverJournal) replay() ([]string, error) {
	b, err := os.ReadFile(j.path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read handover journal %s: %w", j.path, err)
	}
	var handovers []journalRecord
	var ids []string
	for n := 1; len(b) > 0; n++ {
		i := bytes.IndexByte(b, '\n')
		if i < 0 {
			j.log.Warn("torn last record of the handover journal ignored: its create was never answered",
				"path", j.path, "record", n, "bytes", len(b))
			break
		}
		line := b[:i]
		b = b[i+1:]
		r, err := decodeJournalRecord(line)
		if err != nil {
			j.log.Error("bad handover journal record skipped", "path", j.path, "record", n, "err", err)
			continue
		}
		ids = append(ids, r.VM.ID)
		switch r.Op {
		case journalHandover:
			handovers = append(handovers, r)
		case journalAbort:
			handovers = dropHandover(handovers, r.WarmVM, r.VM.ID)
		}
	}
	for _, r := range handovers {
		j.redo(r.WarmVM, r.VM)
	}
	return ids, nil
}

func decodeJournalRecord(line []byte) (journalRecord, error) {
	var r journalRecord
	var sum uint32
	if len(line) < 10 || line[8] != ' ' {
		return r, errors.New("no checksum")
	}
	if _, err := fmt.Sscanf(string(line[:8]), "%08x", &sum); err != nil {
		return r, fmt.Errorf("checksum: %w", err)
	}
	body := line[9:]
	if crc32.Checksum(body, journalCRC) != sum {
		return r, errors.New("checksum mismatch")
	}
	if err := json.Unmarshal(body, &r); err != nil {
		return r, err
	}
	switch {
	case !warmIDPattern.MatchString(r.WarmVM):
		return r, fmt.Errorf("warm vm id %q is not one", r.WarmVM)
	case checkID(r.VM.ID) != nil:
		return r, fmt.Errorf("vm id %q is not valid", r.VM.ID)
	case r.Op == journalAbort:
		return r, nil
	case r.Op != journalHandover:
		return r, fmt.Errorf("unknown op %q", r.Op)
	}
	return r, r.VM.validate(r.VM.ID)
}

func dropHandover(rs []journalRecord, warm, vm string) []journalRecord {
	out := rs[:0]
	for _, r := range rs {
		if r.WarmVM != warm || r.VM.ID != vm {
			out = append(out, r)
		}
	}
	return out
}

// redo finishes the handover of warm VM warm as VM r (see the top of the
// file); a step that fails is logged, and the pool's reconcile and the VM
// loader then treat what is left as they would without the journal.
func (j *handoverJournal) redo(warm string, r vmRecord) {
	from, to := filepath.Join(j.poolDir, warm), filepath.Join(j.vmsDir, r.ID)
	meta := filepath.Join(to, metaFile)
	log := j.log.With("vm", r.ID, "warm_vm", warm)
	if fi, err := os.Lstat(to); err == nil && fi.IsDir() {
		switch cur, err := readRecord(meta, r.ID); {
		case err == nil && (cur.StartedFrom != r.StartedFrom || !cur.CreatedAt.Equal(r.CreatedAt)):
			log.Info("handover journal record is stale: the vm was deleted and created again since")
			return
		case err != nil:
			if err := writeNewRecord(meta, &r, false); err != nil {
				log.Error("write the metadata of a handed-over vm from the journal", "path", meta, "err", err)
				return
			}
			log.Warn("metadata of a handed-over vm written again from the journal", "reason", err)
		}
		if _, err := os.Lstat(from); errors.Is(err, os.ErrNotExist) {
			j.link(log, from, r.ID)
		}
		return
	}
	if fi, err := os.Lstat(from); err != nil || !fi.IsDir() {
		return // deleted since, or aborted
	}
	if err := writeNewRecord(filepath.Join(from, metaFile), &r, false); err != nil {
		log.Error("write the metadata of a handed-over vm from the journal; the warm vm stays an orphan", "err", err)
		return
	}
	if err := os.Rename(from, to); err != nil {
		log.Error("move a handed-over vm from the journal; the warm vm stays an orphan", "err", err)
		return
	}
	j.link(log, from, r.ID)
	log.Warn("handover finished from the journal: the agent stopped in its middle")
}

// link makes pool/<warm> a link to the VM it became: the paths on its
// VMM's command line stay valid.
func (j *handoverJournal) link(log *slog.Logger, from, id string) {
	if err := os.Symlink(filepath.Join("..", filepath.Base(j.vmsDir), id), from); err != nil {
		log.Warn("link the pool path of a handed-out vm", "link", from, "err", err)
	}
}

// readRecord reads and checks the metadata file of VM id.
func readRecord(path, id string) (vmRecord, error) {
	var r vmRecord
	b, err := os.ReadFile(path)
	if err == nil {
		err = json.Unmarshal(b, &r)
	}
	if err == nil {
		err = r.validate(id)
	}
	return r, err
}
