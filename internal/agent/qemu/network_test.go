package qemu_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/network"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/qemu"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv/netnstest"
)

// netAgent is an agent whose driver the test keeps, to list its leases and
// to restart it as a new process would.
type netAgent struct {
	dir    string
	driver *qemu.Driver
	ag     *agent.Agent
	srv    *httptest.Server
	client *agentapi.Client
}

func startNetAgent(t *testing.T, dir string, tune ...func(*agent.Config)) *netAgent {
	t.Helper()
	ctx := context.Background()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	if os.Getenv("KVM_TEST_LOG") != "" {
		log = slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	d, err := qemu.New(ctx, qemu.Options{ImageDir: testenv.GuestImageDir(t), Accel: testenv.Accel(), Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	cfg := agent.Config{StateDir: dir, Driver: d, Token: "agent-token", Logger: log}
	for _, f := range tune {
		f(&cfg)
	}
	a, err := agent.New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	n := &netAgent{dir: dir, driver: d, ag: a, srv: httptest.NewServer(a.Handler())}
	n.client = agentapi.NewClient(n.srv.URL, "agent-token")
	t.Cleanup(func() {
		n.stop()
		for _, pid := range qemu.ProcessesUnder(dir) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		// Named namespaces outlive the test's own: remove those of its
		// children should the test have failed before deleting them.
		vms, _ := filepath.Glob(filepath.Join(dir, "vms", "*"))
		for _, vm := range vms {
			if ns := network.NetNSName(vm); slices.Contains(agentNetNS(t, dir, filepath.Base(vm)), ns) {
				_ = netns.DeleteNamed(ns)
			}
		}
	})
	return n
}

// stop ends the agent as a process exit would: the VMs, taps, bridges and
// rules stay; the DHCP responders of this process end.
func (n *netAgent) stop() {
	n.srv.Close()
	_ = n.ag.Close()
	n.driver.Close()
}

func (n *netAgent) console(t *testing.T, id string) string {
	t.Helper()
	b, _ := os.ReadFile(filepath.Join(n.dir, "vms", id, "console.log"))
	return string(b)
}

// waitGuestIP waits for "kvm-guest-ip <address>" on vm's console and
// returns the address.
func (n *netAgent) waitGuestIP(t *testing.T, id string) string {
	t.Helper()
	// The line's end is part of the match: the console is read while the
	// guest writes, and "kvm-guest-ip 10." may be the end of the log.
	re := regexp.MustCompile(`(?m)^kvm-guest-ip (\S+)\r?\n`)
	deadline := time.Now().Add(bootWait)
	for time.Now().Before(deadline) {
		if m := re.FindStringSubmatch(n.console(t, id)); m != nil {
			return m[1]
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("vm %s printed no kvm-guest-ip within %s; console:\n%s", id, bootWait, n.console(t, id))
	return ""
}

// get fetches url (127.0.0.1, or an address in the test's own network
// namespace), retrying for up to wait, and returns the body of a 200.
func get(t *testing.T, url string, wait time.Duration) string {
	t.Helper()
	return getWith(t, &http.Client{Timeout: 10 * time.Second}, "", url, wait)
}

// getWith is get through c; who prefixes its failure ("" or "host h1: ").
func getWith(t *testing.T, c *http.Client, who, url string, wait time.Duration) string {
	t.Helper()
	deadline := time.Now().Add(wait)
	var last string
	for attempt := 0; ; attempt++ {
		resp, err := c.Get(url)
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return string(b)
			}
			last = fmt.Sprintf("status %d: %s", resp.StatusCode, b)
		} else {
			last = err.Error()
		}
		if time.Now().After(deadline) || attempt > 600 {
			t.Fatalf("%sGET %s: no 200 within %s: %s", who, url, wait, last)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// unreachable says whether url gets no answer within a short time.
func unreachable(url string) bool {
	c := &http.Client{Timeout: 3 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return true
	}
	_ = resp.Body.Close()
	return false
}

func TestUserModeForwardReachesGuest(t *testing.T) {
	t.Parallel()
	a := startNetAgent(t, t.TempDir())
	ctx := context.Background()
	spec := guest
	spec.NICs = []agentapi.NIC{{Network: "default", Mode: agentapi.NetworkUser, MACAddress: "52:54:00:10:00:01",
		PortForwards: []agentapi.PortForward{{GuestPort: 80}}}}
	// The user-mode network's DHCP (passt) names no host: the guest
	// configuration does.
	spec.Seed = &agentapi.SeedSpec{Hostname: "web"}
	vm, err := a.client.CreateVM(ctx, "web", spec)
	if err != nil {
		t.Fatal(err)
	}
	f := vm.NICs[0].PortForwards[0]
	if f.HostAddress != "127.0.0.1" || f.HostPort == 0 {
		t.Fatalf("forward = %+v; want a host port on 127.0.0.1", f)
	}
	if got, _ := a.client.GetVM(ctx, "web"); got.NICs[0].PortForwards[0] != f {
		t.Fatalf("GET reports forward %+v, create reported %+v", got.NICs[0].PortForwards[0], f)
	}
	if ip := a.waitGuestIP(t, "web"); ip != "10.0.2.15" {
		t.Fatalf("guest printed address %s; the user-mode network's DHCP gives 10.0.2.15", ip)
	}
	body := get(t, fmt.Sprintf("http://127.0.0.1:%d/", f.HostPort), bootWait)
	if !strings.Contains(body, "kvm-guest web") {
		t.Fatalf("body = %q; want the guest's page naming its hostname web", body)
	}

	// Stop and start: the same port again (it was kept for the vm).
	if _, err := a.client.Action(ctx, "web", agentapi.ActionStop); err != nil {
		t.Fatal(err)
	}
	again, err := a.client.Action(ctx, "web", agentapi.ActionStart)
	if err != nil || again.NICs[0].PortForwards[0].HostPort != f.HostPort {
		t.Fatalf("after stop and start: %+v, %v; want host port %d again", again.NICs, err, f.HostPort)
	}
	if err := a.client.DeleteVM(ctx, "web"); err != nil {
		t.Fatal(err)
	}
	if !unreachable(fmt.Sprintf("http://127.0.0.1:%d/", f.HostPort)) {
		t.Fatalf("port %d still answers after the delete", f.HostPort)
	}
}

const lanCIDR, lanGateway = "10.77.0.0/24", "10.77.0.1"

func lanNIC(mac, addr string) agentapi.NIC {
	return agentapi.NIC{Network: "lan", Mode: agentapi.NetworkNAT, MACAddress: mac, CIDR: lanCIDR,
		Gateway: lanGateway, DHCP: true, IPv4Address: addr}
}

// agentLinks lists the links the agent makes (bridges, taps, veths), by
// name, and their indexes.
func agentLinks(t *testing.T) map[string]int {
	t.Helper()
	links, err := netlink.LinkList()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int{}
	for _, l := range links {
		name := l.Attrs().Name
		for _, p := range []string{network.BridgePrefix, network.TapPrefix, network.VethPrefix} {
			if strings.HasPrefix(name, p) {
				out[name] = l.Attrs().Index
			}
		}
	}
	return out
}

// agentNetNS lists the named network namespaces of the VMs ids of the
// agent in dir. /run/netns is the machine's: other tests running at the
// same time (other packages) have children's namespaces there too.
func agentNetNS(t *testing.T, dir string, ids ...string) []string {
	t.Helper()
	entries, _ := os.ReadDir("/run/netns")
	var out []string
	for _, e := range entries {
		for _, id := range ids {
			if e.Name() == network.NetNSName(filepath.Join(dir, "vms", id)) {
				out = append(out, e.Name())
			}
		}
	}
	return out
}

func TestNATGuestsReachEachOtherAndSurviveAgentRestart(t *testing.T) {
	if !netnstest.InOwnNetNS(t) {
		return
	}
	dir := t.TempDir()
	a := startNetAgent(t, dir)
	ctx := context.Background()
	addrs := map[string]string{"a": "10.77.0.10", "b": "10.77.0.11"}
	macs := map[string]string{"a": "52:54:00:20:00:0a", "b": "52:54:00:20:00:0b"}
	for _, id := range []string{"a", "b"} {
		spec := guest
		spec.NICs = []agentapi.NIC{lanNIC(macs[id], addrs[id])}
		vm, err := a.client.CreateVM(ctx, id, spec)
		if err != nil {
			t.Fatalf("create %s: %v", id, err)
		}
		if vm.NICs[0].IPv4Address != addrs[id] {
			t.Fatalf("vm %s reports nics %+v", id, vm.NICs)
		}
	}
	for id, want := range addrs {
		if got := a.waitGuestIP(t, id); got != want {
			t.Fatalf("guest %s printed address %s; its spec says %s", id, got, want)
		}
	}
	startOutside(t)
	check := func(phase string) {
		t.Helper()
		for id, addr := range addrs {
			other := "a"
			if id == "a" {
				other = "b"
			}
			if body := get(t, "http://"+addr+"/", time.Minute); !strings.Contains(body, "kvm-guest "+id+" "+addr) {
				t.Fatalf("%s: %s answered %q; want guest %s", phase, addr, body, id)
			}
			// From inside guest id: the other guest, and the outside through NAT.
			if body := get(t, "http://"+addr+"/cgi-bin/get?"+addrs[other], time.Minute); !strings.Contains(body, "kvm-guest "+other+" "+addrs[other]) {
				t.Fatalf("%s: guest %s fetching from %s got %q", phase, id, addrs[other], body)
			}
			if body := get(t, "http://"+addr+"/cgi-bin/get?"+outsideAddr, time.Minute); !strings.Contains(body, "kvm-test-outside") {
				t.Fatalf("%s: guest %s fetching from the outside got %q", phase, id, body)
			}
		}
	}
	check("first boot")
	links := agentLinks(t)
	if len(links) != 3 {
		t.Fatalf("links = %v; want one bridge and two taps", links)
	}
	leases := a.driver.Network().Leases()
	if len(leases) != 2 || leases[0].MAC == leases[1].MAC {
		t.Fatalf("leases = %+v; want one per vm", leases)
	}
	rules, err := network.ListRules(-1)
	if err != nil || len(rules) != 1 || rules[0].Tag != "masquerade lan" {
		t.Fatalf("nat rules = %+v, %v; want the masquerade of lan", rules, err)
	}

	// A new agent: the same links (same indexes: nothing was torn down and
	// made again), the leases served again, the guests still reachable.
	a.stop()
	a = startNetAgent(t, dir)
	if after := agentLinks(t); !mapsEqual(after, links) {
		t.Fatalf("links after restart = %v; before %v", after, links)
	}
	if got := a.driver.Network().Leases(); !slices.Equal(got, leases) {
		t.Fatalf("leases after restart = %+v; before %+v", got, leases)
	}
	check("after agent restart")

	for _, id := range []string{"a", "b"} {
		if err := a.client.DeleteVM(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	rules, err = network.ListRules(-1)
	if l := agentLinks(t); len(l) != 0 || len(a.driver.Network().Leases()) != 0 || err != nil || len(rules) != 0 {
		t.Fatalf("after deleting every vm: links %v, leases %+v, rules %+v (%v); want none", l, a.driver.Network().Leases(), rules, err)
	}
}

func mapsEqual(a, b map[string]int) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

func TestForkOfNATGuestChildrenAnswerAtTheirOwnAddresses(t *testing.T) {
	if !netnstest.InOwnNetNS(t) {
		return
	}
	a := startNetAgent(t, t.TempDir())
	ctx := context.Background()
	src := guest
	src.NICs = []agentapi.NIC{lanNIC("52:54:00:30:00:01", "10.77.0.20")}
	if _, err := a.client.CreateVM(ctx, "src", src); err != nil {
		t.Fatal(err)
	}
	if ip := a.waitGuestIP(t, "src"); ip != "10.77.0.20" {
		t.Fatalf("source printed %s", ip)
	}
	get(t, "http://10.77.0.20/", time.Minute)
	if _, err := a.client.CreateSnapshot(ctx, "s", agentapi.SnapshotSpec{VMID: "src", PauseSource: true}); err != nil {
		t.Fatal(err)
	}
	addrs := map[string]string{"src": "10.77.0.20", "c0": "10.77.0.21", "c1": "10.77.0.22", "c2": "10.77.0.23"}
	ids := []string{"c0", "c1", "c2"}
	for i, id := range ids {
		child := guest
		child.Snapshot = &agentapi.SnapshotSource{ID: "s"}
		child.NICs = []agentapi.NIC{lanNIC(fmt.Sprintf("52:54:00:30:01:%02x", i), addrs[id])}
		vm, err := a.client.CreateVM(ctx, id, child)
		if err != nil {
			t.Fatalf("child %s: %v", id, err)
		}
		if vm.NICs[0].IPv4Address != addrs[id] {
			t.Fatalf("child %s reports %+v", id, vm.NICs)
		}
	}
	if _, err := a.client.Action(ctx, "src", agentapi.ActionResume); err != nil {
		t.Fatal(err)
	}
	// Each in turn with every other one paused: the answer at its address
	// can only be its own.
	all := append([]string{"src"}, ids...)
	for _, id := range all {
		for _, other := range all {
			action := agentapi.ActionPause
			if other == id {
				action = agentapi.ActionResume
			}
			if _, err := a.client.Action(ctx, other, action); err != nil {
				t.Fatalf("%s %s: %v", action, other, err)
			}
		}
		body := get(t, "http://"+addrs[id]+"/", time.Minute)
		// Children keep their source's view: its hostname and address.
		if !strings.Contains(body, "kvm-guest src 10.77.0.20") {
			t.Fatalf("%s at %s answered %q", id, addrs[id], body)
		}
		for _, other := range all {
			if other != id && !unreachable("http://"+addrs[other]+"/") {
				t.Fatalf("%s answers while paused (testing %s)", other, id)
			}
		}
	}
	for _, id := range all {
		if _, err := a.client.Action(ctx, id, agentapi.ActionResume); err != nil {
			t.Fatal(err)
		}
	}
	// A child reaches the outside (its traffic leaves with its own address).
	startOutside(t)
	if body := get(t, "http://"+addrs["c1"]+"/cgi-bin/get?"+outsideAddr, time.Minute); !strings.Contains(body, "kvm-test-outside") {
		t.Fatalf("child c1 fetching from the outside got %q", body)
	}
	if ns := agentNetNS(t, a.dir, "src", "c0", "c1", "c2"); len(ns) != 3 {
		t.Fatalf("network namespaces = %v; want one per child", ns)
	}
	// A new agent keeps the children's namespaces and serves their leases again.
	leases, links := a.driver.Network().Leases(), agentLinks(t)
	if len(leases) != 4 {
		t.Fatalf("leases = %+v; want the source's and one per child", leases)
	}
	a.stop()
	a = startNetAgent(t, a.dir)
	if got := a.driver.Network().Leases(); !slices.Equal(got, leases) || !mapsEqual(agentLinks(t), links) || len(agentNetNS(t, a.dir, "src", "c0", "c1", "c2")) != 3 {
		t.Fatalf("after restart: leases %+v (before %+v), links %v (before %v), namespaces %v",
			got, leases, agentLinks(t), links, agentNetNS(t, a.dir, "src", "c0", "c1", "c2"))
	}
	for _, id := range all {
		get(t, "http://"+addrs[id]+"/", time.Minute)
	}
	for _, id := range all {
		if err := a.client.DeleteVM(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	if l, ns := agentLinks(t), agentNetNS(t, a.dir, "src", "c0", "c1", "c2"); len(l) != 0 || len(ns) != 0 || len(a.driver.Network().Leases()) != 0 {
		t.Fatalf("after deleting every vm: links %v, namespaces %v, leases %+v; want none", l, ns, a.driver.Network().Leases())
	}
}

func TestForkOfUserModeGuestChildrenGetTheirOwnForwards(t *testing.T) {
	t.Parallel()
	a := startNetAgent(t, t.TempDir())
	ctx := context.Background()
	nic := func(mac string) []agentapi.NIC {
		return []agentapi.NIC{{Network: "default", Mode: agentapi.NetworkUser, MACAddress: mac,
			PortForwards: []agentapi.PortForward{{GuestPort: 80}}}}
	}
	src := guest
	src.NICs = nic("52:54:00:40:00:01")
	src.Seed = &agentapi.SeedSpec{Hostname: "src"}
	vm, err := a.client.CreateVM(ctx, "src", src)
	if err != nil {
		t.Fatal(err)
	}
	a.waitGuestIP(t, "src")
	srcURL := fmt.Sprintf("http://127.0.0.1:%d/", vm.NICs[0].PortForwards[0].HostPort)
	get(t, srcURL, bootWait)
	if _, err := a.client.CreateSnapshot(ctx, "s", agentapi.SnapshotSpec{VMID: "src", PauseSource: true}); err != nil {
		t.Fatal(err)
	}
	urls := map[string]string{"src": srcURL}
	for i, id := range []string{"c0", "c1", "c2"} {
		child := guest
		child.Snapshot = &agentapi.SnapshotSource{ID: "s"}
		child.NICs = nic(fmt.Sprintf("52:54:00:40:01:%02x", i))
		c, err := a.client.CreateVM(ctx, id, child)
		if err != nil {
			t.Fatalf("child %s: %v", id, err)
		}
		u := fmt.Sprintf("http://127.0.0.1:%d/", c.NICs[0].PortForwards[0].HostPort)
		for other, ou := range urls {
			if ou == u {
				t.Fatalf("child %s got the forward of %s: %s", id, other, u)
			}
		}
		urls[id] = u
	}
	// Source still paused: only the children can answer at their ports.
	for id, u := range urls {
		if id == "src" {
			continue
		}
		if body := get(t, u, time.Minute); !strings.Contains(body, "kvm-guest src") {
			t.Fatalf("child %s at %s answered %q", id, u, body)
		}
	}
	if !unreachable(srcURL) {
		t.Fatal("the paused source answers")
	}
	if _, err := a.client.Action(ctx, "src", agentapi.ActionResume); err != nil {
		t.Fatal(err)
	}
	get(t, srcURL, time.Minute)
}

func TestBridgeNICOnAMissingBridgeIsInvalid(t *testing.T) {
	t.Parallel()
	a := startNetAgent(t, t.TempDir())
	spec := guest
	spec.NICs = []agentapi.NIC{{Network: "ops", Mode: agentapi.NetworkBridge, Bridge: "kvmnobr7", MACAddress: "52:54:00:60:00:01"}}
	_, err := a.client.CreateVM(context.Background(), "x", spec)
	host, _ := os.Hostname()
	var e *agentapi.Error
	if !errors.As(err, &e) || e.Status != http.StatusBadRequest || e.Code != "invalid" ||
		!strings.Contains(e.Message, "bridge kvmnobr7 does not exist on host "+host) {
		t.Fatalf("create on a missing bridge: %v; want 400 invalid naming the bridge and the host", err)
	}
	if vms, _ := a.client.ListVMs(context.Background()); len(vms) != 0 {
		t.Fatalf("a rejected create left vms %+v", vms)
	}
}

func TestBridgeModeGuestGetsItsLeaseOnTheOperatorsBridge(t *testing.T) {
	if !netnstest.InOwnNetNS(t) {
		return
	}
	// The operator's bridge, with an address of the network for the test.
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "opbr0"}}
	if err := netlink.LinkAdd(br); err != nil {
		t.Fatal(err)
	}
	addr, _ := netlink.ParseAddr("10.79.0.1/24")
	if err := netlink.AddrAdd(br, addr); err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkSetUp(br); err != nil {
		t.Fatal(err)
	}
	a := startNetAgent(t, t.TempDir())
	ctx := context.Background()
	spec := guest
	spec.NICs = []agentapi.NIC{{Network: "ops", Mode: agentapi.NetworkBridge, Bridge: "opbr0", MACAddress: "52:54:00:60:00:02",
		CIDR: "10.79.0.0/24", Gateway: "10.79.0.1", DHCP: true, IPv4Address: "10.79.0.10"}}
	if _, err := a.client.CreateVM(ctx, "b", spec); err != nil {
		t.Fatal(err)
	}
	if ip := a.waitGuestIP(t, "b"); ip != "10.79.0.10" {
		t.Fatalf("guest printed %s; its spec says 10.79.0.10", ip)
	}
	if body := get(t, "http://10.79.0.10/", time.Minute); !strings.Contains(body, "kvm-guest b 10.79.0.10") {
		t.Fatalf("guest answered %q", body)
	}
	if l := a.driver.Network().Leases(); len(l) != 1 || l[0].MAC != "52:54:00:60:00:02" {
		t.Fatalf("leases = %+v; want the guest's", l)
	}
	if err := a.client.DeleteVM(ctx, "b"); err != nil {
		t.Fatal(err)
	}
	links := agentLinks(t)
	if _, err := netlink.LinkByName("opbr0"); err != nil || len(links) != 0 || len(a.driver.Network().Leases()) != 0 {
		t.Fatalf("after delete: operator bridge %v, agent links %v, leases %+v; want the bridge kept, nothing else", err, links, a.driver.Network().Leases())
	}
}
