package agent

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/timing"
)

// handoverTimeout bounds a warm start once it began: it finishes even when
// the caller gives up, so that a resumed VM is always recorded or destroyed.
const handoverTimeout = 30 * time.Second

// warmServes says whether a warm VM can become a VM with these NICs. Warm
// VMs boot with one user-mode NIC without port forwards (pool.go), and NICs
// are on QEMU's command line from the start, so they serve a create whose
// NICs are exactly that (on any user-mode network: each VM has a user-mode
// stack of its own), or a create without NICs (agent API only; the control
// plane always asks for one), whose guest then has that NIC and nothing
// outside it reaches. Other creates boot cold.
func warmServes(nics []agentapi.NIC) bool {
	switch len(nics) {
	case 0:
		return true
	case 1:
		return nics[0].Mode == agentapi.NetworkUser && len(nics[0].PortForwards) == 0
	}
	return false
}

// createWarm starts VM e.id from a warm VM matching spec (warmServes). The
// VM's NIC keeps the MAC its warm VM booted with: it is reported, and
// recorded with the MAC the create asked for (AskedMACs) so that a retried
// create still matches. false means no warm VM could be used: nothing of e
// exists yet and the caller boots cold. A warm VM that fails to resume is
// destroyed and the next one tried. The caller holds e's operation lock; r
// is e's record in state creating.
func (a *Agent) createWarm(ctx context.Context, e *vmEntry, r vmRecord, spec agentapi.VMSpec) (agentapi.VM, bool) {
	p := a.pool
	// A VM with a seed boots cold: a warm VM booted before its seed existed;
	// so does one with the guest agent channel, which warm VMs lack, one
	// with volumes, and one with Secure Boot: warm VMs boot without it.
	if p.wd == nil || spec.NoWarm || spec.Stopped || spec.Snapshot != nil || spec.Seed != nil || spec.GuestAgent ||
		spec.SecureBoot || len(spec.Volumes) > 0 || !warmServes(spec.NICs) {
		return agentapi.VM{}, false
	}
	key := poolKey{spec.Image, spec.VCPUs, spec.MemoryMiB, spec.DiskMiB}
	for {
		start := time.Now()
		// Only a warm VM that booted with the VM's firmware: the firmware
		// is part of its shape.
		w := p.take(key, len(spec.NICs) == 1, r.firmware())
		if w == nil {
			return agentapi.VM{}, false
		}
		step := timing.Since(ctx, "take", start)
		hctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), handoverTimeout)
		rec, resumed, victim, err := p.handover(hctx, w, withWarmNIC(r, w))
		cancel()
		step = timing.Since(ctx, "handover", step)
		if err != nil {
			a.log.Warn("warm vm unusable; destroyed, trying the next or a cold boot",
				"vm", e.id, "warm_vm", w.ID, "err", err)
			p.destroy(victim)
			continue
		}
		e.set(rec)
		a.log.Info("vm created", "vm", e.id, "image", rec.Image, "state", rec.State, "started_from", rec.StartedFrom,
			"warm_vm", w.ID, "pid", rec.Process.PID, "resume", resumed, "total", time.Since(start))
		timing.Since(ctx, "log", step)
		return rec.wire(), true
	}
}

// handover resumes warm VM w and makes it VM r: its process, disk and
// console become r's, in r's directory, recorded in r's metadata. It returns
// the record, how long the resume took (QMP cont until the VM is seen
// running), and on failure the machine to destroy.
func (p *pool) handover(ctx context.Context, w *warmVM, r vmRecord) (vmRecord, time.Duration, *Machine, error) {
	d := p.a.cfg.Driver
	from := p.machine(w)
	to := machineOf(p.a, r)
	step := time.Now()
	if p.opts.Nice > 0 {
		if err := p.wd.SetNice(from, p.wd.VMNice()); err != nil {
			p.log.Warn("give a warm vm its normal priority back; it runs below other vms", "vm", r.ID, "warm_vm", w.ID, "err", err)
		}
		step = timing.Since(ctx, "nice", step)
	}
	t0 := step
	if err := d.Resume(ctx, from); err != nil {
		return r, 0, from, fmt.Errorf("resume warm vm %s: %w", w.ID, err)
	}
	step = timing.Since(ctx, "resume", step)
	// Reported running only once the driver sees it running.
	if obs := d.Observe(ctx, from, agentapi.StatePaused); obs.State != agentapi.StateRunning {
		return r, 0, from, fmt.Errorf("warm vm %s is %s after the resume, not running: %s", w.ID, obs.State, obs.Reason)
	}
	step = timing.Since(ctx, "observe", step)
	resumed := step.Sub(t0)
	if err := p.wd.Handover(from, to); err != nil {
		return r, 0, from, fmt.Errorf("hand warm vm %s over: %w", w.ID, err)
	}
	// From here the driver knows the VM as `to`, still in the pool directory.
	inPool := *to
	inPool.Dir = from.Dir
	r.State, r.Reason, r.StartedFrom, r.Process = agentapi.StateRunning, "", agentapi.StartedWarm, to.Process
	p.hold(HoldBeforeJournal)
	// The one sync of the handover (pool_journal.go): from here a restart
	// finishes it, whatever part of the moves below a crash loses.
	if err := p.journal.begin(w.ID, &r); err != nil {
		return r, 0, &inPool, fmt.Errorf("record the handover of warm vm %s to vm %s: %w", w.ID, r.ID, err)
	}
	step = timing.Since(ctx, "journal", step)
	p.hold(HoldAfterJournal)
	err := p.move(w, r, from.Dir, to.Dir)
	p.journal.moved()
	if err != nil {
		p.journal.abort(w.ID, r.ID)
		return r, 0, &inPool, err
	}
	timing.Since(ctx, "move", step)
	p.hold(HoldAfterMove)
	return r, resumed, nil, nil
}

// move makes warm VM w's directory from VM r's: its metadata, the rename
// into vms/, and a link at the old path. Nothing is synced: the journal
// record made the handover durable.
func (p *pool) move(w *warmVM, r vmRecord, from, to string) error {
	// The metadata first: the directory is a whole VM the moment it
	// appears under vms/.
	if err := writeNewRecord(filepath.Join(from, metaFile), &r, false); err != nil {
		return fmt.Errorf("write metadata of vm %s into warm vm %s: %w", r.ID, w.ID, err)
	}
	if err := os.Rename(from, to); err != nil {
		return fmt.Errorf("move warm vm %s to vm %s: %w", w.ID, r.ID, err)
	}
	// The VM is the user's now: nothing below fails the create.
	link := filepath.Join("..", filepath.Base(p.a.vmsDir()), r.ID)
	if err := os.Symlink(link, from); err != nil {
		p.log.Warn("link the pool path of a handed-out vm", "vm", r.ID, "warm_vm", w.ID, "err", err)
	}
	return nil
}

// hold calls the test hook of a handover step (Config.handoverHook).
func (p *pool) hold(step string) {
	if h := p.a.cfg.handoverHook; h != nil {
		h(step)
	}
}

// withWarmNIC is r as the VM warm VM w becomes: its one NIC has w's MAC,
// and the MAC the create asked for is kept in AskedMACs.
func withWarmNIC(r vmRecord, w *warmVM) vmRecord {
	if len(r.NICs) != 1 || w.MACAddress == "" || r.NICs[0].MACAddress == w.MACAddress {
		return r
	}
	r.NICs = cloneNICs(r.NICs)
	r.AskedMACs = []string{r.NICs[0].MACAddress}
	r.NICs[0].MACAddress = w.MACAddress
	return r
}
