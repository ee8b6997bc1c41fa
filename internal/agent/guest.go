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
		sn := seed.NIC{MAC: n.MACAddress, MTU: n.MTU}
		if n.MTU == 0 && n.Mode == agentapi.NetworkOverlay {
			sn.MTU = agentapi.OverlayMTUDefault
		}
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

// cloudInitLog is the start of a message of cloud-init's console log
// handler (config/cloud.cfg.d/05_logging.cfg: WARNING and above, to stderr,
// "%(asctime)s - %(filename)s[%(levelname)s]: %(message)s"); the file is
// util.py for logexc up to 24.3 and log/log_util.py from 24.4. Requiring it
// keeps a user script's own output (which reaches the console with the same
// "cloud-init[pid]: " prefix) from counting.
const cloudInitLog = `\w+\.py\[(?:WARNING|ERROR|CRITICAL)\]: `

// cloudInitFailures are the console lines after which `cloud-init status`
// says error, read from cloud-init's source for the version Debian 12 ships
// (22.4.2) and for Ubuntu 24.04's (24.4.1; the wordings are unchanged through
// 25.3). A failed module does not stop cloud-init, which still prints its
// "finished" line, so these decide over it. Each is tested with a real line
// in TestParseGuestStatusCloudInitFailures, which names the source lines.
var cloudInitFailures = []*regexp.Regexp{
	// A config module raised (config/modules.py _run_modules, logexc):
	// every module, scripts_* included, and `cloud-init single`.
	regexp.MustCompile(cloudInitLog + `Running module \S+ \(.*\) failed\s*$`),
	regexp.MustCompile(cloudInitLog + `Ran \S+ but it failed!`),
	// cc_scripts_{user,vendor,per_boot,per_instance,per_once}: a script
	// exited non-zero; before 20.3 runparts logged each script itself.
	regexp.MustCompile(cloudInitLog + `Failed to run module \S+ \(`),
	regexp.MustCompile(cloudInitLog + `Failed running \S+ \[\d+\]`),
	// No datasource (cmd/main.py): the init stage logs it; a modules stage
	// logs and prints it (print_exc) before giving up.
	regexp.MustCompile(cloudInitLog + `No instance datasource found!`),
	regexp.MustCompile(`Can not apply stage \S+, no datasource found!`),
	regexp.MustCompile(cloudInitLog + `Failed to fetch your datasource`),
	regexp.MustCompile(cloudInitLog + `Consuming user data failed!`),
	// A stage raised (cmd/main.py status_wrapper): logexc up to 24.1,
	// LOG.exception after, and print_exc always.
	regexp.MustCompile(cloudInitLog + `failed stage \S+\s*$`),
	regexp.MustCompile(`(?:^|: )failed run of stage \S+\s*$`),
	// 24.3+ single process (socket.py): a stage raised; its unit echoes this.
	regexp.MustCompile(`fatal error, run "systemctl status cloud-init-main\.service"`),
	// A stage exits with its count of errors, so a failed stage unit is an
	// error (cmd/status.py systemd_failed says so from 24.1). systemd 249+
	// prints "unit - description", shortened in the middle to the console
	// width; older ones the description alone. Before journald runs,
	// systemd logs it through the kernel's log as well.
	regexp.MustCompile(`(?:FAILED\]|systemd\[1\]:) Failed to start (?:cloud-(?:init|config|final)|Initial cloud-init job|` +
		`Apply the settings specified in cloud-config|Execute cloud user/final scripts|Cloud-init: )`),
	// The seed the agent attached was not read: cloud-init fell back to no
	// datasource. cloud-init itself calls that done (22.4) or degraded done
	// (24.4); for a VM whose user data was never applied it is an error.
	regexp.MustCompile(`Cloud-init v\. \S+ finished at .*Datasource DataSourceNone`),
}

// cloudInitFailureWords are words of which every line of cloudInitFailures
// has one: a cheap test that spares most lines the regular expressions (a
// guest status reads up to 1 MiB of console, every second while a wait runs).
var cloudInitFailureWords = []string{"ailed", "datasource found", "fatal error", "DataSourceNone"}

// cloudInitNotFailures are lines that cloudInitFailures would take, but that
// are not cloud-init's stage units failing.
var cloudInitNotFailures = regexp.MustCompile(`cloud-init-hotplugd|cloud-init hotplug`)

// maxCloudInitErrors is how many failure lines a guest status carries, and
// maxCloudInitErrorLen how long each may be.
const (
	maxCloudInitErrors   = 5
	maxCloudInitErrorLen = 400
)

var (
	// A stage's line counts once it has ended (a line in the middle of its
	// write could end otherwise).
	cloudInitDone    = regexp.MustCompile(`Cloud-init v\. \S+ finished at [^\n]*\n`)
	cloudInitRunning = regexp.MustCompile(`Cloud-init v\. \S+ running`)
	// ansiEscape is a terminal control sequence (systemd colours its status
	// lines).
	ansiEscape = regexp.MustCompile(`\x1b\[[0-9;?]*[A-Za-z]`)
	// Lines are read while the guest writes them: a value counts only
	// once its line has ended ("kvm-guest-ip 10.77.0.1" may be the start
	// of 10.77.0.10).
	guestIPLine   = regexp.MustCompile(`(?m)^.*?kvm-guest-ip (\d+\.\d+\.\d+\.\d+)\r?\n`)
	ciInfoAddress = regexp.MustCompile(`(?m)ci-info: \|\s*[^|\s]+\s*\|\s*True\s*\|\s*(\d+\.\d+\.\d+\.\d+)\s*\|`)
	guestHostname = regexp.MustCompile(`(?m)kvm-guest-hostname (\S+)\r?\n`)
	// loginPrompt is getty's prompt on the serial console, "<hostname>
	// login: " (the hostname when getty printed it), maybe followed by the
	// name someone typed; "Last login: Thu Dec ..." has more words. The
	// prompt does not end its line: the hostname is whole once " login:"
	// follows it.
	loginPrompt = regexp.MustCompile(`(?m)^\r*([A-Za-z0-9][A-Za-z0-9.-]{0,252}) login: *\S*\r*$`)
	// sshHostKeyLine is a public host key cloud-init prints on the console
	// (cc_keys_to_console), whose comment ssh-keygen set to root@<hostname>
	// when cc_ssh made it, after cc_set_hostname; keys given in the user
	// data get root@localhost (cc_ssh KEY_GEN_TPL), which names no host.
	sshHostKeyLine = regexp.MustCompile(`(?m)^(?:ssh-(?:ed25519|rsa|dss)|ecdsa-sha2-nistp\d+) [A-Za-z0-9+/=]+ ` +
		`root@([A-Za-z0-9][A-Za-z0-9.-]{0,252})\r?\n`)
	guestUserData = regexp.MustCompile(`(?m)kvm-guest-userdata-sha256 ([0-9a-f]{64})`)
)

// cloudInitErrors returns the complete lines of console that say cloud-init
// failed (see cloudInitFailures), without terminal escapes, the first few.
func cloudInitErrors(console string) []string {
	var out []string
	for len(console) > 0 {
		line, rest, ended := strings.Cut(console, "\n")
		console = rest
		if !ended {
			break
		}
		if !slices.ContainsFunc(cloudInitFailureWords, func(w string) bool { return strings.Contains(line, w) }) {
			continue
		}
		if strings.Contains(line, "\x1b") {
			line = ansiEscape.ReplaceAllString(line, "")
		}
		line = strings.TrimSpace(line)
		if cloudInitNotFailures.MatchString(line) {
			continue
		}
		for _, re := range cloudInitFailures {
			if re.MatchString(line) {
				if len(line) > maxCloudInitErrorLen {
					line = line[:maxCloudInitErrorLen] + "..."
				}
				out = append(out, line)
				break
			}
		}
		if len(out) == maxCloudInitErrors {
			break
		}
	}
	return out
}

// parseGuestStatus reads a console log: only what follows the last boot
// marker (the current boot) counts.
func parseGuestStatus(console string) agentapi.GuestStatus {
	if i := strings.LastIndex(console, ConsoleBootMarker); i >= 0 {
		console = console[i:]
	}
	out := agentapi.GuestStatus{CloudInit: agentapi.CloudInitNone, IPv4Addresses: []string{}}
	out.CloudInitErrors = cloudInitErrors(console)
	switch {
	case len(out.CloudInitErrors) > 0:
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
	out.Hostname = guestHostnameOf(console)
	if m := guestUserData.FindAllStringSubmatch(console, -1); len(m) > 0 {
		out.UserDataSHA256 = m[len(m)-1][1]
	}
	return out
}

// guestHostnameOf is the hostname the guest reported last: getty's login
// prompt (what the guest calls itself now), else the busybox guest's
// kvm-guest-hostname line, else the comment of the SSH host keys that
// cloud-init printed; "" when none is there. "localhost" names no host and
// is passed over.
func guestHostnameOf(console string) string {
	for _, src := range []struct {
		word string
		re   *regexp.Regexp
	}{{" login:", loginPrompt}, {"kvm-guest-hostname ", guestHostname}, {" root@", sshHostKeyLine}} {
		// Only lines holding the word can match: look at those, from the
		// last back (a whole-console search costs tens of ms per MiB).
		rest := console
		for {
			i := strings.LastIndex(rest, src.word)
			if i < 0 {
				break
			}
			start := strings.LastIndexByte(rest[:i], '\n') + 1
			end := len(rest)
			if j := strings.IndexByte(rest[i:], '\n'); j >= 0 {
				end = i + j + 1
			}
			if m := src.re.FindStringSubmatch(rest[start:end]); m != nil {
				if h := strings.TrimSpace(m[1]); h != "localhost" {
					return h
				}
			}
			rest = rest[:i]
		}
	}
	return ""
}

// GuestAgentDriver is a driver that talks to the QEMU guest agent of a VM
// with Machine.GuestAgent.
type GuestAgentDriver interface {
	// GuestAddresses returns the IPv4 addresses the guest agent reports,
	// by lower-case MAC; an error when it does not answer (none runs in
	// the guest, or not yet) within a short bound.
	GuestAddresses(ctx context.Context, m *Machine) (map[string][]string, error)
}

// guestAgentAddresses asks the guest agent of VM r, when it has one and
// runs, for its addresses: by index of r's NICs, matched by the MAC its
// guest sees. false when r has no guest agent channel, does not run, or
// its guest agent did not answer.
func (a *Agent) guestAgentAddresses(ctx context.Context, r vmRecord) (map[int][]string, bool) {
	gd, ok := a.cfg.Driver.(GuestAgentDriver)
	if !ok || !r.GuestAgent || r.State != agentapi.StateRunning {
		return nil, false
	}
	byMAC, err := gd.GuestAddresses(ctx, machineOf(a, r))
	if err != nil {
		a.log.Debug("guest agent does not answer", "vm", r.ID, "err", err)
		return nil, false
	}
	out := map[int][]string{}
	for i, n := range guestView(r) {
		if addrs := byMAC[strings.ToLower(n.MACAddress)]; len(addrs) > 0 {
			out[i] = addrs
		}
	}
	return out, true
}

// Guest returns what VM id's guest reported on its serial console during
// its current boot: cloud-init's state (and the lines that made it an
// error), its IPv4 addresses, its hostname, and the user-data digest the
// busybox guest prints from its seed; for a VM with the guest agent
// channel, whether its guest agent answers, and the addresses it reports
// besides the console's.
func (a *Agent) Guest(ctx context.Context, id string) (agentapi.GuestStatus, error) {
	b, err := a.Console(ctx, id, guestConsoleBytes)
	if err != nil {
		return agentapi.GuestStatus{}, err
	}
	g := parseGuestStatus(string(b))
	g.GuestAgent = agentapi.GuestAgentNone
	e := a.lookup(id)
	if e == nil {
		return g, nil
	}
	r, corrupt, gone := e.state()
	if gone || corrupt != "" || !r.GuestAgent {
		return g, nil
	}
	g.GuestAgent = agentapi.GuestAgentWaiting
	byNIC, ok := a.guestAgentAddresses(ctx, r)
	if !ok {
		return g, nil
	}
	g.GuestAgent = agentapi.GuestAgentReady
	for i := range len(r.NICs) {
		for _, addr := range byNIC[i] {
			if !slices.Contains(g.IPv4Addresses, addr) {
				g.IPv4Addresses = append(g.IPv4Addresses, addr)
			}
		}
	}
	return g, nil
}
