// Package agent is the host agent: its HTTP API, the
// registry of the VMs on this host and their durable metadata. The VMM is a
// Driver: internal/agent/qemu for real guests, internal/agent/sim for scale
// tests.
package agent

import (
	"context"
	"crypto/ed25519"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/image"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/network"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/limits"
	"github.com/kvmfleet/terraform-provider-kvm/internal/timing"
	"github.com/kvmfleet/terraform-provider-kvm/internal/version"
)

// Config configures an Agent.
type Config struct {
	// StateDir holds one directory per VM (<StateDir>/vms/<id>).
	StateDir string
	// Driver runs the VMs.
	Driver Driver
	// Token is the bearer token every /v1 call must carry. Empty is refused.
	Token string
	// MetricsToken, when set, is the bearer token GET /metrics requires;
	// empty leaves /metrics open (guests cannot reach it: see the
	// operating guide).
	MetricsToken string
	// Capacity is the capacity to advertise; zero fields are taken from the
	// driver (the host's own figures).
	Capacity agentapi.Resources
	// StopTimeout is how long a stop waits for the guest to power off after
	// the ACPI request before the VMM is ended (default 10 s).
	StopTimeout time.Duration
	// NoSync skips fsync of metadata writes (benchmarks on slow disks only).
	NoSync bool
	// DiskChainDepth bounds the files of a VM's own disk chain, and so the
	// disk files of each of its snapshots and of a pull (disk_chain.go);
	// default DefaultDiskChainDepth, at least 2.
	DiskChainDepth int
	// Logger receives the agent's logs (default slog.Default()).
	Logger *slog.Logger
	// Pool configures the warm pool (pool.go).
	Pool PoolOptions
	// PeerHTTPClient makes the calls to other agents (snapshot pulls), e.g.
	// with the CA that signed their TLS certificates; default plain HTTP.
	PeerHTTPClient *http.Client
	// ImageCacheDir holds the cache of registered images (<dir>/sha256/<hex>,
	// internal/agent/image), normally the --image-dir; empty: no cache, and
	// a VM of a registered image is refused. The driver must resolve the
	// cache's image names ("sha256:<hex>") in the same directory.
	ImageCacheDir string
	// ImageFetch tunes the cache's fetches (tests); its ImageDir, peer
	// client and token are set from the fields above.
	ImageFetch image.Config
	// Addresses are the addresses (scheme://host:port) the agent signs
	// identity challenges for beside the IP and port a challenge arrives
	// on: its DNS names, or a proxy in front of it (identity.go).
	Addresses []string
	// UnderlayAddress is the IPv4 address (of one of the host's
	// interfaces) that the VXLAN tunnels of overlay networks start from;
	// empty: the agent takes no overlay network (overlay.go).
	UnderlayAddress string

	// volumeHook runs once a new volume's files are complete, before they
	// are renamed into place (tests: a crash there).
	volumeHook func(id string) error
	// handoverHook runs at each step of a warm handover (Hold*,
	// pool_journal.go): tests stop the agent there. Without one, New takes
	// the one of the build (handoverHookFromEnv).
	handoverHook func(step string)
}

// Agent is one host agent. VM states are observed when they are asked for;
// its one goroutine is the warm pool's filler, which Close stops. The VMs
// keep running after Close.
type Agent struct {
	cfg     Config
	log     *slog.Logger
	started time.Time
	handler http.Handler

	vms   *registry[vmRecord]        // VMs by id
	snaps *registry[*snapshotRecord] // snapshots by id (snapshot_registry.go); a nil record until complete
	vols  *registry[*volumeRecord]   // volumes by id (volume.go); a nil record until complete
	// basesMu keeps a clone's new base and the removal of unused bases
	// apart (volume.go).
	basesMu sync.Mutex
	// pulls are the snapshot pulls under way, by snapshot id, and
	// pullWaiters the children that wait for one to get ready
	// (snapshot_pull.go), under pullsMu.
	pullsMu     sync.Mutex
	pulls       map[string]*pullWatch
	pullWaiters pullWaiters

	images *image.Cache // registered images (images.go); nil without ImageCacheDir

	// identity is the agent's key (identity.go); addresses are the
	// addresses it signs for beside the one a challenge arrives on.
	identity  ed25519.PrivateKey
	addrMu    sync.Mutex
	addresses []string

	pool *pool // the warm pool and its filler, the one goroutine Close stops
	// placedCapacity is the host capacity the control plane last sent with
	// a create (VMSpec.HostCapacity); nil until one did (usable).
	placedCapacity atomic.Pointer[agentapi.Resources]
	// syncs are the background syncs of snapshot files (snapshot_sync.go),
	// which Close hurries (closing) and waits for.
	syncs     sync.WaitGroup
	closing   chan struct{}
	closeOnce sync.Once

	// outgoing are the migrations this agent runs, by VM id, and
	// committing the VMs whose target it commits in the background
	// (migrate_source.go), under migMu.
	migMu      sync.Mutex
	outgoing   map[string]*outMigration
	committing map[string]bool

	// overlays programs the overlay networks (overlay.go): the driver's
	// network.Host when it has one.
	overlays *network.Host
}

// vmEntry is one VM in the registry. A VM whose metadata is corrupt is
// reported in error, with the reason in its record's Reason.
type vmEntry = entry[vmRecord]

// New loads the VMs in cfg.StateDir and re-adopts those still running: it
// never kills or forgets a VM it finds. A VM whose process is gone is
// reported stopped with the reason; a corrupt metadata file is moved aside
// and only that VM is reported in error.
func New(ctx context.Context, cfg Config) (*Agent, error) {
	if cfg.Driver == nil {
		return nil, errors.New("agent: no driver")
	}
	if cfg.Token == "" {
		return nil, errors.New("agent: empty token: give --token or --token-file")
	}
	if cfg.StateDir == "" {
		return nil, errors.New("agent: empty state directory: give --state-dir")
	}
	if cfg.DiskChainDepth == 0 {
		cfg.DiskChainDepth = DefaultDiskChainDepth
	}
	if cfg.DiskChainDepth < 2 {
		return nil, fmt.Errorf("disk chain depth %d: it must be at least 2 (a vm's disk on the one its snapshots froze)", cfg.DiskChainDepth)
	}
	if cfg.StopTimeout <= 0 {
		cfg.StopTimeout = 10 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	abs, err := filepath.Abs(cfg.StateDir)
	if err != nil {
		return nil, fmt.Errorf("agent: state directory %s: %w", cfg.StateDir, err)
	}
	cfg.StateDir = abs
	a := &Agent{cfg: cfg, log: cfg.Logger.With("driver", cfg.Driver.Name()), started: time.Now().UTC(),
		vms: newRegistry[vmRecord]("vm"), snaps: newRegistry[*snapshotRecord]("snapshot"),
		vols: newRegistry[*volumeRecord]("volume"), closing: make(chan struct{})}
	if err := os.MkdirAll(a.vmsDir(), 0o750); err != nil {
		return nil, fmt.Errorf("agent: create state directory %s: %w", a.vmsDir(), err)
	}
	if err := a.loadIdentity(); err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	for _, addr := range cfg.Addresses {
		if err := a.AllowAddress(addr); err != nil {
			return nil, fmt.Errorf("agent: advertised %w", err)
		}
	}
	// Before the VMs are re-adopted: their overlay NICs need the underlay.
	if err := a.setupOverlays(); err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	if a.cfg.handoverHook == nil {
		a.cfg.handoverHook = handoverHookFromEnv()
	}
	// Before the VMs are loaded: a replayed handover makes a VM directory.
	journal, err := openHandoverJournal(a)
	if err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	started := false
	defer func() {
		if !started {
			journal.close()
		}
	}()
	loaded, err := a.loadRecords()
	if err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	if err := a.loadSnapshots(); err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	if err := a.loadVolumes(); err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	if cfg.ImageCacheDir != "" {
		ic := cfg.ImageFetch
		ic.ImageDir, ic.PeerHTTP, ic.PeerToken = cfg.ImageCacheDir, cfg.PeerHTTPClient, cfg.Token
		ic.VerifyPeer = a.verifyImagePeer
		if ic.Logger == nil {
			ic.Logger = a.log
		}
		if a.images, err = image.New(ic); err != nil {
			return nil, fmt.Errorf("agent: %w", err)
		}
	}
	a.adopt(ctx, loaded)
	if err := startPool(ctx, a, journal); err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	started = true
	accel, note := cfg.Driver.Accel()
	a.log.Info("agent ready", "state_dir", cfg.StateDir, "accel", accel, "accel_note", note, "vms", len(loaded))
	a.handler = a.routes()
	return a, nil
}

// adopt registers the loaded VMs and asks the driver about each, a few at a
// time: re-adoption checks a pid and a QMP socket per VM.
func (a *Agent) adopt(ctx context.Context, loaded []loadedVM) {
	for _, l := range loaded {
		e := a.vms.entry(l.id)
		if l.rec == nil {
			e.setCorrupt(vmRecord{Version: metaVersion, ID: l.id, State: agentapi.StateError, Reason: l.corrupt}, l.corrupt)
		} else {
			e.set(*l.rec)
		}
	}
	a.forEach(func(e *vmEntry) {
		before, corrupt, _ := e.state()
		if corrupt != "" {
			return
		}
		if !e.tryLock() {
			return
		}
		defer e.unlock()
		a.adoptNetwork(ctx, before)
		after := a.refreshLocked(ctx, e)
		switch {
		case after.State == agentapi.StateRunning || after.State == agentapi.StatePaused:
			a.log.Info("re-adopted vm", "vm", e.id, "pid", after.Process.PID, "state", after.State)
		case before.State != after.State:
			a.log.Warn("vm not running after agent start", "vm", e.id, "was", before.State, "state", after.State, "reason", after.Reason)
		}
	})
}

// forEach runs fn for every VM, at most 16 at once, and waits for all.
func (a *Agent) forEach(fn func(*vmEntry)) {
	entries := a.vms.all()
	sem := make(chan struct{}, 16)
	var wg sync.WaitGroup
	for _, e := range entries {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			fn(e)
		}()
	}
	wg.Wait()
}

// Handler is the agent's HTTP API.
func (a *Agent) Handler() http.Handler { return a.handler }

// Close releases the agent and stops the warm pool's filler. Its VMs keep
// running: a new agent on the same state directory re-adopts them (and
// destroys the warm ones left in the pool).
func (a *Agent) Close() error {
	a.pool.stop()
	if a.images != nil {
		a.images.Close()
	}
	a.closeOnce.Do(func() { close(a.closing) })
	a.syncs.Wait()
	return nil
}

func machineOf(a *Agent, r vmRecord) *Machine {
	return &Machine{ID: r.ID, Dir: a.vmDir(r.ID), Image: r.Image, VCPUs: r.VCPUs,
		MemoryMiB: r.MemoryMiB, DiskMiB: r.DiskMiB, Disk: r.Disk, Process: r.Process,
		NICs: cloneNICs(r.NICs), GuestNICs: cloneNICs(r.GuestNICs), Seed: seedOf(r),
		GuestAgent: r.GuestAgent, Volumes: a.machineVolumes(r),
		Firmware: r.firmware(), SecureBoot: r.SecureBoot}
}

// seedOf is Machine.Seed of VM r.
func seedOf(r vmRecord) string {
	if r.Seed == nil {
		return ""
	}
	return SeedFileName
}

// refreshLocked asks the driver for the VM's state and records a change.
// The caller holds e's operation lock.
func (a *Agent) refreshLocked(ctx context.Context, e *vmEntry) vmRecord {
	r, corrupt, gone := e.state()
	if corrupt != "" || gone {
		return r
	}
	if r.Migration != nil && r.Migration.State == agentapi.MigrationRunning {
		r = a.refreshMigrationLocked(ctx, e, r) // migrate_source.go
	}
	switch r.State {
	case agentapi.StateIncoming:
		return a.refreshIncomingLocked(ctx, e, r) // migrate_incoming.go
	case agentapi.StateMigrated, agentapi.StateFailed:
		return r // its VMM never runs the guest again; only a delete ends it
	}
	obs := a.cfg.Driver.Observe(ctx, machineOf(a, r), r.State)
	adopted := obs.Process.PID != 0 && obs.Process != r.Process
	if obs.State == r.State && (obs.Reason == r.Reason || obs.Reason == "") && !adopted {
		return r
	}
	r.State, r.Reason = obs.State, obs.Reason
	if adopted {
		a.log.Warn("adopted a vm process its metadata did not record", "vm", r.ID, "pid", obs.Process.PID, "recorded_pid", r.Process.PID)
		r.Process = obs.Process
	}
	if r.State == agentapi.StateStopped {
		r.Process = Process{}
	}
	if err := a.saveRecord(&r); err != nil {
		a.log.Error("save observed vm state", "vm", r.ID, "state", r.State, "err", err)
	}
	e.set(r)
	return r
}

// current returns the VM's state, observed afresh unless an operation of
// that VM is running (then its last recorded state).
func (a *Agent) current(ctx context.Context, e *vmEntry) vmRecord {
	if !e.tryLock() {
		r, _, _ := e.state()
		return r
	}
	defer e.unlock()
	return a.refreshLocked(ctx, e)
}

func (a *Agent) lookup(id string) *vmEntry { return a.vms.lookup(id) }

// lockVM returns VM id's entry with its operation lock held, for an
// operation that needs its metadata (what it would do, for the message:
// "be resized"): a 404 when there is no such VM, a 409 when its metadata is
// corrupt.
func (a *Agent) lockVM(ctx context.Context, id, what string) (*vmEntry, error) {
	e, err := a.vms.acquire(ctx, id)
	switch {
	case err != nil:
		return nil, err
	case e == nil:
		return nil, errNotFound(id)
	}
	r, corrupt, _ := e.state()
	if corrupt != "" {
		e.unlock()
		return nil, errConflict("vm %s cannot %s: %s; delete it and create it again", id, what, r.Reason)
	}
	if !migrationVerbs[what] {
		switch r.State {
		case agentapi.StateIncoming, agentapi.StateMigrated, agentapi.StateFailed:
			e.unlock()
			return nil, migrationRefusal(id, ReasonMigrationState, "vm %s cannot %s: it is %s (a migration); only a delete changes it here", id, what, r.State)
		}
	}
	return e, nil
}

// GetVM returns one VM.
func (a *Agent) GetVM(ctx context.Context, id string) (agentapi.VM, error) {
	e := a.lookup(id)
	if e == nil {
		return agentapi.VM{}, errNotFound(id)
	}
	r := a.current(ctx, e)
	if _, _, gone := e.state(); gone {
		return agentapi.VM{}, errNotFound(id)
	}
	vm := r.wire()
	if byNIC, ok := a.guestAgentAddresses(ctx, r); ok {
		for i := range vm.NICs {
			vm.NICs[i].IPv4Addresses = byNIC[i]
		}
	}
	return vm, nil
}

// ListVMs returns every VM, sorted by id.
func (a *Agent) ListVMs(ctx context.Context) []agentapi.VM {
	var mu sync.Mutex
	out := []agentapi.VM{}
	a.forEach(func(e *vmEntry) {
		r := a.current(ctx, e)
		if _, _, gone := e.state(); gone {
			return
		}
		mu.Lock()
		out = append(out, r.wire())
		mu.Unlock()
	})
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

var idPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)

func checkID(id string) error {
	if !idPattern.MatchString(id) {
		return errInvalid("vm id %q is not valid: use 1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit", id)
	}
	return nil
}

func (a *Agent) checkSpec(spec agentapi.VMSpec) (Image, error) {
	switch {
	case spec.Image == "":
		return Image{}, errInvalid("image is required; this agent has %v", a.cfg.Driver.Images())
	case spec.VCPUs < 1 || spec.VCPUs > limits.MaxVCPUs:
		return Image{}, errInvalid("vcpus must be between 1 and %d, got %d", limits.MaxVCPUs, spec.VCPUs)
	case spec.MemoryMiB < 1 || spec.MemoryMiB > limits.MaxMemoryMiB:
		return Image{}, errInvalid("memory_mib must be between 1 and %d, got %d", limits.MaxMemoryMiB, spec.MemoryMiB)
	case spec.DiskMiB < 0 || spec.DiskMiB > limits.MaxDiskMiB:
		return Image{}, errInvalid("disk_mib must be between 0 and %d, got %d", limits.MaxDiskMiB, spec.DiskMiB)
	case spec.Snapshot != nil:
		if err := checkSnapshotSource(spec); err != nil {
			return Image{}, err
		}
	}
	if err := checkNICs(spec.NICs); err != nil {
		return Image{}, err
	}
	img, err := a.cfg.Driver.Image(spec.Image)
	if errors.Is(err, ErrUnknownImage) {
		e := errInvalid("image %q does not exist on this agent; it has %v", spec.Image, a.cfg.Driver.Images())
		e.Details = map[string]any{"image": spec.Image, "images": a.cfg.Driver.Images()}
		return Image{}, e
	}
	if err != nil {
		return Image{}, fmt.Errorf("read image %s: %w", spec.Image, err)
	}
	if img.BaseDiskMiB > 0 && spec.DiskMiB < img.BaseDiskMiB {
		return Image{}, errInvalid("disk_mib %d is smaller than the %d MiB disk of image %s", spec.DiskMiB, img.BaseDiskMiB, img.Name)
	}
	if err := checkFirmware(spec, img); err != nil {
		return Image{}, err
	}
	if err := a.cfg.Driver.CheckSpec(spec, img); err != nil {
		return Image{}, err
	}
	return img, nil
}

// ImageName is the image of a spec as its user knows it: a registered
// image's name, not the cache's reference.
func ImageName(spec agentapi.VMSpec) string {
	if spec.ImageSource != nil && spec.ImageSource.Name != "" {
		return spec.ImageSource.Name
	}
	return spec.Image
}

// checkFirmwareField refuses a firmware the agent does not know, and
// Secure Boot without UEFI where the spec says so itself.
func checkFirmwareField(spec agentapi.VMSpec) error {
	switch spec.Firmware {
	case "", agentapi.FirmwareBIOS, agentapi.FirmwareUEFI:
	default:
		return errInvalid("firmware %q is not one of bios, uefi", spec.Firmware)
	}
	if spec.SecureBoot && spec.Firmware == agentapi.FirmwareBIOS {
		return errInvalid("secure_boot needs firmware uefi; vm firmware is bios (use an image with firmware = \"uefi\")")
	}
	return nil
}

// checkFirmware checks the VM's firmware against its image: UEFI boots a
// disk, and Secure Boot needs UEFI. A VM started from a snapshot takes its
// source's (spawnLocked checks it against the snapshot).
func checkFirmware(spec agentapi.VMSpec, img Image) error {
	if spec.Snapshot != nil {
		return nil
	}
	fw := spec.Firmware
	if fw == "" {
		fw = img.Firmware
	}
	switch {
	case fw == agentapi.FirmwareUEFI && img.Kind != ImageDisk:
		return errInvalid("image %s is a kernel image, booted by QEMU directly: firmware uefi boots disk images only", ImageName(spec))
	case spec.SecureBoot && fw != agentapi.FirmwareUEFI:
		return errInvalid("secure_boot needs a uefi image; image %s boots with firmware bios (set firmware = \"uefi\" on an image that has an EFI system partition)", ImageName(spec))
	}
	return nil
}

// CreateVM creates and boots VM id, or returns it when it exists with the
// same shape: a retried or concurrent PUT never starts a second VM.
func (a *Agent) CreateVM(ctx context.Context, id string, spec agentapi.VMSpec) (agentapi.VM, bool, error) {
	if err := checkID(id); err != nil {
		return agentapi.VM{}, false, err
	}
	start := time.Now()
	if spec.HostCapacity != nil {
		c := *spec.HostCapacity
		a.placedCapacity.Store(&c)
	}
	src := spec.ImageSource
	spec, err := a.resolveImage(spec)
	if err != nil {
		return agentapi.VM{}, false, err
	}
	if err := checkFirmwareField(spec); err != nil {
		return agentapi.VM{}, false, err
	}
	validated := false
	for {
		e := a.lookup(id)
		if e == nil {
			// Validated only for a new VM: a retry must find its VM even if
			// the image was removed since.
			if !validated {
				if err := a.ensureImage(ctx, src); err != nil {
					return agentapi.VM{}, false, err
				}
				if spec.Firmware == "" && spec.Snapshot == nil {
					// The image's, fixed for the VM's life at its create.
					if img, err := a.cfg.Driver.Image(spec.Image); err == nil {
						spec.Firmware = img.Firmware
					}
				}
				if _, err := a.checkSpec(spec); err != nil {
					return agentapi.VM{}, false, err
				}
				if err := checkSeed(id, spec); err != nil {
					return agentapi.VM{}, false, err
				}
				if err := a.checkCreateVolumes(spec); err != nil {
					return agentapi.VM{}, false, err
				}
				validated = true
				timing.Since(ctx, "checks", start)
			}
			if e = a.vms.create(id); e != nil {
				defer e.unlock()
				vm, err := a.createLocked(ctx, e, spec)
				return vm, true, err
			}
			continue // another call created it meanwhile
		}
		if err := e.lock(ctx); err != nil {
			return agentapi.VM{}, false, err
		}
		r, corrupt, gone := e.state()
		e.unlock()
		if gone {
			continue // deleted (or its create failed) while we waited
		}
		if corrupt != "" {
			return agentapi.VM{}, false, errConflict("vm %s exists but its metadata is corrupt (%s); delete it and create it again", id, r.Reason)
		}
		if r.Image != spec.Image || r.VCPUs != spec.VCPUs || r.MemoryMiB != spec.MemoryMiB || r.DiskMiB != spec.DiskMiB ||
			!sameNICs(r.askedNICs(), spec.NICs) || r.GuestAgent != spec.GuestAgent || !sameVolumes(r.Volumes, spec.Volumes) ||
			(spec.Firmware != "" && spec.Firmware != r.firmware()) || (spec.Snapshot == nil && spec.SecureBoot != r.SecureBoot) {
			err := errConflict("vm %s already exists with a different shape (image %s, %d vcpus, %d MiB memory, %d MiB disk, %d nics, guest agent %v, %d volumes, firmware %s, secure boot %v)",
				id, r.Image, r.VCPUs, r.MemoryMiB, r.DiskMiB, len(r.NICs), r.GuestAgent, len(r.Volumes), r.firmware(), r.SecureBoot)
			err.Details = map[string]any{"id": id}
			return agentapi.VM{}, false, err
		}
		return r.wire(), false, nil
	}
}

func (a *Agent) createLocked(ctx context.Context, e *vmEntry, spec agentapi.VMSpec) (agentapi.VM, error) {
	if spec.Snapshot != nil {
		return a.spawnLocked(ctx, e, spec) // snapshot.go; never a warm VM
	}
	r := vmRecord{
		Version: metaVersion, ID: e.id, Image: spec.Image, VCPUs: spec.VCPUs, MemoryMiB: spec.MemoryMiB,
		DiskMiB: spec.DiskMiB, State: agentapi.StateCreating, StartedFrom: agentapi.StartedCold,
		CreatedAt: time.Now().UTC().Truncate(time.Millisecond), NICs: requestedNICs(spec.NICs), Seed: spec.Seed,
		GuestAgent: spec.GuestAgent,
		Firmware:   spec.Firmware, SecureBoot: spec.SecureBoot,
	}
	if len(spec.Volumes) > 0 {
		// Claimed and recorded in the entry under the volumes' locks, so
		// that no other VM takes them meanwhile.
		held, vols, err := a.claimVolumes(ctx, e.id, spec.Volumes)
		if err != nil {
			a.vms.drop(e)
			return agentapi.VM{}, err
		}
		r.Volumes = vols
		e.set(r)
		held.unlock()
	}
	e.set(r)
	// A matching warm VM first (pool_acquire.go); a miss boots cold below.
	// Either way the pool's filler waits until this create is done.
	defer a.pool.userCreating()()
	if vm, ok := a.createWarm(ctx, e, r, spec); ok {
		return vm, nil
	}
	fail := func(err error) (agentapi.VM, error) {
		return a.abandonCreate(ctx, e, r, fmt.Errorf("create vm %s: %w", e.id, err))
	}
	// A cold boot adds to what the host runs: warm VMs make room for it.
	a.pool.makeRoom(e.id)
	if err := os.MkdirAll(a.vmDir(e.id), 0o750); err != nil {
		return fail(err)
	}
	if err := a.saveRecord(&r); err != nil {
		return fail(err)
	}
	if err := a.ensureSeed(r); err != nil {
		return fail(err)
	}
	m := machineOf(a, r)
	if err := a.cfg.Driver.Create(ctx, m); err != nil {
		return fail(err)
	}
	if spec.Stopped {
		r.State = agentapi.StateStopped
	} else {
		if err := a.cfg.Driver.Boot(ctx, m, BootOptions{}); err != nil {
			return fail(err)
		}
		r.State, r.Process, r.NICs = agentapi.StateRunning, m.Process, m.NICs
	}
	if err := a.saveRecord(&r); err != nil {
		return fail(err)
	}
	e.set(r)
	a.log.Info("vm created", "vm", e.id, "image", r.Image, "state", r.State, "pid", r.Process.PID)
	return r.wire(), nil
}

// removeVM ends the VM's process and removes its files and its entry. The
// caller holds e's operation lock.
func (a *Agent) removeVM(ctx context.Context, e *vmEntry, m *Machine) error {
	step := time.Now()
	end := a.cfg.Driver.Kill
	if len(m.Volumes) > 0 {
		// Volumes outlive the VM: QEMU is told to quit first, which
		// flushes what the guest already wrote to them (qcow2 metadata
		// included) before the process ends. A kill alone can lose those
		// writes, and the next VM of the volume would miss its data.
		end = func(ctx context.Context, m *Machine) error { return a.cfg.Driver.Shutdown(ctx, m, 0) }
	}
	if err := end(ctx, m); err != nil {
		return fmt.Errorf("end the process of vm %s: %w", e.id, err)
	}
	step = timing.Since(ctx, "kill", step)
	if err := a.releaseNetwork(ctx, m); err != nil {
		return err
	}
	step = timing.Since(ctx, "network", step)
	dir := a.vmDir(e.id)
	// Unique, so that a leftover of an earlier failed removal never blocks this one.
	trash := filepath.Join(a.vmsDir(), fmt.Sprintf("%s%s-%d", trashPrefix, e.id, time.Now().UnixNano()))
	if err := os.Rename(dir, trash); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove files of vm %s: %w", e.id, err)
	}
	if err := os.RemoveAll(trash); err != nil {
		a.log.Warn("remove files of deleted vm", "vm", e.id, "dir", trash, "err", err)
	}
	timing.Since(ctx, "files", step)
	a.vms.drop(e)
	return nil
}

// DeleteVM ends VM id and removes its files. An unknown id is not an error.
func (a *Agent) DeleteVM(ctx context.Context, id string) error {
	if err := checkID(id); err != nil {
		return err
	}
	start := time.Now()
	e, err := a.vms.acquire(ctx, id)
	if e == nil || err != nil {
		return err
	}
	defer e.unlock()
	timing.Since(ctx, "lock", start)
	r, _, _ := e.state()
	if err := a.removeVM(ctx, e, machineOf(a, r)); err != nil {
		return err
	}
	a.log.Info("vm deleted", "vm", id)
	return nil
}

// Action runs a power action. Actions are idempotent: stopping a stopped VM
// or starting a running one changes nothing.
func (a *Agent) Action(ctx context.Context, id, action string) (agentapi.VM, error) {
	switch action {
	case agentapi.ActionStart, agentapi.ActionStop, agentapi.ActionPause, agentapi.ActionResume:
	default:
		return agentapi.VM{}, &Error{Status: http.StatusNotFound, Code: CodeNotFound,
			Message: fmt.Sprintf("unknown power action %q: want start, stop, pause or resume", action)}
	}
	e, err := a.lockVM(ctx, id, action)
	if err != nil {
		return agentapi.VM{}, err
	}
	defer e.unlock()
	r := a.refreshLocked(ctx, e)
	m := machineOf(a, r)
	d := a.cfg.Driver
	switch action {
	case agentapi.ActionStart:
		switch r.State {
		case agentapi.StatePaused:
			err = d.Resume(ctx, m)
		case agentapi.StateStopped, agentapi.StateError:
			if r.State == agentapi.StateError {
				err = d.Kill(ctx, m) // whatever is left of it
			}
			if err == nil {
				err = a.ensureSeed(r) // a seed lost meanwhile is built again
			}
			if err == nil {
				err = d.Create(ctx, m)
			}
			if err == nil {
				err = d.Boot(ctx, m, BootOptions{})
			}
		}
		if err == nil {
			r.State, r.Reason, r.Process, r.NICs = agentapi.StateRunning, "", m.Process, m.NICs
		}
	case agentapi.ActionStop:
		if r.State != agentapi.StateStopped {
			err = d.Shutdown(ctx, m, a.cfg.StopTimeout)
		}
		if err == nil {
			r.State, r.Reason, r.Process = agentapi.StateStopped, "", Process{}
		}
	case agentapi.ActionPause:
		switch r.State {
		case agentapi.StateRunning:
			err = d.Pause(ctx, m)
		case agentapi.StatePaused:
		default:
			return agentapi.VM{}, errConflict("vm %s is %s: only a running vm can be paused; start it first", id, r.State)
		}
		if err == nil {
			r.State = agentapi.StatePaused
		}
	case agentapi.ActionResume:
		switch r.State {
		case agentapi.StatePaused:
			err = d.Resume(ctx, m)
		case agentapi.StateRunning:
		default:
			return agentapi.VM{}, errConflict("vm %s is %s: only a paused vm can be resumed; use start", id, r.State)
		}
		if err == nil {
			r.State = agentapi.StateRunning
		}
	}
	if err != nil {
		// The VM may be half way: record what the driver sees now.
		a.refreshLocked(ctx, e)
		return agentapi.VM{}, fmt.Errorf("%s vm %s: %w", action, id, err)
	}
	if err := a.saveRecord(&r); err != nil {
		return agentapi.VM{}, err
	}
	e.set(r)
	a.log.Info("vm power action", "vm", id, "action", action, "state", r.State, "pid", r.Process.PID)
	return r.wire(), nil
}

// Console returns at most max bytes of the end of the VM's console log.
func (a *Agent) Console(ctx context.Context, id string, max int64) ([]byte, error) {
	e := a.lookup(id)
	if e == nil {
		return nil, errNotFound(id)
	}
	r, corrupt, gone := e.state()
	if gone {
		return nil, errNotFound(id)
	}
	m := machineOf(a, r)
	if corrupt != "" {
		m.Image = ""
	}
	return a.cfg.Driver.Console(m, max)
}

// Info returns the host's capacity, what its VMs and its warm pool take,
// and the driver.
func (a *Agent) Info(ctx context.Context) (agentapi.Info, error) {
	d := a.cfg.Driver
	capacity, err := a.capacity()
	if err != nil {
		return agentapi.Info{}, err
	}
	alloc, count := a.allocated()
	warm := a.pool.held()
	accel, note := d.Accel()
	host, _ := os.Hostname()
	u := a.overlays.Underlay()
	underlay := ""
	if u.Addr.IsValid() {
		underlay = u.Addr.String()
	}
	return agentapi.Info{
		UnderlayAddress: underlay, UnderlayMTU: u.MTU,
		Release: version.Release(), APILevel: version.Current(),
		Hostname: host, Capacity: capacity, Allocated: alloc, Warm: warm,
		Free: agentapi.Resources{
			VCPUs:     max(0, capacity.VCPUs-alloc.VCPUs-warm.VCPUs),
			MemoryMiB: max(0, capacity.MemoryMiB-alloc.MemoryMiB-warm.MemoryMiB),
			DiskMiB:   max(0, capacity.DiskMiB-alloc.DiskMiB-warm.DiskMiB),
		},
		Accel: accel, AccelNote: note, Driver: d.Name(), Images: d.Images(), Isolation: a.isolation(),
		VMCount: count, Pool: a.pool.status(), AgentStart: a.started, ImageCache: a.imageList(),
	}, nil
}

// Isolator is a driver that runs each VM in a resource-limited container of
// the host (the qemu driver: a cgroup v2 per VM). Isolation says which, or
// why not ("none: <reason>").
type Isolator interface {
	Isolation() string
}

func (a *Agent) isolation() string {
	if i, ok := a.cfg.Driver.(Isolator); ok {
		return i.Isolation()
	}
	return "none: the " + a.cfg.Driver.Name() + " driver runs no process per vm"
}

// capacity is the host's capacity: what the host has, or the configured
// figures where they are set.
func (a *Agent) capacity() (agentapi.Resources, error) {
	capacity, err := hostCapacity(a.cfg.StateDir)
	if err != nil {
		return agentapi.Resources{}, fmt.Errorf("read host capacity: %w", err)
	}
	if a.cfg.Capacity.VCPUs > 0 {
		capacity.VCPUs = a.cfg.Capacity.VCPUs
	}
	if a.cfg.Capacity.MemoryMiB > 0 {
		capacity.MemoryMiB = a.cfg.Capacity.MemoryMiB
	}
	if a.cfg.Capacity.DiskMiB > 0 {
		capacity.DiskMiB = a.cfg.Capacity.DiskMiB
	}
	return capacity, nil
}

// usable is what the agent keeps its VMs and warm VMs within: its
// capacity, lowered to the capacity the control plane last said it places
// by (VMSpec.HostCapacity: memory reserved for the host is no room for a
// warm VM either). Its VCPUs are the control plane's (0: not known yet).
func (a *Agent) usable() (agentapi.Resources, error) {
	c, err := a.capacity()
	if err != nil {
		return c, err
	}
	// vCPUs count only as the control plane places them (its CPU
	// allocation ratio); until it said, they are not counted (0).
	c.VCPUs = 0
	if p := a.placedCapacity.Load(); p != nil {
		c.VCPUs = p.VCPUs
		if p.MemoryMiB > 0 {
			c.MemoryMiB = min(c.MemoryMiB, p.MemoryMiB)
		}
		if p.DiskMiB > 0 {
			c.DiskMiB = min(c.DiskMiB, p.DiskMiB)
		}
	}
	return c, nil
}

// allocated is what the user VMs take (those being created included) and
// how many there are.
func (a *Agent) allocated() (agentapi.Resources, int) {
	var alloc agentapi.Resources
	count := 0
	for _, e := range a.vms.all() {
		r, _, gone := e.state()
		if gone {
			continue
		}
		count++
		// Stopped VMs keep their reservation, as in the control API.
		alloc.VCPUs += r.VCPUs
		alloc.MemoryMiB += r.MemoryMiB
		alloc.DiskMiB += a.vmDiskMiB(r.DiskMiB)
	}
	alloc.DiskMiB += a.volumesDiskMiB()
	return alloc, count
}

// abandonCreate undoes a create that failed with err: it removes what the
// VM r has so far. When that fails too, something of it may be left, so the
// VM stays visible, in error, for a delete to finish the job.
func (a *Agent) abandonCreate(ctx context.Context, e *vmEntry, r vmRecord, err error) (agentapi.VM, error) {
	if rerr := a.removeVM(ctx, e, machineOf(a, r)); rerr != nil {
		r.State, r.Reason = agentapi.StateError, err.Error()+"; cleanup failed: "+rerr.Error()
		e.set(r)
		if serr := a.saveRecord(&r); serr != nil {
			a.log.Error("save failed vm", "vm", e.id, "err", serr)
		}
	}
	return agentapi.VM{}, err
}
