package agent

// The warm pool (docs/guides/architecture.md): paused, pre-booted VMs per image and
// shape, so that a create that matches starts in milliseconds. Under the
// state directory:
//
//	pool/<warm-id>/       one warm VM: its disk overlay, console, QMP socket
//	pool/<warm-id> -> ../vms/<id>
//	                      after handover a symlink, so that the paths on the
//	                      VMM's command line stay valid for its whole life
//	pool.json             the registry: warm VMs made and not handed out
//	pool-targets.json     the target sizes set with PUT /v1/pool/{image}
//
// A warm VM is never anything but new: booted with its own fresh overlay,
// handed to exactly one VM, destroyed with it. The filler (one goroutine,
// owned by the Agent, stopped by Close) boots replacements.

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"sync"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// WarmDriver is what a driver needs to keep a warm pool. A driver without
// it has no pool: PUT /v1/pool answers 400.
type WarmDriver interface {
	// WaitReady returns once the guest of the booted VM m is up (it printed
	// its ready line, kvm-guest-ready), or with why it never will be.
	WaitReady(ctx context.Context, m *Machine) error
	// Handover re-labels the running warm VM from as to, just before the
	// agent renames from.Dir to to.Dir: it sets to.Process to a handle that
	// names the same process durably once the files moved. It touches no
	// file.
	Handover(from, to *Machine) error
	// KillOrphan ends the VMM of a warm VM that a previous agent left, but
	// only while its files are still in m.Dir: a process whose files moved
	// (handed to a user VM) is never ended.
	KillOrphan(ctx context.Context, m *Machine) error
	// SetNice sets the CPU priority (nice value, and the weight of its
	// cgroup where it has one) of m's running VMM: a warm VM, booted below
	// user VMs (BootOptions.Nice), gets theirs, VMNice, at handover.
	SetNice(m *Machine, nice int) error
	// VMNice is the nice value user VMs' VMMs run at.
	VMNice() int
}

// PoolOptions configures the warm pool.
type PoolOptions struct {
	// Concurrency is how many warm VMs boot at once (default 1).
	Concurrency int
	// BootTimeout bounds one warm boot, until the guest's ready line
	// (default 3 minutes: TCG boots take seconds).
	BootTimeout time.Duration
	// Nice is the nice value warm VMs boot at, so that they never take CPU
	// from user VMs (default 10; negative: the user VMs' own).
	Nice int
	// MaxSize is the most warm VMs the targets of all images and shapes may
	// ask for together (default 32).
	MaxSize int
	// RefillQuiet is how long after the last user create the filler waits
	// before it boots replacements (default DefaultRefillQuiet).
	RefillQuiet time.Duration
}

const (
	poolDirName      = "pool"
	poolRegistryName = "pool.json"
	poolTargetsName  = "pool-targets.json"
	poolVersion      = 1

	warmBooting = "booting"
	warmReady   = "ready"

	// poolCheckInterval is how often the filler checks that its paused VMs
	// still exist and removes the links of deleted VMs.
	poolCheckInterval = time.Minute
	maxPoolBackoff    = time.Minute
)

// warmIDPattern is the form of a warm VM's id; an id read from the registry
// is joined to a path only when it has this form.
var warmIDPattern = regexp.MustCompile(`^warm-[0-9a-f]{12}$`)

func newWarmID() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return "warm-" + hex.EncodeToString(b[:])
}

// poolKey is one image and shape.
type poolKey struct {
	Image     string
	VCPUs     int64
	MemoryMiB int64
	DiskMiB   int64
}

func (k poolKey) less(o poolKey) bool {
	switch {
	case k.Image != o.Image:
		return k.Image < o.Image
	case k.VCPUs != o.VCPUs:
		return k.VCPUs < o.VCPUs
	case k.MemoryMiB != o.MemoryMiB:
		return k.MemoryMiB < o.MemoryMiB
	}
	return k.DiskMiB < o.DiskMiB
}

// warmVM is one warm VM, as the registry records it.
type warmVM struct {
	ID        string `json:"id"`
	Image     string `json:"image"`
	VCPUs     int64  `json:"vcpus"`
	MemoryMiB int64  `json:"memory_mib"`
	DiskMiB   int64  `json:"disk_mib"`
	State     string `json:"state"` // booting or ready
	// MACAddress is the MAC of the warm VM's one user-mode NIC (poolMAC);
	// empty for a warm VM an older agent booted without a NIC.
	MACAddress string    `json:"mac_address,omitempty"`
	Process    Process   `json:"process"`
	CreatedAt  time.Time `json:"created_at"`
	// Firmware is what the warm VM boots with: its image's, read when
	// its boot starts ("" until then).
	Firmware string `json:"firmware,omitempty"`

	// cancel stops the boot of a booting warm VM (evicted: makeRoom).
	cancel context.CancelFunc
	// evicted: its boot was stopped to make room, not a failure.
	evicted bool
}

// firmware is the warm VM's firmware (bios when it names none).
func (w *warmVM) firmware() string {
	if w.Firmware == "" {
		return agentapi.FirmwareBIOS
	}
	return w.Firmware
}

func (w *warmVM) key() poolKey { return poolKey{w.Image, w.VCPUs, w.MemoryMiB, w.DiskMiB} }

type backoff struct {
	failures int
	until    time.Time
}

// pool is the agent's warm pool and its filler.
type pool struct {
	a    *Agent
	wd   WarmDriver // nil: the driver cannot keep a pool
	opts PoolOptions
	log  *slog.Logger
	dir  string
	// journal records each handover with one sync (pool_journal.go).
	journal *handoverJournal

	ctx      context.Context
	cancel   context.CancelFunc
	done     chan struct{} // closed when the filler returned
	boots    sync.WaitGroup
	stopOnce sync.Once
	wake     chan struct{}

	saveMu    sync.Mutex // one registry write at a time, the newest state last
	targetsMu sync.Mutex // one PUT /v1/pool at a time

	mu      sync.Mutex // guards the fields below
	targets map[poolKey]int
	entries map[string]*warmVM
	users   int // user creates in flight: the filler waits for them
	// lastUser is when the last user create ended: the filler boots
	// nothing until opts.RefillQuiet after it.
	lastUser time.Time
	failures map[poolKey]backoff
	short    map[poolKey]bool // capacity shortage already logged
}

func (o PoolOptions) withDefaults() PoolOptions {
	if o.Concurrency <= 0 {
		o.Concurrency = 1
	}
	if o.BootTimeout <= 0 {
		o.BootTimeout = 3 * time.Minute
	}
	if o.Nice == 0 {
		o.Nice = 10
	}
	if o.MaxSize <= 0 {
		o.MaxSize = 32
	}
	if o.RefillQuiet <= 0 {
		o.RefillQuiet = DefaultRefillQuiet
	}
	return o
}

// startPool reads the targets, destroys the orphans of a previous agent
// (reconcile), sets a.pool and starts the filler. It runs after the user VMs
// are loaded: the reconcile must know them to never touch one.
func startPool(ctx context.Context, a *Agent, journal *handoverJournal) error {
	p := &pool{
		a: a, opts: a.cfg.Pool.withDefaults(), log: a.log.With("component", "pool"), journal: journal,
		dir: filepath.Join(a.cfg.StateDir, poolDirName), done: make(chan struct{}),
		wake: make(chan struct{}, 1), targets: map[poolKey]int{}, entries: map[string]*warmVM{},
		failures: map[poolKey]backoff{}, short: map[poolKey]bool{},
	}
	p.wd, _ = a.cfg.Driver.(WarmDriver)
	if err := os.MkdirAll(p.dir, 0o750); err != nil {
		return fmt.Errorf("create pool directory %s: %w", p.dir, err)
	}
	p.targets = p.loadTargets()
	p.reconcile(ctx)
	p.ctx, p.cancel = context.WithCancel(context.WithoutCancel(ctx))
	a.pool = p
	go p.run()
	return nil
}

// stop ends the filler and waits for the boots in flight, which destroy
// their half-booted VMs, then compacts and closes the handover journal.
// Ready warm VMs stay: the next agent's reconcile destroys them.
func (p *pool) stop() {
	p.stopOnce.Do(func() {
		p.cancel()
		<-p.done
		p.boots.Wait()
		p.journal.close()
	})
}

func (p *pool) kick() {
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// userCreating marks a user create in flight until the returned func runs:
// the filler starts no boot meanwhile.
func (p *pool) userCreating() func() {
	p.mu.Lock()
	p.users++
	p.mu.Unlock()
	return func() {
		p.mu.Lock()
		p.users--
		p.lastUser = time.Now()
		p.mu.Unlock()
		p.kick()
	}
}

// DefaultRefillQuiet is how long after a user create the filler waits
// before it boots replacements: a burst of creates takes warm VMs one after
// another without boots (which take a core each under TCG) competing with
// their handovers; the pool refills once the burst pauses. 200 ms is well
// above the gap between the creates of a burst (a create answers in
// 10-60 ms and the next follows at once: bench/create_latency_test.go,
// burst3) and far below a boot (seconds under TCG), so the pool is never
// empty much longer for it.
const DefaultRefillQuiet = 200 * time.Millisecond

func (p *pool) warmDir(id string) string { return filepath.Join(p.dir, id) }

func (p *pool) machine(w *warmVM) *Machine {
	return &Machine{ID: w.ID, Dir: p.warmDir(w.ID), Image: w.Image, VCPUs: w.VCPUs,
		MemoryMiB: w.MemoryMiB, DiskMiB: w.DiskMiB, Process: w.Process, NICs: w.nics(), Firmware: w.Firmware}
}

// poolNetwork is the network name of a warm VM's NIC until it is handed
// out (a user-mode NIC serves any user-mode network: QEMU's stack is the
// VM's own).
const poolNetwork = "default"

// nics are the NICs a warm VM boots with: one user-mode NIC, no forwards.
func (w *warmVM) nics() []agentapi.NIC {
	if w.MACAddress == "" {
		return nil
	}
	return []agentapi.NIC{{Network: poolNetwork, Mode: agentapi.NetworkUser, MACAddress: w.MACAddress}}
}

// poolMAC is the MAC of warm VM id's NIC: locally administered unicast
// with first byte 0x06, so it never equals a MAC the control plane derives
// from a VM id (first byte 0x02), and five bytes of a hash of the warm
// VM's own random id, so two warm VMs differ. The control plane records it
// for the VM the warm VM becomes; its unique index on MACs stays the arbiter.
func poolMAC(id string) string {
	sum := sha256.Sum256([]byte("kvm-warm-nic:" + id))
	return net.HardwareAddr{0x06, sum[0], sum[1], sum[2], sum[3], sum[4]}.String()
}

// run is the filler: it boots warm VMs up to the targets, destroys surplus
// ones, and waits for a change (a target, a take, a boot's end, a user
// create's end), a backoff's end, or the periodic check.
func (p *pool) run() {
	defer close(p.done)
	check := time.NewTicker(poolCheckInterval)
	defer check.Stop()
	for {
		retry := p.fill()
		var timer <-chan time.Time
		var t *time.Timer
		if retry > 0 {
			t = time.NewTimer(retry)
			timer = t.C
		}
		select {
		case <-p.ctx.Done():
		case <-p.wake:
		case <-timer:
		case <-check.C:
			p.checkReady()
			p.removeDeadLinks()
		}
		if t != nil {
			t.Stop()
		}
		if p.ctx.Err() != nil {
			return
		}
	}
}

// fill starts the boots the targets need and destroys surplus warm VMs. It
// returns how long until a backoff ends (0: none pending).
func (p *pool) fill() time.Duration {
	p.mu.Lock()
	quiet := p.opts.RefillQuiet - time.Since(p.lastUser)
	idle := p.users == 0
	p.mu.Unlock()
	if idle && quiet > 0 {
		return quiet
	}
	// Once a burst of creates pauses, as the refill (or when many records
	// wait), the handovers' moves are made durable and the journal emptied.
	if idle || p.journal.due() {
		p.journal.compact()
	}
	info, infoErr := p.a.Info(p.ctx)
	usable, uerr := p.a.usable()
	if infoErr == nil {
		infoErr = uerr
	}
	p.mu.Lock()
	type count struct{ ready, booting int }
	counts := map[poolKey]*count{}
	booting := 0
	var held agentapi.Resources
	for _, w := range p.entries {
		c := counts[w.key()]
		if c == nil {
			c = &count{}
			counts[w.key()] = c
		}
		if w.State == warmReady {
			c.ready++
		} else {
			c.booting++
			booting++
		}
		held = addResources(held, p.warmHeld(w), 1)
	}
	// Surplus: ready VMs beyond a lowered target, newest first.
	var surplus []*warmVM
	for key, c := range counts {
		extra := min(c.ready+c.booting-p.targets[key], c.ready)
		if extra <= 0 {
			continue
		}
		for _, w := range p.sortedEntries(key, warmReady, true)[:extra] {
			delete(p.entries, w.ID)
			surplus = append(surplus, w)
			held = addResources(held, p.warmHeld(w), -1)
		}
		c.ready -= extra
	}
	var starts []*warmVM
	var retry time.Duration
	now := time.Now()
	// Asked again under the lock that the starts are decided under: a
	// create may have begun and ended since the check above (while the
	// capacity was read), and its burst must not meet a boot.
	if left := p.opts.RefillQuiet - now.Sub(p.lastUser); p.users == 0 && left > 0 {
		retry = left
	} else if p.users == 0 && p.ctx.Err() == nil {
		for _, key := range p.sortedTargets() {
			c := counts[key]
			if c == nil {
				c = &count{}
			}
			for booting < p.opts.Concurrency && c.ready+c.booting < p.targets[key] {
				if b := p.failures[key]; now.Before(b.until) {
					if d := b.until.Sub(now); retry == 0 || d < retry {
						retry = d
					}
					break
				}
				if infoErr != nil {
					p.log.Error("read host capacity; warm boots wait", "err", infoErr)
					retry = 10 * time.Second
					break
				}
				next := agentapi.Resources{VCPUs: key.VCPUs, MemoryMiB: key.MemoryMiB, DiskMiB: p.a.vmDiskMiB(key.DiskMiB)}
				if overCapacity(addResources(addResources(info.Allocated, held, 1), next, 1), usable) {
					if !p.short[key] {
						p.short[key] = true
						p.log.Warn("warm pool below target: the host's vcpus, memory or disk are taken by vms; it refills when they are deleted",
							"image", key.Image, "vcpus", key.VCPUs, "memory_mib", key.MemoryMiB, "disk_mib", key.DiskMiB,
							"target", p.targets[key], "warm", c.ready+c.booting)
					}
					break
				}
				delete(p.short, key)
				id := newWarmID()
				w := &warmVM{ID: id, Image: key.Image, VCPUs: key.VCPUs, MemoryMiB: key.MemoryMiB,
					DiskMiB: key.DiskMiB, State: warmBooting, MACAddress: poolMAC(id),
					CreatedAt: now.UTC().Truncate(time.Millisecond)}
				p.entries[w.ID] = w
				starts = append(starts, w)
				c.booting++
				booting++
				held = addResources(held, next, 1)
			}
		}
	}
	p.mu.Unlock()
	if len(surplus) > 0 || len(starts) > 0 {
		// Recorded before anything is started or destroyed: a crash in
		// between leaves an entry whose files the next reconcile destroys.
		p.save()
	}
	for _, w := range surplus {
		p.log.Info("destroy surplus warm vm", "warm_vm", w.ID, "image", w.Image)
		p.destroy(p.machine(w))
	}
	for _, w := range starts {
		p.boots.Add(1)
		go p.boot(w)
	}
	return retry
}

// sortedEntries returns the entries of key in state, oldest first (newest
// first with newest).
func (p *pool) sortedEntries(key poolKey, state string, newest bool) []*warmVM {
	var out []*warmVM
	for _, w := range p.entries {
		if w.key() == key && w.State == state {
			out = append(out, w)
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if !out[i].CreatedAt.Equal(out[j].CreatedAt) {
			return out[i].CreatedAt.Before(out[j].CreatedAt) != newest
		}
		return out[i].ID < out[j].ID
	})
	return out
}

func (p *pool) sortedTargets() []poolKey {
	keys := make([]poolKey, 0, len(p.targets))
	for k := range p.targets {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool { return keys[i].less(keys[j]) })
	return keys
}

// boot makes one warm VM: a fresh overlay, a boot at the pool's low
// priority, the guest's ready line, then a pause.
func (p *pool) boot(w *warmVM) {
	defer p.boots.Done()
	defer p.kick()
	if img, err := p.a.cfg.Driver.Image(w.Image); err == nil {
		p.mu.Lock()
		w.Firmware = img.Firmware
		p.mu.Unlock()
	}
	m := p.machine(w)
	start := time.Now()
	ctx, cancel := context.WithTimeout(p.ctx, p.opts.BootTimeout)
	defer cancel()
	p.mu.Lock()
	w.cancel = cancel
	p.mu.Unlock()
	err := p.bootWarm(ctx, w, m)
	p.mu.Lock()
	w.cancel = nil
	if err == nil && w.evicted {
		err = errors.New("evicted to make room for a vm")
	}
	if err == nil && p.ctx.Err() == nil {
		w.State = warmReady
		delete(p.failures, w.key())
		p.mu.Unlock()
		p.save()
		p.log.Info("warm vm ready", "warm_vm", w.ID, "image", w.Image, "pid", m.Process.PID, "boot", time.Since(start))
		return
	}
	delete(p.entries, w.ID)
	if p.ctx.Err() == nil && !w.evicted {
		b := p.failures[w.key()]
		b.failures++
		b.until = time.Now().Add(min(maxPoolBackoff, time.Second<<min(b.failures-1, 6)))
		p.failures[w.key()] = b
	}
	p.mu.Unlock()
	p.save()
	switch {
	case p.ctx.Err() != nil:
		p.log.Info("warm boot cancelled: the agent stops", "warm_vm", w.ID)
	case w.evicted:
		p.log.Info("warm boot stopped: evicted to make room for a vm", "warm_vm", w.ID)
	default:
		p.log.Error("warm boot failed; retrying later", "warm_vm", w.ID, "image", w.Image, "err", err)
	}
	p.destroy(m)
}

func (p *pool) bootWarm(ctx context.Context, w *warmVM, m *Machine) error {
	d := p.a.cfg.Driver
	if err := os.MkdirAll(m.Dir, 0o750); err != nil {
		return fmt.Errorf("create directory of warm vm %s: %w", w.ID, err)
	}
	if err := d.Create(ctx, m); err != nil {
		return err
	}
	// Started at the pool's priority (its nice value, its cgroup's
	// weight): a warm boot, a TCG boot taking a core for seconds, never
	// runs an instruction at the user VMs' priority.
	if err := d.Boot(ctx, m, BootOptions{Nice: max(p.opts.Nice, 0)}); err != nil {
		return err
	}
	p.mu.Lock()
	w.Process = m.Process
	p.mu.Unlock()
	p.save()
	if err := p.wd.WaitReady(ctx, m); err != nil {
		return err
	}
	if err := d.Pause(ctx, m); err != nil {
		return err
	}
	if obs := d.Observe(ctx, m, agentapi.StatePaused); obs.State != agentapi.StatePaused {
		return fmt.Errorf("warm vm %s is %s after the pause, not paused: %s", w.ID, obs.State, obs.Reason)
	}
	return nil
}

// destroy ends a warm VM and removes its directory. When its process cannot
// be ended, the directory stays for the next reconcile to retry.
func (p *pool) destroy(m *Machine) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(p.ctx), 30*time.Second)
	defer cancel()
	if err := p.a.cfg.Driver.Kill(ctx, m); err != nil {
		p.log.Error("end the process of a warm vm; the next agent start retries", "warm_vm", m.ID, "err", err)
		return
	}
	p.removeDir(m.Dir)
}

// removeDir removes a warm VM's directory: renamed first, so that a crash
// halfway never leaves a half directory that looks like a warm VM.
func (p *pool) removeDir(dir string) {
	trash := filepath.Join(p.dir, fmt.Sprintf("%s%s-%d", trashPrefix, filepath.Base(dir), time.Now().UnixNano()))
	if err := os.Rename(dir, trash); err != nil {
		if !os.IsNotExist(err) {
			p.log.Error("remove warm vm directory", "dir", dir, "err", err)
		}
		return
	}
	if err := os.RemoveAll(trash); err != nil {
		p.log.Warn("remove warm vm directory", "dir", trash, "err", err)
	}
}

// held is what the warm pool holds: its ready and booting warm VMs.
func (p *pool) held() agentapi.Resources {
	p.mu.Lock()
	defer p.mu.Unlock()
	var r agentapi.Resources
	for _, w := range p.entries {
		r = addResources(r, p.warmHeld(w), 1)
	}
	return r
}

// warmHeld is what one warm VM takes of the host.
func (p *pool) warmHeld(w *warmVM) agentapi.Resources {
	return agentapi.Resources{VCPUs: w.VCPUs, MemoryMiB: w.MemoryMiB, DiskMiB: p.a.vmDiskMiB(w.DiskMiB)}
}

// addResources is a + sign*b.
func addResources(a, b agentapi.Resources, sign int64) agentapi.Resources {
	return agentapi.Resources{VCPUs: a.VCPUs + sign*b.VCPUs, MemoryMiB: a.MemoryMiB + sign*b.MemoryMiB, DiskMiB: a.DiskMiB + sign*b.DiskMiB}
}

// overCapacity reports whether used exceeds capacity in any resource;
// vCPUs count only when capacity knows them (usable).
func overCapacity(used, capacity agentapi.Resources) bool {
	return (capacity.VCPUs > 0 && used.VCPUs > capacity.VCPUs) ||
		used.MemoryMiB > capacity.MemoryMiB || used.DiskMiB > capacity.DiskMiB
}

// makeRoom evicts warm VMs while the user VMs (vm, being created or
// grown, counted among them) and the warm pool together take more vCPUs,
// memory or disk than the host has: a user VM never waits for, nor is
// refused for, a warm VM. Ready warm VMs go first, oldest first, then
// boots in flight are stopped. The filler boots replacements only once
// there is room again (fill).
func (p *pool) makeRoom(vm string) {
	capacity, err := p.a.usable()
	if err != nil {
		p.log.Error("read host capacity; no warm vm evicted for the vm", "vm", vm, "err", err)
		return
	}
	alloc, _ := p.a.allocated()
	p.mu.Lock()
	var held agentapi.Resources
	var victims []*warmVM
	for _, w := range p.entries {
		held = addResources(held, p.warmHeld(w), 1)
	}
	over := func() bool { return overCapacity(addResources(alloc, held, 1), capacity) }
	var stopped []*warmVM
	for _, state := range []string{warmReady, warmBooting} {
		for _, w := range p.sortedByAge(state) {
			if !over() {
				break
			}
			held = addResources(held, p.warmHeld(w), -1)
			if state == warmReady {
				delete(p.entries, w.ID)
				victims = append(victims, w)
			} else if !w.evicted {
				// Its boot ends, removes its entry and destroys it.
				w.evicted = true
				if w.cancel != nil {
					w.cancel()
				}
				stopped = append(stopped, w)
			}
		}
	}
	p.mu.Unlock()
	if len(victims) == 0 && len(stopped) == 0 {
		return
	}
	if len(victims) > 0 {
		p.save()
	}
	for state, ws := range map[string][]*warmVM{warmReady: victims, warmBooting: stopped} {
		for _, w := range ws {
			p.log.Info("warm vm evicted to make room for a vm", "vm", vm, "warm_vm", w.ID, "image", w.Image,
				"memory_mib", w.MemoryMiB, "disk_mib", w.DiskMiB, "state", state)
		}
	}
	for _, w := range victims {
		p.destroy(p.machine(w))
	}
}

// sortedByAge returns the warm VMs in state, oldest first, any shape;
// p.mu is held.
func (p *pool) sortedByAge(state string) []*warmVM {
	var out []*warmVM
	for _, w := range p.entries {
		if w.State == state {
			out = append(out, w)
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if !out[i].CreatedAt.Equal(out[j].CreatedAt) {
			return out[i].CreatedAt.Before(out[j].CreatedAt)
		}
		return out[i].ID < out[j].ID
	})
	return out
}

// take removes the oldest ready warm VM of key that booted with firmware
// from the pool and the registry, and returns it; nil when there is none.
func (p *pool) take(key poolKey, needNIC bool, firmware string) *warmVM {
	p.mu.Lock()
	var w *warmVM
	for _, c := range p.sortedEntries(key, warmReady, false) {
		if needNIC && c.MACAddress == "" {
			continue // booted without a NIC by an older agent
		}
		if c.firmware() != firmware {
			continue
		}
		w = c
		delete(p.entries, w.ID)
		break
	}
	p.mu.Unlock()
	if w != nil {
		// Not synced: a warm create waits for one sync only, its journal
		// record (pool_journal.go). A crash that loses this write leaves w
		// listed, and the next start still never hands it out: before its
		// record, w is an orphan (as it would be by the directory sweep
		// anyway); after it, the replay made it a link to its VM, which
		// the reconcile leaves alone.
		p.saveRegistry(false)
		p.kick()
	}
	return w
}

// checkReady destroys ready warm VMs that are no longer paused (their
// process died): the filler boots new ones.
func (p *pool) checkReady() {
	p.mu.Lock()
	var ready []*warmVM
	for _, w := range p.entries {
		if w.State == warmReady {
			ready = append(ready, w)
		}
	}
	p.mu.Unlock()
	for _, w := range ready {
		m := p.machine(w)
		obs := p.a.cfg.Driver.Observe(p.ctx, m, agentapi.StatePaused)
		if obs.State == agentapi.StatePaused {
			continue
		}
		p.mu.Lock()
		_, still := p.entries[w.ID]
		delete(p.entries, w.ID)
		p.mu.Unlock()
		if !still {
			continue // taken meanwhile
		}
		p.log.Warn("warm vm lost; destroying it", "warm_vm", w.ID, "state", obs.State, "reason", obs.Reason)
		p.save()
		p.destroy(m)
	}
	p.kick()
}

// status is the pool per image and shape: targets, and the shapes that
// still have warm VMs without one.
func (p *pool) status() []agentapi.PoolStatus {
	p.mu.Lock()
	defer p.mu.Unlock()
	rows := map[poolKey]*agentapi.PoolStatus{}
	row := func(k poolKey) *agentapi.PoolStatus {
		r := rows[k]
		if r == nil {
			r = &agentapi.PoolStatus{Image: k.Image, VCPUs: k.VCPUs, MemoryMiB: k.MemoryMiB, DiskMiB: k.DiskMiB}
			rows[k] = r
		}
		return r
	}
	for k, size := range p.targets {
		row(k).Size = size
	}
	for _, w := range p.entries {
		r := row(w.key())
		if w.State == warmReady {
			r.Ready++
		} else {
			r.Booting++
		}
	}
	keys := make([]poolKey, 0, len(rows))
	for k := range rows {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool { return keys[i].less(keys[j]) })
	out := make([]agentapi.PoolStatus, 0, len(keys))
	for _, k := range keys {
		out = append(out, *rows[k])
	}
	return out
}

// PoolStatus returns the warm pool per image and shape (GET /v1/pool).
func (a *Agent) PoolStatus() []agentapi.PoolStatus { return a.pool.status() }

// SetPool replaces the warm pool targets of one image (PUT /v1/pool/{image})
// and returns the whole pool's status. The targets are saved before they
// apply, so that a restarted agent refills to them.
func (a *Agent) SetPool(ctx context.Context, image string, put agentapi.PoolPut) ([]agentapi.PoolStatus, error) {
	p := a.pool
	if p.wd == nil {
		return nil, errInvalid("the %s driver cannot keep a warm pool", a.cfg.Driver.Name())
	}
	p.targetsMu.Lock()
	defer p.targetsMu.Unlock()
	p.mu.Lock()
	next := map[poolKey]int{}
	known := false
	for k, v := range p.targets {
		if k.Image == image {
			known = true
		} else {
			next[k] = v
		}
	}
	p.mu.Unlock()
	// An image removed from disk may still have targets: clearing them must work.
	if len(put.Shapes) > 0 || !known {
		if _, err := a.cfg.Driver.Image(image); errors.Is(err, ErrUnknownImage) {
			e := errInvalid("image %q does not exist on this agent; it has %v", image, a.cfg.Driver.Images())
			e.Details = map[string]any{"image": image, "images": a.cfg.Driver.Images()}
			return nil, e
		} else if err != nil {
			return nil, fmt.Errorf("read image %s: %w", image, err)
		}
	}
	total := 0
	for _, v := range next {
		total += v
	}
	for i, s := range put.Shapes {
		if s.Size < 0 || s.Size > p.opts.MaxSize {
			return nil, errInvalid("shapes[%d].size must be between 0 and %d (--pool-max-size), got %d", i, p.opts.MaxSize, s.Size)
		}
		spec := agentapi.VMSpec{Image: image, VCPUs: s.VCPUs, MemoryMiB: s.MemoryMiB, DiskMiB: s.DiskMiB}
		if _, err := a.checkSpec(spec); err != nil {
			var de *Error
			if errors.As(err, &de) {
				return nil, &Error{Status: de.Status, Code: de.Code, Message: fmt.Sprintf("shapes[%d]: %s", i, de.Message), Details: de.Details}
			}
			return nil, fmt.Errorf("shapes[%d]: %w", i, err)
		}
		k := poolKey{image, s.VCPUs, s.MemoryMiB, s.DiskMiB}
		if _, dup := next[k]; dup {
			return nil, errInvalid("shapes[%d] repeats the shape %d vcpus, %d MiB memory, %d MiB disk; give each shape once", i, s.VCPUs, s.MemoryMiB, s.DiskMiB)
		}
		next[k] = s.Size
		total += s.Size
	}
	if total > p.opts.MaxSize {
		e := errInvalid("the warm pool would hold %d vms, more than this agent's limit of %d (--pool-max-size); lower the sizes", total, p.opts.MaxSize)
		e.Details = map[string]any{"total": total, "limit": p.opts.MaxSize}
		return nil, e
	}
	for k, v := range next {
		if v == 0 {
			delete(next, k)
		}
	}
	if err := p.saveTargets(next); err != nil {
		return nil, err
	}
	p.mu.Lock()
	p.targets = next
	for k := range p.failures {
		if k.Image == image {
			delete(p.failures, k) // a new target deserves a prompt try
		}
	}
	p.mu.Unlock()
	p.log.Info("warm pool targets set", "image", image, "shapes", len(put.Shapes), "total", total)
	p.kick()
	return p.status(), nil
}
