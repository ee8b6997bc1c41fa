package qemu

// What the driver does through a VM's guest agent (qga.go): the guest's
// addresses, a graceful stop, and frozen file systems around a snapshot.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
)

const (
	// qgaAddressSyncTimeout bounds the sync of an address query, which a
	// VM read waits for: a guest agent that runs answers in milliseconds,
	// one that does not (a guest still booting) costs each read this much.
	qgaAddressSyncTimeout = time.Second
	// frozenMarkerName, in a VM's directory, says a snapshot that kept the
	// VM paused left its file systems frozen: the resume thaws them.
	frozenMarkerName = "qga.frozen"
	// thawTries is how often a thaw is tried before the driver gives up
	// and logs the guest as still frozen.
	thawTries = 3
)

// guestAgentStats counts what the driver did through guest agents.
type guestAgentStats struct {
	shutdowns, frozen, unfrozen, thawFailures atomic.Int64
}

// qgaLock is the lock of VM id's guest agent socket: QEMU serves one client
// at a time, and a second one would read the first one's replies.
func (d *Driver) qgaLock(id string) *sync.Mutex {
	d.qgaMu.Lock()
	defer d.qgaMu.Unlock()
	if d.qgaLocks == nil {
		d.qgaLocks = map[string]*sync.Mutex{}
	}
	l, ok := d.qgaLocks[id]
	if !ok {
		l = &sync.Mutex{}
		d.qgaLocks[id] = l
	}
	return l
}

// errQGABusy is a guest agent socket another operation of the VM uses.
var errQGABusy = errors.New("the guest agent is in use by another operation of the vm")

// withGuestAgent runs fn in a session on m's guest agent, synced within
// syncTimeout. wait says whether to wait for another session of the VM to
// end (an operation) or to give up at once with errQGABusy (a read).
func (d *Driver) withGuestAgent(ctx context.Context, m *agent.Machine, syncTimeout time.Duration, wait bool, fn func(*guestAgent) error) error {
	if !m.GuestAgent {
		return fmt.Errorf("vm %s has no guest agent channel", m.ID)
	}
	l := d.qgaLock(m.ID)
	if wait {
		l.Lock()
	} else if !l.TryLock() {
		return errQGABusy
	}
	defer l.Unlock()
	g, err := dialGuestAgent(ctx, qgaPathOf(m), syncTimeout, qgaTimeout)
	if err != nil {
		return err
	}
	defer func() { _ = g.Close() }()
	return fn(g)
}

// GuestAddresses implements agent.GuestAgentDriver.
func (d *Driver) GuestAddresses(ctx context.Context, m *agent.Machine) (map[string][]string, error) {
	var out map[string][]string
	err := d.withGuestAgent(ctx, m, qgaAddressSyncTimeout, false, func(g *guestAgent) (err error) {
		out, err = g.ipv4ByMAC(ctx)
		return err
	})
	return out, err
}

var _ agent.GuestAgentDriver = (*Driver)(nil)

// shutdownThroughAgent asks m's guest to power off through its guest
// agent; false when it has none or the guest agent did not take it.
func (d *Driver) shutdownThroughAgent(ctx context.Context, m *agent.Machine) bool {
	if !m.GuestAgent {
		return false
	}
	err := d.withGuestAgent(ctx, m, qgaSyncTimeout, true, func(g *guestAgent) error { return g.shutdown(ctx) })
	if err != nil {
		d.log.Warn("guest agent did not take the shutdown; pressing the acpi power button instead", "vm", m.ID, "err", err)
		return false
	}
	d.qga.shutdowns.Add(1)
	d.log.Info("guest asked to power off through its guest agent (guest-shutdown)", "vm", m.ID)
	return true
}

// freeze freezes m's file systems through its guest agent before a
// snapshot's pause, within qgaSyncTimeout for the guest agent to answer
// and qgaTimeout for the freeze. It returns whether the guest may be
// frozen now (then thaw must follow, whatever else fails): a freeze that
// answered, or one whose answer did not come. A guest agent that does not
// answer, or a freeze that failed (qemu-guest-agent thaws what it froze
// then), leaves the guest as it was: the snapshot goes on unfrozen, with
// a warning, as a crash-consistent one (what a VM without the channel
// gets).
func (d *Driver) freeze(ctx context.Context, m *agent.Machine) bool {
	sent := false
	var n int
	err := d.withGuestAgent(ctx, m, qgaSyncTimeout, true, func(g *guestAgent) (err error) {
		sent = true
		n, err = g.fsfreeze(ctx)
		return err
	})
	var answered *qmpError
	switch {
	case err == nil:
		d.qga.frozen.Add(1)
		d.log.Info("guest file systems frozen for the snapshot", "vm", m.ID, "file_systems", n)
		return true
	case sent && !errors.As(err, &answered):
		// No answer to the freeze itself: it may have frozen.
		d.log.Warn("guest agent did not answer the freeze in time; the snapshot goes on and the guest is thawed after it",
			"vm", m.ID, "err", err)
		return true
	}
	d.qga.unfrozen.Add(1)
	d.log.Warn("guest file systems not frozen: the snapshot goes on unfrozen (crash-consistent); check that qemu-guest-agent runs in the guest",
		"vm", m.ID, "err", err)
	return false
}

// thaw thaws m's file systems through its guest agent, trying a few times
// (a guest just continued may need a moment to answer). A guest that stays
// frozen blocks its writers: that is logged as an error.
func (d *Driver) thaw(ctx context.Context, m *agent.Machine) error {
	var err error
	for i := range thawTries {
		var n int
		err = d.withGuestAgent(ctx, m, qgaSyncTimeout, true, func(g *guestAgent) (err error) {
			n, err = g.fsthaw(ctx)
			return err
		})
		if err == nil {
			d.log.Info("guest file systems thawed", "vm", m.ID, "file_systems", n, "tries", i+1)
			return nil
		}
		if ctx.Err() != nil {
			break
		}
	}
	d.qga.thawFailures.Add(1)
	d.log.Error("guest file systems may still be frozen: the thaw through the guest agent failed; run fsfreeze -u in the guest or restart the vm",
		"vm", m.ID, "err", err)
	return fmt.Errorf("thaw the file systems of vm %s: %w", m.ID, err)
}

// markFrozen records that m stays paused with frozen file systems, so
// that its resume thaws them; thawIfMarked is that resume's part.
func markFrozen(m *agent.Machine) error {
	return os.WriteFile(filepath.Join(m.Dir, frozenMarkerName), nil, 0o600)
}

func (d *Driver) thawIfMarked(ctx context.Context, m *agent.Machine) {
	path := filepath.Join(m.Dir, frozenMarkerName)
	if _, err := os.Stat(path); err != nil {
		return
	}
	if d.thaw(ctx, m) == nil {
		_ = os.Remove(path)
	}
}

// GuestAgentShutdowns is how many stops the guest agent took
// (guest-shutdown); FrozenSnapshots and UnfrozenSnapshots how many
// snapshots of VMs with the channel froze their guest or went on without;
// ThawFailures how many thaws failed every try.
func (d *Driver) GuestAgentShutdowns() int64 { return d.qga.shutdowns.Load() }
func (d *Driver) FrozenSnapshots() int64     { return d.qga.frozen.Load() }
func (d *Driver) UnfrozenSnapshots() int64   { return d.qga.unfrozen.Load() }
func (d *Driver) ThawFailures() int64        { return d.qga.thawFailures.Load() }
