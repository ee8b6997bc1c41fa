package agent

// A VM's guest configuration: its NoCloud seed disk and what the guest
// reports about it on the serial console.

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/seed"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// SeedFileName is the seed ISO in a VM's directory (Machine.Seed).
const SeedFileName = "seed.iso"

// ConsoleBootMarker starts the line a driver writes to a VM's console log
// before each boot; the guest status reads only what follows the last one,
// so a restart never counts the previous boot's lines.
const ConsoleBootMarker = "kvm-agent: boot of vm "

// guestConsoleBytes is how much of the console the guest status reads.
const guestConsoleBytes = 1 << 20

// seedConfig is the seed of VM r for the seed package: the NICs as the
// guest sees them, each by DHCP, or by its static address where the
// control plane assigned one on a network with a CIDR (so a static address
// works without DHCP).
func seedConfig(r vmRecord) (seed.Config, error) {
	s := r.Seed
	c := seed.Config{InstanceID: s.InstanceID, Hostname: s.Hostname, MetaData: s.MetaData,
		UserData: []byte(s.UserData), SSHAuthorizedKeys: s.SSHAuthorizedKeys, NetworkConfig: []byte(s.NetworkConfig)}
	if c.InstanceID == "" {
		c.InstanceID = r.ID
	}
	for _, n := range guestView(r) {
		sn := seed.NIC{MAC: n.MACAddress}
		if n.Mode != agentapi.NetworkUser && !n.DHCP && n.IPv4Address != "" && n.CIDR != "" {
			p, err := netip.ParsePrefix(n.CIDR)
			if err != nil {
				return seed.Config{}, fmt.Errorf("nic %s: cidr %q: %w", n.MACAddress, n.CIDR, err)
			}
			sn.Address = fmt.Sprintf("%s/%d", n.IPv4Address, p.Bits())
			sn.Gateway = n.Gateway
		}
		c.NICs = append(c.NICs, sn)
	}
	return c, nil
}

// checkSeed refuses a seed spec the seed package could not build.
func checkSeed(id string, spec agentapi.VMSpec) error {
	if spec.Seed == nil {
		return nil
	}
	r := vmRecord{ID: id, Seed: spec.Seed, NICs: requestedNICs(spec.NICs)}
	c, err := seedConfig(r)
	if err == nil {
		_, err = c.Files()
	}
	if err != nil {
		return errInvalid("seed of vm %s: %v", id, err)
	}
	return nil
}

// ensureSeed builds VM r's seed ISO in its directory when r has a seed and
// the file is missing. It is kept otherwise (agent restarts, stop/start):
// built from the same record, it would hold the same files.
func (a *Agent) ensureSeed(r vmRecord) error {
	if r.Seed == nil {
		return nil
	}
	path := filepath.Join(a.vmDir(r.ID), SeedFileName)
	if _, err := os.Stat(path); err == nil {
		return nil
	} else if !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("seed of vm %s: %w", r.ID, err)
	}
	c, err := seedConfig(r)
	if err != nil {
		return fmt.Errorf("seed of vm %s: %w", r.ID, err)
	}
	if err := seed.Write(path, c); err != nil {
		return fmt.Errorf("build the seed of vm %s: %w", r.ID, err)
	}
	a.log.Info("built vm seed", "vm", r.ID, "path", path, "hostname", c.Hostname, "user_data_bytes", len(c.UserData))
	return nil
}

var (
	cloudInitDone    = regexp.MustCompile(`Cloud-init v\. \S+ finished at`)
	cloudInitRunning = regexp.MustCompile(`Cloud-init v\. \S+ running`)
	// cloudInitFailed are failures cloud-init prints on the console (best
	// effort): a module or script that failed, a datasource not found.
	cloudInitFailed = regexp.MustCompile(`cloud-init\[\d+\]: .*(Failed to run module|Failed running)|` +
		`Cloud-init v\. \S+ finished at .*Datasource DataSourceNone`)
	// Lines are read while the guest writes them: a value counts only
	// once its line has ended ("kvm-guest-ip 10.77.0.1" may be the start
	// of 10.77.0.10).
	guestIPLine   = regexp.MustCompile(`(?m)^.*?kvm-guest-ip (\d+\.\d+\.\d+\.\d+)\r?\n`)
	ciInfoAddress = regexp.MustCompile(`(?m)ci-info: \|\s*[^|\s]+\s*\|\s*True\s*\|\s*(\d+\.\d+\.\d+\.\d+)\s*\|`)
	guestHostname = regexp.MustCompile(`(?m)kvm-guest-hostname (\S+)\r?\n`)
	guestUserData = regexp.MustCompile(`(?m)kvm-guest-userdata-sha256 ([0-9a-f]{64})`)
)

// parseGuestStatus reads a console log: only what follows the last boot
// marker (the current boot) counts.
func parseGuestStatus(console string) agentapi.GuestStatus {
	if i := strings.LastIndex(console, ConsoleBootMarker); i >= 0 {
		console = console[i:]
	}
	out := agentapi.GuestStatus{CloudInit: agentapi.CloudInitNone, IPv4Addresses: []string{}}
	switch {
	case cloudInitFailed.MatchString(console):
		out.CloudInit = agentapi.CloudInitError
	case cloudInitDone.MatchString(console):
		out.CloudInit = agentapi.CloudInitDone
	case cloudInitRunning.MatchString(console):
		out.CloudInit = agentapi.CloudInitRunning
	}
	for _, re := range []*regexp.Regexp{guestIPLine, ciInfoAddress} {
		for _, m := range re.FindAllStringSubmatch(console, -1) {
			addr, err := netip.ParseAddr(m[1])
			if err != nil || !addr.Is4() || addr.IsLoopback() || addr.IsUnspecified() {
				continue
			}
			if !slices.Contains(out.IPv4Addresses, addr.String()) {
				out.IPv4Addresses = append(out.IPv4Addresses, addr.String())
			}
		}
	}
	if m := guestHostname.FindAllStringSubmatch(console, -1); len(m) > 0 {
		out.Hostname = strings.TrimSpace(m[len(m)-1][1])
	}
	if m := guestUserData.FindAllStringSubmatch(console, -1); len(m) > 0 {
		out.UserDataSHA256 = m[len(m)-1][1]
	}
	return out
}

// Guest returns what VM id's guest reported on its serial console during
// its current boot: cloud-init's state, its IPv4 addresses, and the
// hostname and user-data digest the busybox guest prints from its seed.
func (a *Agent) Guest(ctx context.Context, id string) (agentapi.GuestStatus, error) {
	b, err := a.Console(ctx, id, guestConsoleBytes)
	if err != nil {
		return agentapi.GuestStatus{}, err
	}
	return parseGuestStatus(string(b)), nil
}
