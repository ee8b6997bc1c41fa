package qemu

// User-mode networking is passt (Debian package passt), one process per
// user-mode NIC, which QEMU joins by -netdev stream on its unix socket.
// QEMU's own slirp maps the gateway 10.0.2.2 to the host's 127.0.0.1: a
// guest would reach everything bound to the host's loopback (other
// guests' forwards, the agent, a database). passt leaves the gateway
// unmapped (--no-map-gw), and its sockets, of a uid of their own, are
// fenced by the agent's nftables chain (network.FenceUserNet).
//
// The agent, not QEMU, starts passt (QEMU is to run with seccomp's
// spawn=deny), in its own session so that it outlives an agent restart as
// QEMU does. The two are joined by a socket pair the agent makes and hands
// to each (passt --fd, QEMU addr.type=fd): no socket file that passt's uid
// would have to write in the VM's folder, and passt ends by itself when
// QEMU ends and closes its end. The agent kills any that is left when the
// VM is deleted or its boot fails.

import (
	"bufio"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/network"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

const (
	// DefaultUserNetUser is the system user passt runs as when the agent
	// is root (scripts/deps.sh makes it).
	DefaultUserNetUser = "kvmd-net"
	// The user-mode network every guest sees, as QEMU's slirp gave it:
	// guests (and forks of guests) started before keep their config.
	userNetGuest   = "10.0.2.15"
	userNetMask    = "24"
	userNetGateway = "10.0.2.2"
	userNetDNS     = "10.0.2.3"
	// userNetGatewayMAC is slirp's gateway MAC: a fork child's guest keeps
	// the source's ARP entry for its gateway.
	userNetGatewayMAC = "52:55:0a:00:02:02"
)

// userNet is the driver's user-mode networking: passt's binary, the uid it
// runs as, and whether the nftables fence is up.
type userNet struct {
	bin   string // "" when passt is missing
	runAs string // uid:gid for --runas; "" when the agent is not root
	uid   uint32
	fence network.UserNetFence
	log   *slog.Logger

	once     sync.Once
	fenceErr error
}

// newUserNet finds passt and the uid it runs as. A missing passt is not an
// error here: only a user-mode NIC needs it, and says so.
func newUserNet(opts Options, log *slog.Logger) *userNet {
	u := &userNet{log: log}
	bin := opts.Passt
	if bin == "" {
		bin = "passt"
	}
	if p, err := exec.LookPath(bin); err == nil {
		u.bin = p
	}
	u.fence.Allow = opts.UserNetAllow
	u.fence.DNS = resolvers("/etc/resolv.conf")
	if os.Geteuid() != 0 {
		return u
	}
	name := opts.UserNetUser
	if name == "" {
		name = DefaultUserNetUser
	}
	usr, err := user.Lookup(name)
	if err != nil {
		log.Warn("user-mode networking: passt runs as nobody, which other daemons may share; "+
			"create the system user "+name+" (scripts/deps.sh does)", "err", err)
		if usr, err = user.Lookup("nobody"); err != nil {
			usr = &user.User{Uid: "65534", Gid: "65534"}
		}
	}
	uid, err1 := strconv.ParseUint(usr.Uid, 10, 32)
	_, err2 := strconv.ParseUint(usr.Gid, 10, 32)
	if err1 != nil || err2 != nil {
		log.Warn("user-mode networking: user has no numeric uid and gid; passt runs as nobody", "user", name)
		uid, usr = 65534, &user.User{Uid: "65534", Gid: "65534"}
	}
	u.uid, u.fence.UID = uint32(uid), uint32(uid)
	u.runAs = usr.Uid + ":" + usr.Gid
	return u
}

// resolvers are the IPv4 nameservers of a resolv.conf.
func resolvers(path string) []netip.Addr {
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer func() { _ = f.Close() }()
	var out []netip.Addr
	s := bufio.NewScanner(f)
	for s.Scan() {
		fields := strings.Fields(s.Text())
		if len(fields) >= 2 && fields[0] == "nameserver" {
			if a, err := netip.ParseAddr(fields[1]); err == nil && a.Is4() {
				out = append(out, a)
			}
		}
	}
	return out
}

// ensureFence installs the nftables fence once, when the first user-mode
// NIC starts: as root it must hold (an error fails the NIC); without root
// it is skipped with one warning.
func (u *userNet) ensureFence() error {
	u.once.Do(func() {
		if u.runAs == "" {
			u.log.Warn("user-mode networking: the agent is not root, so passt runs as the agent's user and " +
				"the nftables fence is skipped: guests cannot reach the host's loopback through the gateway, " +
				"but a guest may still reach the host's own addresses and private ranges")
			return
		}
		u.fenceErr = network.FenceUserNet(u.fence)
		if u.fenceErr == nil {
			u.log.Info("user-mode networking fenced", "uid", u.uid, "allow", u.fence.Allow, "dns", u.fence.DNS)
		}
	})
	return u.fenceErr
}

// passtPaths are NIC i's passt files in the VM's directory dir: its log,
// and the agent's record of the process (pid and start time: what names it
// after an agent restart).
func passtPaths(dir string, i int) (logfile, record string) {
	n := "passt" + strconv.Itoa(i)
	return filepath.Join(dir, n+".log"), filepath.Join(dir, n+".proc")
}

// startPasst starts NIC i of the VM in dir, whose forwards have their host
// ports, and returns QEMU's end of the socket pair that joins them.
func (d *Driver) startPasst(vm, dir string, i int, forwards []agentapi.PortForward) (*os.File, error) {
	u := d.usernet
	if u.bin == "" {
		return nil, errors.New("user-mode networking needs passt, which is not installed on this host: " +
			"install the Debian package passt (apt-get install passt), or give the vm a nat or bridge network")
	}
	if err := u.ensureFence(); err != nil {
		return nil, fmt.Errorf("user-mode networking: %w", err)
	}
	logfile, record := passtPaths(dir, i)
	stopPasst(record)
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("socket pair for passt: %w", err)
	}
	qemuEnd, passtEnd := os.NewFile(uintptr(fds[0]), "qemu-net"), os.NewFile(uintptr(fds[1]), "passt-net")
	defer func() { _ = passtEnd.Close() }()
	args := []string{
		// --fd implies --one-off: passt ends once QEMU closes its end.
		"--foreground", "--quiet", "--ipv4-only", "--fd", "3",
		// No host interface lends the guest its config: the same network
		// whatever the host's (a namespace with only lo included).
		"--interface", "lo", "--mac-addr", userNetGatewayMAC,
		"--address", userNetGuest, "--netmask", userNetMask, "--gateway", userNetGateway,
		"--no-map-gw", "--dns-forward", userNetDNS,
		"--udp-ports", "none",
	}
	if len(forwards) == 0 {
		args = append(args, "--tcp-ports", "none")
	}
	for _, f := range forwards {
		args = append(args, "--tcp-ports", fmt.Sprintf("%s/%d:%d", f.HostAddress, f.HostPort, f.GuestPort))
	}
	if u.runAs != "" {
		args = append(args, "--runas", u.runAs)
	}
	logf, err := os.OpenFile(logfile, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o640)
	if err != nil {
		_ = qemuEnd.Close()
		return nil, fmt.Errorf("passt log: %w", err)
	}
	defer func() { _ = logf.Close() }()
	cmd := exec.Command(u.bin, args...)
	cmd.Dir = dir
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.ExtraFiles = []*os.File{passtEnd}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		_ = qemuEnd.Close()
		return nil, fmt.Errorf("start passt: %w", err)
	}
	// Reaped while the agent runs; a later agent leaves that to init.
	go func() { _ = cmd.Wait() }()
	pid := cmd.Process.Pid
	_, start, err := procStat(pid)
	if err == nil {
		err = os.WriteFile(record, fmt.Appendf(nil, "%d %d\n", pid, start), 0o640)
	}
	if err != nil {
		_ = cmd.Process.Kill()
		_ = qemuEnd.Close()
		return nil, fmt.Errorf("record passt's pid: %w", err)
	}
	d.log.Debug("passt started", "vm", vm, "nic", i, "pid", pid)
	return qemuEnd, nil
}

// checkPassts tells whether the passt of each user-mode NIC of the VM in
// dir still runs (once QEMU has started: a passt that could not set up,
// say its forward's port was taken, has ended by then), and why not.
func checkPassts(dir string, nics []agentapi.NIC) error {
	var errs []error
	for i, n := range nics {
		if n.Mode != agentapi.NetworkUser {
			continue
		}
		logfile, record := passtPaths(dir, i)
		if !passtAlive(record) {
			errs = append(errs, fmt.Errorf("passt of nic %d ended: %s", i, passtLog(logfile)))
		}
	}
	return errors.Join(errs...)
}

// passtLog is the end of a passt log, for an error.
func passtLog(path string) string {
	b, _ := os.ReadFile(path)
	s := strings.TrimSpace(string(b))
	if len(s) > 500 {
		s = s[len(s)-500:]
	}
	if s == "" {
		return "no output (see " + path + ")"
	}
	return s
}

// recordedPasst is the passt process a record names, when it still runs:
// the pid, started at the recorded time (a reused pid is another process).
func recordedPasst(record string) (int, bool) {
	b, err := os.ReadFile(record)
	if err != nil {
		return 0, false
	}
	var pid int
	var start uint64
	if _, err := fmt.Sscan(string(b), &pid, &start); err != nil || pid <= 0 {
		return 0, false
	}
	state, st, err := procStat(pid)
	return pid, err == nil && state != 'Z' && state != 'X' && st == start
}

// stopPasst kills the passt of record, if it still runs.
func stopPasst(record string) {
	pid, alive := recordedPasst(record)
	if !alive {
		return
	}
	_ = syscall.Kill(pid, syscall.SIGKILL)
	for range 200 {
		if _, alive := recordedPasst(record); !alive {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// stopPassts kills every passt of the VM directories dirs.
func stopPassts(dirs ...string) {
	for _, dir := range dirs {
		if dir == "" {
			continue
		}
		files, _ := filepath.Glob(filepath.Join(dir, "passt*.proc"))
		for _, f := range files {
			stopPasst(f)
		}
	}
}

// passtAlive says whether the passt of record runs.
func passtAlive(record string) bool {
	_, alive := recordedPasst(record)
	return alive
}
