package qemu_test

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mdlayher/packet"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/network"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv/netnstest"
)

// outsideAddr is a server "on the internet" for guests: in a network
// namespace of its own behind a veth (TEST-NET-2, inside the test's own
// namespace), routed by the test's namespace as a nat network's traffic
// leaves a host.
const outsideAddr, outsideHostSide = "198.51.100.2", "198.51.100.1"

type outside struct {
	goNow atomic.Bool // /go answers kvm-test-go once set
}

func startOutside(t *testing.T) *outside {
	t.Helper()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = orig.Close() }()
	ns, err := netns.New() // the thread is in it now
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ns.Close() })
	if err := netns.Set(orig); err != nil {
		t.Fatal(err)
	}
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "tout0"}, PeerName: "tout1", PeerNamespace: netlink.NsFd(int(ns))}
	if err := netlink.LinkAdd(veth); err != nil {
		t.Fatal(err)
	}
	addr, _ := netlink.ParseAddr(outsideHostSide + "/24")
	if err := netlink.AddrAdd(veth, addr); err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkSetUp(veth); err != nil {
		t.Fatal(err)
	}
	nh, err := netlink.NewHandleAt(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer nh.Close()
	for _, name := range []string{"lo", "tout1"} {
		l, err := nh.LinkByName(name)
		if err != nil {
			t.Fatal(err)
		}
		if name == "tout1" {
			a, _ := netlink.ParseAddr(outsideAddr + "/24")
			if err := nh.AddrAdd(l, a); err != nil {
				t.Fatal(err)
			}
		}
		if err := nh.LinkSetUp(l); err != nil {
			t.Fatal(err)
		}
	}
	// The listening socket stays in the namespace it was made in.
	if err := netns.Set(ns); err != nil {
		t.Fatal(err)
	}
	ln, lerr := net.Listen("tcp", outsideAddr+":80")
	if err := netns.Set(orig); err != nil {
		t.Fatal(err)
	}
	if lerr != nil {
		t.Fatal(lerr)
	}
	o := &outside{}
	srv := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/go" {
			if !o.goNow.Load() {
				http.NotFound(w, r)
				return
			}
			_, _ = io.WriteString(w, "kvm-test-go\n")
			return
		}
		_, _ = io.WriteString(w, "kvm-test-outside\n")
	})}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return o
}

// hostPort stands in for the agent's port as the shipped agent.env has
// it: every address of the host (here the test's namespace).
const hostPort = "7443"

func startHostServer(t *testing.T) {
	t.Helper()
	ln, err := net.Listen("tcp", "0.0.0.0:"+hostPort)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, "kvm-test-host\n")
	})}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
}

// fetchFrom asks the guest at guestAddr to fetch http://target/ once and
// returns what it got (the cgi says "kvm-guest-fetch failed" on no answer).
func fetchFrom(t *testing.T, guestAddr, target string) string {
	t.Helper()
	c := &http.Client{Timeout: 30 * time.Second}
	resp, err := c.Get("http://" + guestAddr + "/cgi-bin/get?" + target)
	if err != nil {
		t.Fatalf("asking guest %s to fetch %s: %v", guestAddr, target, err)
	}
	defer func() { _ = resp.Body.Close() }()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

func natNIC(netName, cidr, gw, mac, addr string, allow ...string) agentapi.NIC {
	return agentapi.NIC{Network: netName, Mode: agentapi.NetworkNAT, MACAddress: mac, CIDR: cidr,
		Gateway: gw, DHCP: true, IPv4Address: addr, Allow: allow}
}

// A nat network's guest reaches its own network's guests and the outside
// through NAT; not another network's guests (unless that network is in
// its allow list), not the host on any of its addresses.
func TestNATGuestsAreFencedFromOtherNetworksAndTheHost(t *testing.T) {
	if !netnstest.InOwnNetNS(t) {
		return
	}
	startOutside(t)
	startHostServer(t)
	a := startNetAgent(t, t.TempDir())
	ctx := context.Background()
	guests := map[string]agentapi.NIC{
		"a": natNIC("lan", lanCIDR, lanGateway, "52:54:00:21:00:0a", "10.77.0.10"),
		"b": natNIC("lan", lanCIDR, lanGateway, "52:54:00:21:00:0b", "10.77.0.11"),
		// other's guests may open connections to lan's, not the reverse.
		"c": natNIC("other", "10.78.0.0/24", "10.78.0.1", "52:54:00:21:00:0c", "10.78.0.10", "lan"),
	}
	for _, id := range []string{"a", "b", "c"} {
		spec := guest
		spec.NICs = []agentapi.NIC{guests[id]}
		if _, err := a.client.CreateVM(ctx, id, spec); err != nil {
			t.Fatalf("create %s: %v", id, err)
		}
	}
	for id, nic := range guests {
		if got := a.waitGuestIP(t, id); got != nic.IPv4Address {
			t.Fatalf("guest %s printed address %s; its spec says %s", id, got, nic.IPv4Address)
		}
		get(t, "http://"+nic.IPv4Address+"/", time.Minute)
	}
	reaches := func(from, target, want string) {
		t.Helper()
		deadline := time.Now().Add(time.Minute)
		for {
			body := fetchFrom(t, guests[from].IPv4Address, target)
			if strings.Contains(body, want) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("guest %s fetching %s got %q; want %q", from, target, body, want)
			}
			time.Sleep(time.Second)
		}
	}
	blocked := func(from, target string) {
		t.Helper()
		if body := fetchFrom(t, guests[from].IPv4Address, target); !strings.Contains(body, "kvm-guest-fetch failed") {
			t.Errorf("guest %s reached %s: got %q; want no answer", from, target, body)
		}
	}
	// What a guest must keep reaching (so that what follows is a fence,
	// not a broken guest).
	reaches("a", "10.77.0.11", "kvm-guest b")
	reaches("a", outsideAddr, "kvm-test-outside")
	reaches("c", outsideAddr, "kvm-test-outside")
	reaches("c", "10.77.0.10", "kvm-guest a")

	blocked("a", "10.78.0.10")                   // another network's guest
	blocked("a", lanGateway+":"+hostPort)        // the host on its bridge address
	blocked("a", "10.78.0.1:"+hostPort)          // the host on another network's bridge
	blocked("a", outsideHostSide+":"+hostPort)   // the host on its uplink address
	blocked("c", "10.78.0.1:"+hostPort)          // the host, from the other network
	blocked("b", "10.78.0.10")                   // lan does not allow other
	for _, id := range []string{"a", "b", "c"} { // and guests still answer the host
		get(t, "http://"+guests[id].IPv4Address+"/", time.Minute)
	}
}

// frameLog records what crosses one interface, as seen by a packet socket
// on it (both directions).
type frameLog struct {
	mu     sync.Mutex
	frames [][]byte
}

func sniff(t *testing.T, ifName string) *frameLog {
	t.Helper()
	ifc, err := net.InterfaceByName(ifName)
	if err != nil {
		t.Fatal(err)
	}
	c, err := packet.Listen(ifc, packet.Raw, unix.ETH_P_ALL, nil)
	if err != nil {
		t.Fatal(err)
	}
	l := &frameLog{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 2048)
		for {
			n, _, err := c.ReadFrom(buf)
			if err != nil {
				return
			}
			l.mu.Lock()
			l.frames = append(l.frames, append([]byte(nil), buf[:n]...))
			l.mu.Unlock()
		}
	}()
	t.Cleanup(func() { _ = c.Close(); <-done })
	return l
}

// find returns the frames for which match says true.
func (l *frameLog) find(match func(f []byte) bool) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, f := range l.frames {
		if len(f) >= 14 && match(f) {
			n++
		}
	}
	return n
}

func srcMAC(f []byte) net.HardwareAddr { return net.HardwareAddr(f[6:12]) }

func etherType(f []byte) uint16 { return binary.BigEndian.Uint16(f[12:14]) }

// ipv4From: an IPv4 frame from mac with source address src.
func ipv4From(mac string, src string) func([]byte) bool {
	return func(f []byte) bool {
		return srcMAC(f).String() == mac && etherType(f) == unix.ETH_P_IP && len(f) >= 34 &&
			net.IP(f[26:30]).String() == src
	}
}

// arpClaiming: an ARP frame from mac whose sender address is ip.
func arpClaiming(mac, ip string) func([]byte) bool {
	return func(f []byte) bool {
		return srcMAC(f).String() == mac && etherType(f) == unix.ETH_P_ARP && len(f) >= 42 &&
			net.IP(f[28:32]).String() == ip
	}
}

// dhcpServerFrom: a UDP datagram from port 67 sent by mac.
func dhcpServerFrom(mac string) func([]byte) bool {
	return func(f []byte) bool {
		if srcMAC(f).String() != mac || etherType(f) != unix.ETH_P_IP || len(f) < 42 || f[23] != unix.IPPROTO_UDP {
			return false
		}
		ihl := int(f[14]&0x0f) * 4
		return len(f) >= 14+ihl+4 && binary.BigEndian.Uint16(f[14+ihl:]) == 67
	}
}

// The attacker's user data: once it has its lease it runs a rogue DHCP
// server; once the outside server says go, it claims the victim's address
// in ARP, sends from it, then takes the victim's MAC and sends from that.
const attackerScript = `#!/bin/sh
i=0
while [ $i -lt 180 ] && ! ip -4 addr show dev eth0 | grep -q 'inet 10.77.0.10/'; do sleep 1; i=$((i+1)); done
printf 'start 10.77.0.200\nend 10.77.0.210\ninterface eth0\nlease_file /tmp/leases\nopt router 10.77.0.10\nopt subnet 255.255.255.0\n' >/tmp/udhcpd.conf
touch /tmp/leases
udhcpd -f /tmp/udhcpd.conf >/dev/null 2>&1 &
echo kvm-test-rogue-ready
i=0
while [ $i -lt 120 ] && ! printf 'GET /go HTTP/1.0\r\n\r\n' | nc -w 3 198.51.100.2 80 2>/dev/null | grep -q kvm-test-go; do sleep 2; i=$((i+1)); done
ip addr add 10.77.0.11/32 dev eth0
arping -c 3 -I eth0 -s 10.77.0.11 10.77.0.1
ping -c 3 -W 1 -I 10.77.0.11 10.77.0.1
ping -c 3 -W 1 -I 10.77.0.11 198.51.100.2
ip addr del 10.77.0.11/32 dev eth0
ip link set eth0 down
ip link set eth0 address 52:54:00:22:00:0b
ip link set eth0 up
ping -c 3 -W 1 10.77.0.1
echo kvm-test-attack-done
`

// The victim's user data: DHCP discovers that a rogue server would answer.
const victimScript = `#!/bin/sh
i=0
while [ $i -lt 180 ] && ! ip -4 addr show dev eth0 | grep -q 'inet 10.77.0.11/'; do sleep 1; i=$((i+1)); done
printf '#!/bin/sh\n[ "$1" = bound ] && echo "kvm-test-dhcp-lease $serverid $ip" >/dev/console\nexit 0\n' >/tmp/show
chmod 755 /tmp/show
for n in 1 2 3 4 5; do udhcpc -n -q -t 3 -T 2 -i eth0 -s /tmp/show >/dev/null 2>&1; sleep 1; done
echo kvm-test-dhcp-done
`

func (n *netAgent) waitConsoleLine(t *testing.T, id, line string) {
	t.Helper()
	re := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(line) + `\r?$`)
	deadline := time.Now().Add(bootWait)
	for time.Now().Before(deadline) {
		if re.MatchString(n.console(t, id)) {
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Fatalf("vm %s did not print %q within %s; console:\n%s", id, line, bootWait, n.console(t, id))
}

// A guest cannot answer DHCP to its neighbours, claim a neighbour's
// address (ARP or IP) nor its MAC: none of it reaches the bridge or the
// neighbour's tap, and the port's drop counters show it was tried.
func TestNATGuestCannotSpoofOrServeDHCP(t *testing.T) {
	if !netnstest.InOwnNetNS(t) {
		return
	}
	out := startOutside(t)
	dir := t.TempDir()
	a := startNetAgent(t, dir)
	ctx := context.Background()
	const attackerMAC, victimMAC = "52:54:00:22:00:0a", "52:54:00:22:00:0b"
	spec := guest
	spec.NICs = []agentapi.NIC{lanNIC(attackerMAC, "10.77.0.10")}
	spec.Seed = &agentapi.SeedSpec{InstanceID: "x", Hostname: "x", UserData: attackerScript}
	if _, err := a.client.CreateVM(ctx, "x", spec); err != nil {
		t.Fatal(err)
	}
	a.waitConsoleLine(t, "x", "kvm-test-rogue-ready")
	br := network.BridgeName("lan")
	onBridge := sniff(t, br)

	victimTap := network.TapName(filepath.Join(dir, "vms", "v"), 0)
	// The victim's tap is made at create: sniff it as soon as it exists.
	var onVictim *frameLog
	created := make(chan error, 1)
	go func() {
		spec := guest
		spec.NICs = []agentapi.NIC{lanNIC(victimMAC, "10.77.0.11")}
		spec.Seed = &agentapi.SeedSpec{InstanceID: "v", Hostname: "v", UserData: victimScript}
		_, err := a.client.CreateVM(ctx, "v", spec)
		created <- err
	}()
	for i := 0; onVictim == nil && i < 600; i++ {
		if _, err := net.InterfaceByName(victimTap); err == nil {
			onVictim = sniff(t, victimTap)
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err := <-created; err != nil {
		t.Fatal(err)
	}
	if onVictim == nil {
		t.Fatalf("the victim's tap %s never appeared", victimTap)
	}
	a.waitConsoleLine(t, "v", "kvm-test-dhcp-done")
	// The host knows the victim's MAC for its address.
	get(t, "http://10.77.0.11/", time.Minute)
	out.goNow.Store(true)
	a.waitConsoleLine(t, "x", "kvm-test-attack-done")
	time.Sleep(2 * time.Second) // the last frames in flight

	if n := onVictim.find(dhcpServerFrom(attackerMAC)); n != 0 {
		t.Errorf("the victim's tap carried %d DHCP server frames of the attacker; want none. Victim console:\n%s", n, a.console(t, "v"))
	}
	if n := onBridge.find(arpClaiming(attackerMAC, "10.77.0.11")); n != 0 {
		t.Errorf("the bridge got %d ARP frames of the attacker claiming the victim's address; want none", n)
	}
	if n := onBridge.find(ipv4From(attackerMAC, "10.77.0.11")); n != 0 {
		t.Errorf("the bridge got %d IPv4 frames of the attacker from the victim's address; want none", n)
	}
	if n := onBridge.find(ipv4From(victimMAC, "10.77.0.10")) + onBridge.find(arpClaiming(victimMAC, "10.77.0.10")); n != 0 {
		t.Errorf("the bridge got %d frames of the attacker wearing the victim's MAC; want none", n)
	}
	if l, err := netlink.LinkByName(br); err == nil {
		neighs, _ := netlink.NeighList(l.Attrs().Index, netlink.FAMILY_V4)
		for _, nb := range neighs {
			if nb.IP.String() == "10.77.0.11" && len(nb.HardwareAddr) != 0 && nb.HardwareAddr.String() != victimMAC {
				t.Errorf("the host maps the victim's address to %s; want the victim's MAC %s", nb.HardwareAddr, victimMAC)
			}
		}
	}
	// Each attack was made, and dropped at the attacker's port.
	rules, err := network.ListFence(-1)
	if err != nil {
		t.Fatal(err)
	}
	attackerPort := "port-" + network.TapName(filepath.Join(dir, "vms", "x"), 0)
	for _, tag := range []string{"dhcp server", "spoofed arp address", "spoofed address", "spoofed mac"} {
		var got uint64
		found := false
		for _, r := range rules {
			if r.Family == "bridge" && r.Chain == attackerPort && r.Tag == tag {
				got, found = r.Packets, true
			}
		}
		if !found || got == 0 {
			t.Errorf("rule %q of %s: found %v, %d packets dropped; want the attack counted", tag, attackerPort, found, got)
		}
	}
	if t.Failed() {
		t.Logf("attacker console:\n%s", a.console(t, "x"))
	}
	// The victim's own DHCP kept working: its leases came from the agent.
	if !strings.Contains(a.console(t, "v"), "kvm-test-dhcp-lease 10.77.0.1 10.77.0.11") {
		t.Errorf("the victim got no lease from the agent; console:\n%s", a.console(t, "v"))
	}
	if strings.Contains(a.console(t, "v"), "kvm-test-dhcp-lease 10.77.0.10") {
		t.Errorf("the victim took a lease from the attacker; console:\n%s", a.console(t, "v"))
	}
}
