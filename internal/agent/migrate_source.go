package agent

// The source's side of a migration: POST /v1/vms/{id}/migrate starts it
// in the background (holding the VM's operation lock throughout), GET
// /v1/vms/{id}/migration follows it, DELETE cancels it. Once the VMM
// completed the stream the VM is migrated here (stopped for good), and the
// source commits the target, which only then runs it.

import (
	"archive/tar"
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// outMigration is a migration this agent runs now (Agent.outgoing).
type outMigration struct {
	cancel context.CancelFunc
	done   chan struct{}

	mu        sync.Mutex
	status    agentapi.Migration
	cancelled bool
}

func (o *outMigration) get() agentapi.Migration {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.status
}

func (o *outMigration) update(fn func(*agentapi.Migration)) {
	o.mu.Lock()
	defer o.mu.Unlock()
	fn(&o.status)
}

// outgoingOf returns the migration of VM id this agent runs now, or nil.
func (a *Agent) outgoingOf(id string) *outMigration {
	a.migMu.Lock()
	defer a.migMu.Unlock()
	return a.outgoing[id]
}

// MigrateVM starts migrating VM id to spec.Target and returns the
// migration as it starts; while one runs (or once one completed), it
// returns that one.
func (a *Agent) MigrateVM(ctx context.Context, id string, spec agentapi.MigrateSpec) (agentapi.Migration, error) {
	if err := checkID(id); err != nil {
		return agentapi.Migration{}, err
	}
	mg, err := a.migrator()
	if err != nil {
		return agentapi.Migration{}, err
	}
	addr, err := agentapi.CheckAddress(spec.Target.Address)
	if err != nil {
		return agentapi.Migration{}, errInvalid("target.address: %v", err)
	}
	key, err := agentapi.DecodeKey(spec.Target.PublicKey)
	if err != nil {
		return agentapi.Migration{}, errInvalid("target.public_key: %v", err)
	}
	if key.Equal(a.PublicKey()) {
		return agentapi.Migration{}, migrationRefusal(id, ReasonMigrationState, "vm %s: the target of a migration is this agent itself; migrate to another host", id)
	}
	if spec.MaxDowntimeMS < 0 || spec.TimeoutS < 0 {
		return agentapi.Migration{}, errInvalid("max_downtime_ms and timeout_s must not be negative")
	}
	spec.Target.Address = addr
	if o := a.outgoingOf(id); o != nil {
		return o.get(), nil
	}
	e, err := a.lockVM(ctx, id, "migrate")
	if err != nil {
		return agentapi.Migration{}, err
	}
	r := a.refreshLocked(ctx, e)
	if r.State == agentapi.StateMigrated && r.Migration != nil {
		e.unlock()
		return *r.Migration, nil
	}
	live := false
	switch r.State {
	case agentapi.StateRunning, agentapi.StatePaused:
		if !spec.Live {
			e.unlock()
			return agentapi.Migration{}, migrationRefusal(id, ReasonMigrationState, "vm %s is %s: stop it for a cold migration or migrate it live", id, r.State)
		}
		live = true
	case agentapi.StateStopped:
	default:
		e.unlock()
		return agentapi.Migration{}, migrationRefusal(id, ReasonMigrationState, "vm %s is %s: only a running, paused or stopped vm migrates", id, r.State)
	}
	if err := checkMovable(id, wireVolumes(r.Volumes), r.Snapshot, r.Disk); err != nil {
		e.unlock()
		return agentapi.Migration{}, err
	}
	mig := agentapi.Migration{VMID: id, Target: spec.Target, Live: live, State: agentapi.MigrationRunning,
		Phase: agentapi.PhaseSetup, StartedAt: time.Now().UTC(), SourcePaused: r.State == agentapi.StatePaused}
	r.Migration = &mig
	if err := a.saveRecord(&r); err != nil {
		e.unlock()
		return agentapi.Migration{}, err
	}
	e.set(r)
	mctx, cancel := context.WithCancel(context.Background())
	o := &outMigration{cancel: cancel, done: make(chan struct{}), status: mig}
	a.migMu.Lock()
	if a.outgoing == nil {
		a.outgoing = map[string]*outMigration{}
	}
	a.outgoing[id] = o
	a.migMu.Unlock()
	a.log.Info("migration started", "vm", id, "target", addr, "live", live)
	go a.runMigration(mctx, e, mg, o, &peer{address: addr, key: key}, spec)
	return mig, nil
}

// runMigration moves the VM and records the outcome; it holds e's
// operation lock, which it releases at the end.
func (a *Agent) runMigration(ctx context.Context, e *vmEntry, mg Migrator, o *outMigration, target *peer, spec agentapi.MigrateSpec) {
	timeout := defaultMigrationTimeout
	if spec.TimeoutS > 0 {
		timeout = time.Duration(spec.TimeoutS) * time.Second
	}
	downtime := defaultMaxDowntime
	if spec.MaxDowntimeMS > 0 {
		downtime = time.Duration(spec.MaxDowntimeMS) * time.Millisecond
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, timeout+time.Minute)
	defer cancel()
	committing := false
	defer func() {
		a.migMu.Lock()
		delete(a.outgoing, e.id)
		a.migMu.Unlock()
		e.unlock()
		close(o.done)
		if committing {
			a.commitLater(e.id)
		}
	}()
	r, _, _ := e.state()
	m := machineOf(a, r)
	mig := o.get()
	finish := func(err error) {
		mig = o.get()
		mig.TotalMS = time.Since(start).Milliseconds()
		mig.State, mig.Error = agentapi.MigrationFailed, err.Error()
		if o.cancelled {
			mig.State = agentapi.MigrationCancelled
		}
		r, _, _ = e.state()
		r.Migration = &mig
		e.set(r)
		r = a.refreshLocked(context.WithoutCancel(ctx), e) // the VM runs here as before
		r.Migration = &mig
		if err := a.saveRecord(&r); err != nil {
			a.log.Error("save failed migration", "vm", r.ID, "err", err)
		}
		e.set(r)
		o.update(func(s *agentapi.Migration) { *s = mig })
		a.log.Warn("migration did not complete; the vm stays here", "vm", r.ID, "state", mig.State, "vm_state", r.State, "err", err)
	}
	c, err := a.peerClient(ctx, target)
	if err != nil {
		finish(fmt.Errorf("target %s: %w", target.address, err))
		return
	}
	dial := func(ctx context.Context, channel string) (net.Conn, error) {
		return a.dialStream(ctx, c, target.key, e.id, channel)
	}
	o.update(func(s *agentapi.Migration) { s.Phase = agentapi.PhaseFiles })
	if err := a.sendFiles(ctx, dial, mg, m, mig.Live); err != nil {
		finish(err)
		return
	}
	if mig.Live {
		stats, err := mg.MigrateOut(ctx, m, MigrateOut{
			Dial: dial, MaxDowntime: downtime, Converge: timeout,
			Progress: func(p agentapi.Migration) {
				o.update(func(s *agentapi.Migration) { mergeProgress(s, p) })
			},
		})
		o.update(func(s *agentapi.Migration) { mergeProgress(s, stats) })
		if err != nil {
			finish(err)
			return
		}
	}
	// The VMM completed the stream: this copy never runs again (unless the
	// target holds none, CancelMigration). Recorded before the target is
	// told to run its copy.
	streamed := time.Now()
	mig = o.get()
	mig.Phase = agentapi.PhaseSwitch
	mig.VMMDowntimeMS = mig.DowntimeMS
	if mig.TotalMS == 0 {
		mig.TotalMS = time.Since(start).Milliseconds()
	}
	r, _, _ = e.state()
	r.State, r.Reason, r.Migration = agentapi.StateMigrated, "migrated to "+target.address, &mig
	if err := a.saveRecord(&r); err != nil {
		a.log.Error("save migrated vm", "vm", r.ID, "err", err)
	}
	e.set(r)
	o.update(func(s *agentapi.Migration) { *s = mig })
	a.log.Info("migration stream completed; committing the target", "vm", r.ID, "target", target.address,
		"downtime_ms", mig.DowntimeMS, "total_ms", mig.TotalMS)
	if err := a.commitTarget(ctx, e, c, streamed); err != nil {
		a.log.Warn("commit of the migrated vm on its target failed; retrying in the background", "vm", r.ID, "err", err)
		committing = true
	}
	rr, _, _ := e.state()
	if rr.Migration != nil {
		o.update(func(s *agentapi.Migration) { *s = *rr.Migration })
	}
}

// mergeProgress copies a driver's figures into s.
func mergeProgress(s *agentapi.Migration, p agentapi.Migration) {
	if p.Phase != "" {
		s.Phase = p.Phase
	}
	if p.Memory != (agentapi.MigrationBytes{}) {
		s.Memory = p.Memory
	}
	if p.Disk != (agentapi.MigrationBytes{}) {
		s.Disk = p.Disk
	}
	s.DowntimeMS, s.ExpectedDowntimeMS = max(s.DowntimeMS, p.DowntimeMS), p.ExpectedDowntimeMS
	s.TotalMS, s.SetupMS, s.Throttle = max(s.TotalMS, p.TotalMS), max(s.SetupMS, p.SetupMS), p.Throttle
}

// commitTarget tells the target to run its copy of migrated VM e (whose
// operation lock the caller holds), retrying for a while. A target that
// answers that its copy failed (it never ran) makes the source run the VM
// again: the migration failed.
//
// streamed is when the stream completed (zero: not known, after a
// restart): the guest's pause is then the VMM's downtime plus the commit.
func (a *Agent) commitTarget(ctx context.Context, e *vmEntry, c *agentapi.Client, streamed time.Time) error {
	ctx, cancel := context.WithTimeout(ctx, CommitTimeout)
	defer cancel()
	var err error
	for attempt := 0; ; attempt++ {
		r, _, _ := e.state()
		if r.State != agentapi.StateMigrated || r.Migration == nil || r.Migration.State != agentapi.MigrationRunning {
			return nil
		}
		_, err = c.CommitIncomingAs(ctx, e.id, agentapi.IncomingCommit{Paused: r.Migration.SourcePaused})
		if err == nil {
			mig := *r.Migration
			mig.State, mig.Phase, mig.Error = agentapi.MigrationCompleted, agentapi.PhaseDone, ""
			if !streamed.IsZero() && mig.Live {
				mig.DowntimeMS = mig.VMMDowntimeMS + time.Since(streamed).Milliseconds()
				mig.TotalMS += time.Since(streamed).Milliseconds()
			}
			r.Migration = &mig
			if err := a.saveRecord(&r); err != nil {
				return err
			}
			e.set(r)
			a.log.Info("migration completed", "vm", e.id, "target", mig.Target.Address, "downtime_ms", mig.DowntimeMS, "total_ms", mig.TotalMS)
			return nil
		}
		var ae *agentapi.Error
		if errors.As(err, &ae) && (ae.Status == http.StatusConflict || ae.Status == http.StatusNotFound) {
			// The target holds no copy that can run: its incoming VM
			// failed or is gone. It never ran, so this one runs again.
			return a.rollBackLocked(ctx, e, fmt.Sprintf("the target refused the commit (%v)", err))
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("commit vm %s on %s: %w", e.id, c.BaseURL(), err)
		case <-a.closing:
			return fmt.Errorf("commit vm %s on %s: the agent closes: %w", e.id, c.BaseURL(), err)
		case <-time.After(time.Duration(min(attempt+1, 10)) * 500 * time.Millisecond):
		}
	}
}

// rollBackLocked runs migrated VM e on the source again: only when its
// target holds no copy that ran (the caller checked).
func (a *Agent) rollBackLocked(ctx context.Context, e *vmEntry, why string) error {
	mg, err := a.migrator()
	if err != nil {
		return err
	}
	r, _, _ := e.state()
	if r.State != agentapi.StateMigrated {
		return nil
	}
	m := machineOf(a, r)
	switch {
	case r.Migration != nil && r.Migration.Live && r.Migration.SourcePaused:
		r.State = agentapi.StatePaused // a resume continues it (and takes its disk back)
	case r.Migration != nil && r.Migration.Live:
		if err := mg.ResumeOutgoing(ctx, m); err != nil {
			return fmt.Errorf("run vm %s here again after its migration failed at the target: %w", e.id, err)
		}
		r.State = agentapi.StateRunning
	default:
		r.State = agentapi.StateStopped
	}
	r.Reason = ""
	if r.Migration != nil {
		mig := *r.Migration
		mig.State, mig.Error = agentapi.MigrationFailed, "rolled back: "+why
		r.Migration = &mig
	}
	if err := a.saveRecord(&r); err != nil {
		return err
	}
	e.set(r)
	a.log.Warn("migration rolled back; the vm runs here again", "vm", e.id, "why", why, "state", r.State)
	return nil
}

// commitLater keeps committing migrated VM id's target in the background
// (after a failed commit or an agent restart), until it is committed, rolled
// back or the agent closes.
func (a *Agent) commitLater(id string) {
	a.migMu.Lock()
	if a.committing == nil {
		a.committing = map[string]bool{}
	}
	if a.committing[id] {
		a.migMu.Unlock()
		return
	}
	a.committing[id] = true
	a.migMu.Unlock()
	a.syncs.Add(1)
	go func() {
		defer a.syncs.Done()
		defer func() {
			a.migMu.Lock()
			delete(a.committing, id)
			a.migMu.Unlock()
		}()
		for attempt := 0; ; attempt++ {
			select {
			case <-a.closing:
				return
			case <-time.After(time.Duration(min(attempt+1, 20)) * time.Second):
			}
			e := a.lookup(id)
			if e == nil || !e.tryLock() {
				continue
			}
			r, _, gone := e.state()
			if gone || r.State != agentapi.StateMigrated || r.Migration == nil || r.Migration.State != agentapi.MigrationRunning {
				e.unlock()
				return
			}
			err := a.commitVia(e, r.Migration.Target)
			e.unlock()
			if err == nil {
				return
			}
			a.log.Warn("commit of a migrated vm on its target", "vm", id, "err", err)
		}
	}()
}

// commitVia commits e on target (lock held).
func (a *Agent) commitVia(e *vmEntry, target agentapi.PeerRef) error {
	key, err := agentapi.DecodeKey(target.PublicKey)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), CommitTimeout)
	defer cancel()
	c, err := a.peerClient(ctx, &peer{address: target.Address, key: key})
	if err != nil {
		return err
	}
	return a.commitTarget(ctx, e, c, time.Time{})
}

// sendFiles sends the VM's files over the files channel and waits for the
// target to take them.
func (a *Agent) sendFiles(ctx context.Context, dial func(context.Context, string) (net.Conn, error), mg Migrator, m *Machine, live bool) error {
	names, err := mg.MigrationFiles(m, live)
	if err != nil {
		return err
	}
	for _, n := range []string{SeedFileName, VarsFileName} {
		if _, err := os.Stat(filepath.Join(m.Dir, n)); err == nil {
			names = append(names, n)
		}
	}
	conn, err := dial(ctx, agentapi.ChannelFiles)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	stop := context.AfterFunc(ctx, func() { _ = conn.Close() })
	defer stop()
	tw := tar.NewWriter(conn)
	for _, n := range names {
		if err := sendFile(tw, filepath.Join(m.Dir, n), n); err != nil {
			return fmt.Errorf("send file %s of vm %s: %w", n, m.ID, err)
		}
	}
	if err := tw.Close(); err != nil {
		return fmt.Errorf("send files of vm %s: %w", m.ID, err)
	}
	if cw, ok := conn.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	}
	line, err := bufio.NewReader(io.LimitReader(conn, 4096)).ReadString('\n')
	if err != nil {
		return fmt.Errorf("send files of vm %s: no answer from the target: %w", m.ID, err)
	}
	if line != "ok\n" {
		return fmt.Errorf("target refused the files of vm %s: %s", m.ID, strings.TrimSpace(strings.TrimPrefix(line, "error: ")))
	}
	return nil
}

func sendFile(tw *tar.Writer, path, name string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer func() { _ = f.Close() }()
	st, err := f.Stat()
	if err != nil {
		return err
	}
	if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o640, Size: st.Size(), Typeflag: tar.TypeReg, ModTime: st.ModTime()}); err != nil {
		return err
	}
	_, err = io.Copy(tw, f)
	return err
}

// GetMigration returns the migration of VM id (404 when it has none).
func (a *Agent) GetMigration(ctx context.Context, id string) (agentapi.Migration, error) {
	if o := a.outgoingOf(id); o != nil {
		s := o.get()
		if s.State == agentapi.MigrationRunning && s.Phase != agentapi.PhaseSwitch {
			s.TotalMS = time.Since(s.StartedAt).Milliseconds()
		}
		return s, nil
	}
	e := a.lookup(id)
	if e == nil {
		return agentapi.Migration{}, errNotFound(id)
	}
	r := a.current(ctx, e)
	if _, _, gone := e.state(); gone || r.Migration == nil {
		return agentapi.Migration{}, &Error{Status: http.StatusNotFound, Code: CodeNotFound,
			Message: fmt.Sprintf("vm %s has no migration on this agent", id)}
	}
	return *r.Migration, nil
}

// CancelMigration cancels VM id's migration: the VM keeps running here. A
// completed one is undone only when its target holds no copy that ran.
func (a *Agent) CancelMigration(ctx context.Context, id string) error {
	if o := a.outgoingOf(id); o != nil {
		o.mu.Lock()
		o.cancelled = true
		o.mu.Unlock()
		o.cancel()
		select {
		case <-o.done:
		case <-ctx.Done():
			return &Error{Status: http.StatusServiceUnavailable, Code: CodeUnavailable,
				Message: fmt.Sprintf("vm %s: the migration is being cancelled; ask again", id), Err: ctx.Err()}
		}
	}
	e, err := a.lockVM(ctx, id, "cancel its migration")
	if err != nil {
		return err
	}
	defer e.unlock()
	r := a.refreshLocked(ctx, e)
	switch {
	case r.Migration == nil:
		return &Error{Status: http.StatusNotFound, Code: CodeNotFound, Message: fmt.Sprintf("vm %s has no migration on this agent", id)}
	case r.State != agentapi.StateMigrated:
		return nil // it never completed: the vm is here
	case r.Migration.State == agentapi.MigrationCompleted:
		return migrationRefusal(id, ReasonMigrationState, "vm %s: its migration to %s completed and the vm runs there; migrate it back instead", id, r.Migration.Target.Address)
	}
	// The stream completed but the target was not committed: undo only
	// when the target says it holds no copy that can run.
	key, err := agentapi.DecodeKey(r.Migration.Target.PublicKey)
	if err != nil {
		return err
	}
	c, err := a.peerClient(ctx, &peer{address: r.Migration.Target.Address, key: key})
	if err != nil {
		return errConflict("vm %s: its target %s cannot be asked whether it runs the vm (%v); retry when it answers", id, r.Migration.Target.Address, err)
	}
	vm, err := c.GetVM(ctx, id)
	switch {
	case errors.Is(err, agentapi.ErrNotFound), err == nil && vm.State == agentapi.StateFailed:
		return a.rollBackLocked(ctx, e, "cancelled by the control plane; the target holds no copy")
	case err != nil:
		return errConflict("vm %s: its target %s cannot be asked whether it runs the vm (%v); retry when it answers", id, r.Migration.Target.Address, err)
	}
	return migrationRefusal(id, ReasonMigrationState, "vm %s: its stream completed and the target holds it (%s); delete it there first to undo the migration", id, vm.State)
}

// refreshMigrationLocked settles a migration this agent no longer runs
// (after a restart): a VMM that completed the stream makes the VM
// migrated (and the target is committed in the background); one that did
// not leaves it here, the migration failed.
func (a *Agent) refreshMigrationLocked(ctx context.Context, e *vmEntry, r vmRecord) vmRecord {
	if r.Migration == nil || r.Migration.State != agentapi.MigrationRunning || a.outgoingOf(r.ID) != nil {
		return r
	}
	if r.State == agentapi.StateMigrated {
		a.commitLater(r.ID)
		return r
	}
	mg, err := a.migrator()
	if err != nil {
		return r
	}
	mig := *r.Migration
	st := OutgoingNone
	if mig.Live {
		var stats agentapi.Migration
		st, stats = mg.OutgoingState(ctx, machineOf(a, r))
		mergeProgress(&mig, stats)
	}
	switch st {
	case OutgoingActive:
		return r // its channels died with the agent: it fails shortly
	case OutgoingCompleted:
		mig.Phase = agentapi.PhaseSwitch
		r.State, r.Reason = agentapi.StateMigrated, "migrated to "+mig.Target.Address
		a.commitLater(r.ID)
	default:
		mig.State, mig.Error = agentapi.MigrationFailed, "the agent restarted during the migration; the vm stays here"
	}
	r.Migration = &mig
	if err := a.saveRecord(&r); err != nil {
		a.log.Error("save settled migration", "vm", r.ID, "err", err)
	}
	e.set(r)
	a.log.Warn("settled a migration interrupted by an agent restart", "vm", r.ID, "vmm", st, "state", r.State, "migration", mig.State)
	return r
}
