// Package sim is a simulated VMM for scale tests and benchmarks: its VMs are
// entries in memory, with no guest and no process. It calls itself "sim" in
// /v1/info, so nothing mistakes it for real VMs, and it always offers the
// built-in image "sim" (no files) beside those of its image directory.
package sim

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/image"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/seed"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// BuiltinImage is the image every sim driver offers.
const BuiltinImage = "sim"

// Options configures the simulated host.
type Options struct {
	// ImageDir adds its image folders (any folder with an image.json) to
	// the image list; the sim never reads the files.
	ImageDir string
	// CacheDir holds the agent's cache of registered images
	// (CacheDir/sha256/<hex>, named "sha256:<hex>"); default ImageDir.
	CacheDir string
	// BootDelay is how long a simulated boot takes (default 0).
	BootDelay time.Duration
	// MigrationTime is how long a simulated live migration's pre-copy
	// takes (default 100 ms), in MigrationSteps steps (default 10).
	MigrationTime  time.Duration
	MigrationSteps int
	// Bridges are the operator bridges the simulated host has, for NICs of
	// mode bridge (nil: DefaultBridges).
	Bridges []string
}

// Driver is the simulated VMM. It is safe for concurrent use.
type Driver struct {
	opts Options

	mu    sync.Mutex
	state map[string]string // VM id -> running | paused; absent: stopped
	// booted is when each VM last booted (its simulated cloud-init time).
	booted map[string]time.Time
	// ports are the simulated host ports of port forwards (network.go):
	// port -> VM id; cursor is where the next search starts.
	ports  map[int]string
	cursor int
	// plugged are the volumes in each running VM (volume.go).
	plugged map[string]map[string]bool
	// writing is the file each volume is written to after a snapshot
	// moved it (snapshot.go); failVolumeSwitch fails such a move.
	writing          map[string]string
	failVolumeSwitch func(volume string) error
	// incoming and outgoing are the simulated migration streams of each
	// VM (migrate.go).
	incoming map[string]string
	outgoing map[string]string
}

var _ agent.Driver = (*Driver)(nil)

// New returns a simulated driver.
func New(opts Options) *Driver {
	return &Driver{opts: opts, state: map[string]string{}, booted: map[string]time.Time{}, ports: map[int]string{}, cursor: firstSimPort,
		plugged: map[string]map[string]bool{}, writing: map[string]string{}, incoming: map[string]string{}, outgoing: map[string]string{}}
}

// Name is "sim".
func (d *Driver) Name() string { return "sim" }

// Accel is "sim": no VMM runs anything.
func (d *Driver) Accel() (string, string) {
	return "sim", "simulated driver: VMs are entries in memory, no guest runs"
}

// Images lists "sim" and the folders of the image directory.
func (d *Driver) Images() []string {
	names := []string{BuiltinImage}
	if d.opts.ImageDir != "" {
		entries, _ := os.ReadDir(d.opts.ImageDir)
		for _, e := range entries {
			if e.Name() == BuiltinImage || !e.IsDir() {
				continue
			}
			if _, err := os.Stat(filepath.Join(d.opts.ImageDir, e.Name(), "image.json")); err == nil {
				names = append(names, e.Name())
			}
		}
	}
	sort.Strings(names)
	return names
}

// Image returns one image by name.
func (d *Driver) Image(name string) (agent.Image, error) {
	cache := d.opts.CacheDir
	if cache == "" {
		cache = d.opts.ImageDir
	}
	if dir, ok := image.FolderOf(cache, name); ok {
		// The agent fetched and verified the real bytes; the sim reads
		// only that the folder is complete.
		if _, err := os.Stat(filepath.Join(dir, "image.json")); err != nil {
			return agent.Image{}, fmt.Errorf("image %s: %w", name, agent.ErrUnknownImage)
		}
		return agent.Image{Name: name, Kind: agent.ImageKernel}, nil
	}
	for _, n := range d.Images() {
		if n == name {
			return agent.Image{Name: name, Kind: agent.ImageKernel}, nil
		}
	}
	return agent.Image{}, fmt.Errorf("image %s: %w", name, agent.ErrUnknownImage)
}

// CheckSpec accepts every shape the agent accepts, and NICs on the
// simulated host's bridges.
func (d *Driver) CheckSpec(spec agentapi.VMSpec, _ agent.Image) error { return d.checkNICs(spec.NICs) }

// Create has no files to make.
func (d *Driver) Create(context.Context, *agent.Machine) error { return nil }

// Boot marks the VM running (or paused) after BootDelay, and gives its
// port forwards simulated host ports.
func (d *Driver) Boot(ctx context.Context, m *agent.Machine, opts agent.BootOptions) error {
	if err := d.assignPorts(m); err != nil {
		return err
	}
	if d.opts.BootDelay > 0 {
		t := time.NewTimer(d.opts.BootDelay)
		defer t.Stop()
		select {
		case <-ctx.Done():
			return fmt.Errorf("boot sim vm %s: %w", m.ID, ctx.Err())
		case <-t.C:
		}
	}
	st := agentapi.StateRunning
	if opts.Paused {
		st = agentapi.StatePaused
	}
	d.mu.Lock()
	d.state[m.ID] = st
	d.booted[m.ID] = time.Now().UTC()
	d.plugged[m.ID] = map[string]bool{}
	for _, v := range m.Volumes {
		d.plugged[m.ID][v.ID] = true
	}
	d.mu.Unlock()
	return nil
}

func (d *Driver) forget(id string) {
	d.mu.Lock()
	delete(d.state, id)
	delete(d.plugged, id)
	delete(d.incoming, id)
	delete(d.outgoing, id)
	d.mu.Unlock()
}

// Shutdown marks the VM stopped.
func (d *Driver) Shutdown(_ context.Context, m *agent.Machine, _ time.Duration) error {
	d.forget(m.ID)
	return nil
}

// Kill marks the VM stopped.
func (d *Driver) Kill(_ context.Context, m *agent.Machine) error {
	d.forget(m.ID)
	return nil
}

func (d *Driver) setIf(id, from, to string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if cur := d.state[id]; cur != from && cur != to {
		return fmt.Errorf("sim vm %s is not %s", id, from)
	}
	d.state[id] = to
	return nil
}

// Pause marks a running VM paused.
func (d *Driver) Pause(_ context.Context, m *agent.Machine) error {
	return d.setIf(m.ID, agentapi.StateRunning, agentapi.StatePaused)
}

// Resume marks a paused VM running.
func (d *Driver) Resume(_ context.Context, m *agent.Machine) error {
	return d.setIf(m.ID, agentapi.StatePaused, agentapi.StateRunning)
}

// Observe reports the simulated state. A VM this driver has not seen is
// one a previous agent ran: simulated VMs outlive an agent restart like
// real ones, so it is adopted in its last recorded state.
func (d *Driver) Observe(_ context.Context, m *agent.Machine, last string) agent.Observed {
	d.mu.Lock()
	defer d.mu.Unlock()
	if st, ok := d.state[m.ID]; ok {
		return agent.Observed{State: st}
	}
	switch last {
	case agentapi.StateRunning, agentapi.StatePaused:
		d.state[m.ID] = last
		d.booted[m.ID] = time.Now().UTC() // booted under an earlier agent; when is not known
		return agent.Observed{State: last}
	case agentapi.StateCreating:
		return agent.Observed{State: agentapi.StateStopped, Reason: "the agent stopped while it was creating this vm"}
	}
	return agent.Observed{State: last}
}

// Console says that there is no guest, and what its NICs would be.
func (d *Driver) Console(m *agent.Machine, limit int64) ([]byte, error) {
	b := []byte("sim: vm " + m.ID + " is simulated; there is no guest and no serial console\n")
	for _, n := range m.NICs {
		b = fmt.Appendf(b, "sim: nic %s on network %s (%s), address %q: simulated, nothing answers there\n",
			n.MACAddress, n.Network, n.Mode, n.IPv4Address)
		for _, f := range n.PortForwards {
			b = fmt.Appendf(b, "sim: port forward %s:%d -> guest port %d is simulated: no socket listens\n",
				f.HostAddress, f.HostPort, f.GuestPort)
		}
	}
	b = append(b, d.simulatedSeed(m)...)
	return b[max(0, int64(len(b))-limit):], nil
}

// simulatedSeed is what the busybox guest would print about its seed, read
// by the sim from the VM's real seed ISO, while the VM is up: lines the
// agent's guest status reads (hostname, user-data digest, a cloud-init
// final line), each saying that it is simulated. Nothing without a seed.
func (d *Driver) simulatedSeed(m *agent.Machine) []byte {
	if m.Seed == "" {
		return nil
	}
	d.mu.Lock()
	st, up := d.state[m.ID]
	booted := d.booted[m.ID]
	d.mu.Unlock()
	if !up {
		return nil
	}
	if booted.IsZero() {
		return fmt.Appendf(nil, "sim: vm %s was restored from a snapshot: its simulated guest reads its seed at its next boot\n", m.ID)
	}
	path := filepath.Join(m.Dir, m.Seed)
	files, _, err := seed.Read(path)
	if err != nil {
		return fmt.Appendf(nil, "sim: the seed of vm %s cannot be read: %v\n", m.ID, err)
	}
	var meta struct {
		Hostname string `json:"local-hostname"`
	}
	_ = json.Unmarshal(files[seed.FileMetaData], &meta)
	sum := sha256.Sum256(files[seed.FileUserData])
	b := fmt.Appendf(nil, "sim: simulated guest (%s): the lines below are what the sim driver read from %s, not a guest's output\n", st, path)
	if meta.Hostname != "" {
		b = fmt.Appendf(b, "kvm-guest-hostname %s\n", meta.Hostname)
	}
	b = fmt.Appendf(b, "kvm-guest-userdata-sha256 %s\n", hex.EncodeToString(sum[:]))
	b = fmt.Appendf(b, "Cloud-init v. sim finished at %s. Datasource NoCloud (simulated: no guest ran it).\n", booted.Format(time.RFC1123Z))
	return b
}

var _ agent.DiskResizer = (*Driver)(nil)

// ResizeDisk accepts any growth: a simulated VM has no disk file.
func (d *Driver) ResizeDisk(context.Context, *agent.Machine, bool, int64) error { return nil }

var _ agent.GuestAgentDriver = (*Driver)(nil)

// userNetGuestAddress is a guest's address on a user-mode network.
const userNetGuestAddress = "10.0.2.15"

// GuestAddresses is a simulated guest agent: a running VM with the channel
// reports each NIC's address as the control plane assigned it (by the MAC
// its guest sees), as a guest configured by DHCP or by its seed would, and
// 10.0.2.15 on a user-mode NIC (what passt gives a real guest). A
// paused or stopped one does not answer, like a real guest agent.
func (d *Driver) GuestAddresses(_ context.Context, m *agent.Machine) (map[string][]string, error) {
	d.mu.Lock()
	st := d.state[m.ID]
	d.mu.Unlock()
	if !m.GuestAgent || st != agentapi.StateRunning {
		return nil, fmt.Errorf("vm %s: the simulated guest agent does not answer (guest_agent %v, state %q)", m.ID, m.GuestAgent, st)
	}
	nics := m.GuestNICs
	if len(nics) == 0 {
		nics = m.NICs
	}
	out := map[string][]string{}
	for _, n := range nics {
		addr := n.IPv4Address
		if n.Mode == agentapi.NetworkUser {
			addr = userNetGuestAddress
		}
		if addr != "" {
			mac := strings.ToLower(n.MACAddress)
			out[mac] = append(out[mac], addr)
		}
	}
	return out, nil
}
