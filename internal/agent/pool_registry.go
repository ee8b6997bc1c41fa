package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
)

// registryFile is pool.json. Entries are decoded one by one, so that one bad
// entry drops only itself.
type registryFile struct {
	Version int               `json:"version"`
	Entries []json.RawMessage `json:"entries"`
}

// targetsFile is pool-targets.json.
type targetsFile struct {
	Version int            `json:"version"`
	Targets []targetRecord `json:"targets"`
}

type targetRecord struct {
	Image     string `json:"image"`
	VCPUs     int64  `json:"vcpus"`
	MemoryMiB int64  `json:"memory_mib"`
	DiskMiB   int64  `json:"disk_mib"`
	Size      int    `json:"size"`
}

func (p *pool) registryPath() string { return filepath.Join(p.a.cfg.StateDir, poolRegistryName) }
func (p *pool) targetsPath() string  { return filepath.Join(p.a.cfg.StateDir, poolTargetsName) }

// save writes the registry as it is now: a temporary file, synced, renamed
// over pool.json. A failure is logged and changes nothing else: the pool
// keeps working, and the next agent start still finds every warm VM (it
// sweeps the pool directory) and never a handed-out one (its directory
// moved).
func (p *pool) save() { p.saveRegistry(!p.a.cfg.NoSync) }

// saveRegistry is save, the file synced or not.
func (p *pool) saveRegistry(sync bool) {
	p.saveMu.Lock()
	defer p.saveMu.Unlock()
	p.mu.Lock()
	list := make([]warmVM, 0, len(p.entries))
	for _, w := range p.entries {
		list = append(list, *w)
	}
	p.mu.Unlock()
	sort.Slice(list, func(i, j int) bool { return list[i].ID < list[j].ID })
	f := registryFile{Version: poolVersion, Entries: make([]json.RawMessage, 0, len(list))}
	for i := range list {
		b, err := json.Marshal(&list[i])
		if err != nil {
			p.log.Error("encode pool registry entry", "warm_vm", list[i].ID, "err", err)
			continue
		}
		f.Entries = append(f.Entries, b)
	}
	b, err := json.MarshalIndent(f, "", "  ")
	if err == nil {
		err = writeFileAtomic(p.registryPath(), b, sync)
	}
	if err != nil {
		p.log.Error("write the pool registry; the pool goes on without it", "path", p.registryPath(), "err", err)
	}
}

// quarantine moves a corrupt file aside to <file>.corrupt.
func (p *pool) quarantine(path string, why error) {
	if err := os.Rename(path, path+corruptSuffix); err != nil {
		p.log.Error("corrupt pool file; moving it aside failed", "path", path, "reason", why, "err", err)
		return
	}
	p.log.Error("corrupt pool file moved aside", "path", path, "moved_to", path+corruptSuffix, "reason", why)
}

// loadRegistry reads pool.json: the valid entries, and the ids of bad
// entries when they have a safe one. A file that is not a registry at all
// is quarantined and reads as empty.
func (p *pool) loadRegistry() (good []warmVM, badIDs []string) {
	path := p.registryPath()
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		p.log.Error("read the pool registry; its warm vms are found by the directory sweep", "path", path, "err", err)
		return nil, nil
	}
	var f registryFile
	if err := json.Unmarshal(b, &f); err != nil {
		p.quarantine(path, err)
		return nil, nil
	}
	if f.Version != poolVersion {
		p.quarantine(path, fmt.Errorf("version %d, want %d", f.Version, poolVersion))
		return nil, nil
	}
	for i, raw := range f.Entries {
		var w warmVM
		err := json.Unmarshal(raw, &w)
		if err == nil {
			err = w.validate()
		}
		if err == nil {
			good = append(good, w)
			continue
		}
		var id struct {
			ID string `json:"id"`
		}
		_ = json.Unmarshal(raw, &id)
		safe := warmIDPattern.MatchString(id.ID)
		p.log.Error("bad pool registry entry dropped", "index", i, "id", id.ID, "id_usable", safe, "err", err)
		if safe {
			badIDs = append(badIDs, id.ID)
		}
	}
	return good, badIDs
}

func (w *warmVM) validate() error {
	switch {
	case !warmIDPattern.MatchString(w.ID):
		return fmt.Errorf("id %q is not a warm vm id", w.ID)
	case w.Image == "" || w.VCPUs < 1 || w.MemoryMiB < 1 || w.DiskMiB < 0:
		return errors.New("image or shape missing")
	case w.State != warmBooting && w.State != warmReady:
		return fmt.Errorf("unknown state %q", w.State)
	}
	return nil
}

// reconcile destroys what a previous agent left in the pool. Every warm VM
// found is an orphan: the registry's entries, the directories under pool/
// that it does not name (a crash before a registry write, or a failed
// write), and what bad entries point at when their id is safe. It never
// touches a VM handed to a user: its directory moved to vms/ (pool/ holds a
// symlink), its metadata names the pool directory, and the driver checks
// where the process's files are before it ends one.
func (p *pool) reconcile(ctx context.Context) {
	good, badIDs := p.loadRegistry()
	handed := map[string]string{} // launch directory -> user VM id
	for _, e := range p.a.vms.all() {
		if r, _, _ := e.state(); r.Process.LaunchDir != "" {
			handed[r.Process.LaunchDir] = e.id
		}
	}
	seen := map[string]bool{}
	destroyed := 0
	orphan := func(m *Machine, why string) {
		seen[m.ID] = true
		if vm, ok := handed[m.Dir]; ok {
			p.log.Info("pool entry already handed to a vm; not an orphan", "warm_vm", m.ID, "vm", vm)
			return
		}
		if fi, err := os.Lstat(m.Dir); err == nil && fi.Mode()&os.ModeSymlink != 0 {
			p.log.Info("pool entry already handed to a vm; not an orphan", "warm_vm", m.ID, "link", m.Dir)
			return
		}
		if p.wd != nil {
			if err := p.wd.KillOrphan(ctx, m); err != nil {
				p.log.Error("end an orphan warm vm; the next agent start retries", "warm_vm", m.ID, "err", err)
				return
			}
		}
		p.removeDir(m.Dir)
		destroyed++
		p.log.Info("orphan warm vm destroyed", "warm_vm", m.ID, "found", why, "pid", m.Process.PID)
	}
	for i := range good {
		orphan(p.machine(&good[i]), "in the registry")
	}
	for _, id := range badIDs {
		if !seen[id] {
			orphan(&Machine{ID: id, Dir: p.warmDir(id)}, "in a bad registry entry")
		}
	}
	entries, err := os.ReadDir(p.dir)
	if err != nil {
		p.log.Error("read the pool directory", "dir", p.dir, "err", err)
	}
	for _, e := range entries {
		name := e.Name()
		switch {
		case seen[name]:
		case e.Type()&os.ModeSymlink != 0:
			p.removeDeadLink(name)
		case strings.HasPrefix(name, trashPrefix):
			if err := os.RemoveAll(filepath.Join(p.dir, name)); err != nil {
				p.log.Warn("remove the rest of a destroyed warm vm", "dir", name, "err", err)
			}
		case e.IsDir() && warmIDPattern.MatchString(name):
			orphan(&Machine{ID: name, Dir: p.warmDir(name)}, "in the pool directory, not in the registry")
		default:
			p.log.Warn("unknown file in the pool directory left alone", "name", name)
		}
	}
	p.save() // empty: nothing found is handed out
	if destroyed > 0 || len(good) > 0 || len(badIDs) > 0 {
		p.log.Info("pool reconciled at start", "registry_entries", len(good), "bad_entries", len(badIDs), "destroyed", destroyed)
	}
}

// removeDeadLinks removes the pool/ links of handed-out VMs that were
// deleted since.
func (p *pool) removeDeadLinks() {
	entries, err := os.ReadDir(p.dir)
	if err != nil {
		return
	}
	for _, e := range entries {
		if e.Type()&os.ModeSymlink != 0 {
			p.removeDeadLink(e.Name())
		}
	}
}

func (p *pool) removeDeadLink(name string) {
	path := filepath.Join(p.dir, name)
	if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
		if err := os.Remove(path); err != nil {
			p.log.Warn("remove the link of a deleted vm", "link", path, "err", err)
		}
	}
}

// loadTargets reads pool-targets.json. A corrupt file is quarantined (no
// targets); a bad target drops only itself.
func (p *pool) loadTargets() map[poolKey]int {
	out := map[poolKey]int{}
	path := p.targetsPath()
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return out
	}
	if err != nil {
		p.log.Error("read the pool targets; the pool stays empty until they are set again", "path", path, "err", err)
		return out
	}
	var f targetsFile
	if err := json.Unmarshal(b, &f); err != nil {
		p.quarantine(path, err)
		return out
	}
	if f.Version != poolVersion {
		p.quarantine(path, fmt.Errorf("version %d, want %d", f.Version, poolVersion))
		return out
	}
	for i, t := range f.Targets {
		k := poolKey{t.Image, t.VCPUs, t.MemoryMiB, t.DiskMiB}
		if t.Image == "" || t.VCPUs < 1 || t.MemoryMiB < 1 || t.DiskMiB < 0 || t.Size < 1 || t.Size > p.opts.MaxSize {
			p.log.Error("bad pool target dropped", "index", i, "target", t)
			continue
		}
		out[k] = t.Size
	}
	return out
}

// saveTargets writes pool-targets.json atomically. Unlike the registry, a
// failure fails the PUT: a target that a restart would forget is not set.
func (p *pool) saveTargets(targets map[poolKey]int) error {
	keys := make([]poolKey, 0, len(targets))
	for k := range targets {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool { return keys[i].less(keys[j]) })
	f := targetsFile{Version: poolVersion, Targets: make([]targetRecord, 0, len(keys))}
	for _, k := range keys {
		f.Targets = append(f.Targets, targetRecord{k.Image, k.VCPUs, k.MemoryMiB, k.DiskMiB, targets[k]})
	}
	b, err := json.MarshalIndent(f, "", "  ")
	if err == nil {
		err = writeFileAtomic(p.targetsPath(), b, !p.a.cfg.NoSync)
	}
	if err != nil {
		return &Error{Status: http.StatusInternalServerError, Code: CodeInternal, Message: "save the warm pool targets to " + p.targetsPath() + "; nothing changed", Err: err}
	}
	return nil
}

// writeNewRecord writes a VM's metadata to a new file at path (no
// temporary file: the caller makes the file visible as a VM only after this
// returns).
func writeNewRecord(path string, r *vmRecord, sync bool) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	if _, err := f.Write(b); err != nil {
		_ = f.Close()
		return err
	}
	if sync {
		if err := f.Sync(); err != nil {
			_ = f.Close()
			return err
		}
	}
	return f.Close()
}

// syncDirs fsyncs directories at once (one journal commit can serve them
// all); a failure is logged.
func syncDirs(log *slog.Logger, dirs ...string) {
	var wg sync.WaitGroup
	for _, dir := range dirs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			d, err := os.Open(dir)
			if err == nil {
				err = d.Sync()
				_ = d.Close()
			}
			if err != nil {
				log.Warn("sync directory", "dir", dir, "err", err)
			}
		}()
	}
	wg.Wait()
}
