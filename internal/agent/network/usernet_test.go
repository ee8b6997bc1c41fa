package network_test

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/network"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv/netnstest"
)

// dialEnv makes the test binary a one-shot dialer (TestMain-free: the
// helper test below does it), run as another uid.
const dialEnv = "KVM_TEST_USERNET_DIAL"

// TestUserNetDialHelper is not a test: run with dialEnv set, it dials that
// address once and prints "refused", "open" or "silent" (no answer within
// a second: the connection was let out).
func TestUserNetDialHelper(t *testing.T) {
	addr := os.Getenv(dialEnv)
	if addr == "" {
		t.Skip("a helper process of TestUserNetFenceRefusesHostAndPrivateRangesOfPasstsUID")
	}
	c, err := net.DialTimeout("tcp", addr, time.Second)
	switch {
	case err == nil:
		_ = c.Close()
		fmt.Println("dial-result open")
	case errors.Is(err, syscall.ECONNREFUSED):
		fmt.Println("dial-result refused")
	default:
		fmt.Println("dial-result silent")
	}
}

// dialer is a copy of the test binary that any uid may run (go test's
// own folder is the building user's only).
func dialer(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "kvm-usernet-dialer-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	b, err := os.ReadFile(os.Args[0])
	if err == nil {
		err = os.Chmod(dir, 0o755)
	}
	bin := dir + "/dialer.test"
	if err == nil {
		err = os.WriteFile(bin, b, 0o755)
	}
	if err != nil {
		t.Fatal(err)
	}
	return bin
}

// dialAs dials addr from a process of uid running bin and says what it got.
func dialAs(t *testing.T, bin string, uid uint32, addr string) string {
	t.Helper()
	cmd := exec.Command(bin, "-test.run=^TestUserNetDialHelper$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), dialEnv+"="+addr)
	if uid != 0 {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid}}
	}
	out, _ := cmd.CombinedOutput()
	for _, l := range strings.Split(string(out), "\n") {
		if r, ok := strings.CutPrefix(l, "dial-result "); ok {
			return strings.TrimSpace(r)
		}
	}
	t.Fatalf("dial %s as uid %d: no result:\n%s", addr, uid, out)
	return ""
}

// TestUserNetFenceRefusesHostAndPrivateRangesOfPasstsUID: the usernet
// chain refuses passt's uid, and only it, new connections to the host's
// own addresses (loopback and others), link-local and private ranges, and
// lets through public addresses and the ranges the operator allows.
func TestUserNetFenceRefusesHostAndPrivateRangesOfPasstsUID(t *testing.T) {
	if !netnstest.InOwnNetNS(t) {
		return
	}
	// A veth holds a host address and routes the rest to a peer without
	// one: a connection let out gets no answer ("silent"), a refused one
	// is refused at once.
	if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "kvmt-out"}, PeerName: "kvmt-out-peer"}); err != nil {
		t.Fatal(err)
	}
	dummy, err := netlink.LinkByName("kvmt-out")
	if err != nil {
		t.Fatal(err)
	}
	if peer, err := netlink.LinkByName("kvmt-out-peer"); err != nil || netlink.LinkSetUp(peer) != nil {
		t.Fatalf("veth peer: %v", err)
	}
	ip, n, _ := net.ParseCIDR("198.51.100.1/24")
	n.IP = ip
	if err := netlink.AddrAdd(dummy, &netlink.Addr{IPNet: n}); err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkSetUp(dummy); err != nil {
		t.Fatal(err)
	}
	if err := netlink.RouteAdd(&netlink.Route{LinkIndex: dummy.Attrs().Index, Gw: net.IPv4(198, 51, 100, 2)}); err != nil {
		t.Fatal(err)
	}
	port := acceptAndClose(t, "0.0.0.0:0").Port
	const uid = 64998
	if err := network.FenceUserNet(network.UserNetFence{UID: uid, Allow: []netip.Prefix{netip.MustParsePrefix("10.99.0.0/16")}}); err != nil {
		t.Fatal(err)
	}
	// Run twice: a second agent rewrites the chain, it does not add to it.
	if err := network.FenceUserNet(network.UserNetFence{UID: uid, Allow: []netip.Prefix{netip.MustParsePrefix("10.99.0.0/16")}}); err != nil {
		t.Fatal(err)
	}
	rules, err := network.UserNetRules()
	if err != nil {
		t.Fatal(err)
	}
	if want := 2 + len(network.UserNetBlocked); len(rules) != want {
		t.Fatalf("usernet chain has %d rules after two fences, want %d: %q", len(rules), want, rules)
	}

	bin := dialer(t)
	for _, c := range []struct {
		addr string
		uid  uint32
		want string
	}{
		{fmt.Sprintf("127.0.0.1:%d", port), 0, "open"}, // the agent's own uid is not fenced
		{fmt.Sprintf("127.0.0.1:%d", port), uid, "refused"},
		{fmt.Sprintf("198.51.100.1:%d", port), uid, "refused"}, // the host's own non-loopback address
		{"169.254.169.254:80", uid, "refused"},
		{"10.98.0.5:80", uid, "refused"},
		{"172.16.0.5:80", uid, "refused"},
		{"192.168.1.5:80", uid, "refused"},
		{"100.64.0.5:80", uid, "refused"},
		{"10.99.0.5:80", uid, "silent"},   // allowed by the operator
		{"203.0.113.5:80", uid, "silent"}, // public: let out through NAT
	} {
		if got := dialAs(t, bin, c.uid, c.addr); got != c.want {
			t.Errorf("uid %d dialing %s: %s, want %s", c.uid, c.addr, got, c.want)
		}
	}
}

// TestQEMUFenceRefusesEverySocketOfQEMUUIDs: a socket of a uid in the
// QEMU range reaches nothing, the host's loopback included; uids outside
// the range (passt's, the agent's) are not touched by it.
func TestQEMUFenceRefusesEverySocketOfQEMUUIDs(t *testing.T) {
	if !netnstest.InOwnNetNS(t) {
		return
	}
	addr := acceptAndClose(t, "127.0.0.1:0").String()
	const first, last = 64000, 64099
	bin := dialer(t)
	// Before the fence a QEMU uid reaches the loopback server: the check
	// below can say "open".
	if got := dialAs(t, bin, first+5, addr); got != "open" {
		t.Fatalf("uid %d dialing %s before the fence: %s, want open", first+5, addr, got)
	}
	for range 2 { // a second agent start rewrites the rule, it adds none
		if err := network.FenceQEMU(first, last); err != nil {
			t.Fatal(err)
		}
	}
	out, err := exec.Command("nft", "list", "table", "inet", "kvmd-qemu").CombinedOutput()
	if err == nil && strings.Count(string(out), "skuid") != 1 {
		t.Errorf("table inet kvmd-qemu has %d skuid rules after two fences, want 1:\n%s", strings.Count(string(out), "skuid"), out)
	}
	for _, c := range []struct {
		uid  uint32
		want string
	}{
		{first, "refused"},
		{first + 50, "refused"},
		{last, "refused"},
		{first - 1, "open"},
		{last + 1, "open"},
		{0, "open"},
	} {
		if got := dialAs(t, bin, c.uid, addr); got != c.want {
			t.Errorf("uid %d dialing %s: %s, want %s", c.uid, addr, got, c.want)
		}
	}
	if err := network.FenceQEMU(10, 9); err == nil {
		t.Error("FenceQEMU(10, 9): no error for an empty range")
	}
}

// acceptAndClose listens on addr until the test ends, accepting and
// closing every connection (a dial that gets through says "open").
func acceptAndClose(t *testing.T, addr string) *net.TCPAddr {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_ = c.Close()
		}
	}()
	return ln.Addr().(*net.TCPAddr)
}
