package agent

// Snapshot files reach the disk after the snapshot is answered.
//
// Syncing a fork's RAM image (tens to hundreds of MiB) takes as long as the
// rest of a snapshot or a pull, and nothing that starts children needs it:
// they read the files through the page cache. So a snapshot, taken or
// pulled, is committed with "unsynced" in its metadata (itself synced, as is
// the rename that makes the snapshot exist), and a goroutine syncs the files
// a little later (syncDelay) and rewrites the metadata without the flag.
//
// Only a host that stops in that window (power loss, kernel crash) can lose
// file contents; an agent that stops can not, the page cache outlives it.
// So an agent that starts and finds the flag checks every file against its
// digest: a match is synced and the flag cleared, a mismatch makes the
// snapshot corrupt (only delete works; a pulled one is pulled again by the
// next child that needs it once deleted). Nothing is used that is not what
// the metadata promises.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"
)

// syncDelay is how long a sync waits (unless the agent closes): the
// children of a fork start right after its snapshot, and a sync of hundreds
// of MiB would hold up their small synced writes (ext4 commits them behind
// it): measured, it took a local child's overlay from ~25 to ~140 ms.
const syncDelay = 2 * time.Second

// syncTimeout bounds the wait for a snapshot's lock to rewrite its metadata.
const syncTimeout = time.Minute

// syncLater syncs the files of rec, a snapshot just committed, in the
// background. Its caller holds the snapshot's lock and registers rec
// before it lets go of it.
func (a *Agent) syncLater(rec *snapshotRecord) {
	a.syncs.Go(func() {
		select {
		case <-time.After(syncDelay):
		case <-a.closing:
		}
		start := time.Now()
		if err := a.syncSnapshot(rec); err != nil {
			// It stays unsynced: the next start checks its files.
			a.log.Warn("sync snapshot files", "snapshot", rec.ID, "err", err)
			return
		}
		a.log.Debug("snapshot files synced", "snapshot", rec.ID, "ms", time.Since(start).Milliseconds())
	})
}

func (a *Agent) syncSnapshot(rec *snapshotRecord) error {
	dir := a.snapDir(rec.ID)
	if err := syncFiles(dir, rec); err != nil {
		if _, serr := os.Stat(dir); errors.Is(serr, os.ErrNotExist) {
			return nil // deleted meanwhile
		}
		return err
	}
	s := a.snaps.lookup(rec.ID)
	if s == nil {
		return nil // deleted meanwhile
	}
	ctx, cancel := context.WithTimeout(context.Background(), syncTimeout)
	defer cancel()
	if err := s.lock(ctx); err != nil {
		return err
	}
	defer s.unlock()
	cur, _, gone := s.state()
	if gone || cur != rec {
		return nil // deleted (and maybe taken again) meanwhile
	}
	synced := *rec
	synced.Unsynced = false
	if err := a.writeSnapshotMeta(dir, &synced); err != nil {
		return err
	}
	s.set(&synced)
	return nil
}

func syncFiles(dir string, rec *snapshotRecord) error {
	for _, f := range rec.Files {
		fh, err := os.Open(filepath.Join(dir, f.Name))
		if err != nil {
			return err
		}
		err = fh.Sync()
		_ = fh.Close()
		if err != nil {
			return fmt.Errorf("sync %s: %w", f.Name, err)
		}
	}
	return nil
}

func (a *Agent) writeSnapshotMeta(dir string, rec *snapshotRecord) error {
	b, err := json.MarshalIndent(rec, "", "  ")
	if err != nil {
		return err
	}
	return writeFileAtomic(filepath.Join(dir, snapshotMetaFile), b, !a.cfg.NoSync)
}

// recoverUnsynced checks the files of a snapshot found unsynced at start
// against its metadata; when all match, it syncs them and clears the flag.
func (a *Agent) recoverUnsynced(dir string, rec *snapshotRecord) error {
	for _, f := range rec.Files {
		_, want := ramHash(f)
		size, sum, err := digestFile(filepath.Join(dir, f.Name), f, "")
		if err != nil || size != f.SizeBytes || sum != want {
			if err == nil {
				err = fmt.Errorf("%d bytes with %s %s, the metadata says %d with %s", size, digestName(f), sum, f.SizeBytes, want)
			}
			return fmt.Errorf("file %s of the snapshot does not match its metadata (the host stopped before it reached the disk?): %v; "+
				"delete the snapshot (a pulled one is pulled again by the next child that needs it)", f.Name, err)
		}
	}
	if err := syncFiles(dir, rec); err != nil {
		return fmt.Errorf("sync the snapshot's files: %w", err)
	}
	rec.Unsynced = false
	if err := a.writeSnapshotMeta(dir, rec); err != nil {
		return fmt.Errorf("rewrite the snapshot's metadata: %w", err)
	}
	a.log.Info("snapshot left unsynced checked and synced", "dir", dir)
	return nil
}
