package qemu_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"regexp"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/qemu"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv/netnstest"
)

// The test's "internet": a namespace of its own behind a veth, with a
// documentation address (not a private range) the guest must reach
// through NAT, and a private and a link-local address it must not.
const (
	uplinkAddr   = "198.51.100.1" // the agent namespace's own end
	internetAddr = "198.51.100.2" // the far end: the "internet"
	privateAddr  = "10.99.0.2"    // an operator's private range, behind the same end
	metadataAddr = "169.254.169.254"
)

// internet makes the far end of the uplink in a named namespace of its own
// (removed at cleanup), routes everything there, and serves HTTP on port
// 8080 of each of its addresses, answering body.
func internet(t *testing.T, body string) {
	t.Helper()
	name := fmt.Sprintf("kvmt-inet-%d", time.Now().UnixNano()%1e6)
	var inet netns.NsHandle
	done := make(chan error, 1)
	var ln net.Listener
	go func() {
		runtime.LockOSThread()
		// The thread stays in whatever namespace it ends in: never
		// unlocked, it ends with the goroutine.
		orig, err := netns.Get()
		if err != nil {
			done <- err
			return
		}
		if inet, err = netns.NewNamed(name); err != nil {
			done <- err
			return
		}
		for _, a := range []string{"lo"} {
			l, err := netlink.LinkByName(a)
			if err == nil {
				err = netlink.LinkSetUp(l)
			}
			if err != nil {
				done <- err
				return
			}
		}
		ln, err = net.Listen("tcp", "0.0.0.0:8080")
		if err != nil {
			done <- err
			return
		}
		done <- netns.Set(orig)
	}()
	if err := <-done; err != nil {
		t.Fatalf("make the test's internet namespace: %v", err)
	}
	t.Cleanup(func() { _ = netns.DeleteNamed(name); _ = inet.Close() })
	srv := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, body)
	})}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })

	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "kvmt-up"}, PeerName: "kvmt-up-far"}
	if err := netlink.LinkAdd(veth); err != nil {
		t.Fatal(err)
	}
	far, err := netlink.LinkByName("kvmt-up-far")
	if err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkSetNsFd(far, int(inet)); err != nil {
		t.Fatal(err)
	}
	h, err := netlink.NewHandleAt(inet)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if far, err = h.LinkByName("kvmt-up-far"); err != nil {
		t.Fatal(err)
	}
	for _, a := range []string{internetAddr + "/24", privateAddr + "/24", metadataAddr + "/32"} {
		if err := h.AddrAdd(far, &netlink.Addr{IPNet: mustCIDR(t, a)}); err != nil {
			t.Fatalf("address %s in the internet namespace: %v", a, err)
		}
	}
	if err := h.LinkSetUp(far); err != nil {
		t.Fatal(err)
	}
	near, err := netlink.LinkByName("kvmt-up")
	if err != nil {
		t.Fatal(err)
	}
	if err := netlink.AddrAdd(near, &netlink.Addr{IPNet: mustCIDR(t, uplinkAddr+"/24")}); err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkSetUp(near); err != nil {
		t.Fatal(err)
	}
	if err := netlink.RouteAdd(&netlink.Route{LinkIndex: near.Attrs().Index, Gw: net.ParseIP(internetAddr)}); err != nil {
		t.Fatalf("default route to the test's internet: %v", err)
	}
}

func mustCIDR(t *testing.T, s string) *net.IPNet {
	t.Helper()
	ip, n, err := net.ParseCIDR(s)
	if err != nil {
		t.Fatal(err)
	}
	n.IP = ip
	return n
}

// serveOn answers body on addr ("127.0.0.1:0", "0.0.0.0:0") and returns
// its port.
func serveOn(t *testing.T, addr, body string) int {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, body)
	})}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return ln.Addr().(*net.TCPAddr).Port
}

// probeScript is a guest's user data that waits for its lease, then tries
// each target once with busybox nc and prints "kvm-probe <name> answered
// <body>" or "kvm-probe <name> nothing", then "kvm-probe done".
func probeScript(targets [][2]string) string {
	var b strings.Builder
	b.WriteString(`#!/bin/sh
i=0
while [ $i -lt 180 ] && ! ip -4 addr show dev eth0 | grep -q 'inet '; do sleep 1; i=$((i + 1)); done
# (busybox-static's wget crashes in static glibc; nc does not.) The
# request's side stays open until the answer has come: the passt of Debian
# 12 never passes the server's close on to a guest that closed its side
# first, and nc would wait for it.
probe() {
	out=$( (printf 'GET / HTTP/1.0\r\n\r\n'; sleep 3) | nc -w 5 "${2%:*}" "${2##*:}" 2>/dev/null)
	case "$out" in
	HTTP/*) echo "kvm-probe $1 answered $(printf '%s\n' "$out" | tail -n 1)" ;;
	*) echo "kvm-probe $1 nothing" ;;
	esac
}
`)
	for _, t := range targets {
		fmt.Fprintf(&b, "probe %s %s\n", t[0], t[1])
	}
	b.WriteString("echo kvm-probe done\n")
	return b.String()
}

// TestUserModeGuestReachesTheOutsideButNotItsHost: a guest on the default
// user-mode network reaches an internet-like server through NAT and answers
// at its own forward, but gets nothing from the host: not at the user-mode
// gateway (which slirp maps to the host's 127.0.0.1), not at the host's own
// address, not in a private range nor at the link-local metadata address.
func TestUserModeGuestReachesTheOutsideButNotItsHost(t *testing.T) {
	if !netnstest.InOwnNetNS(t) {
		return
	}
	internet(t, "kvm-test-internet\n")
	loopbackPort := serveOn(t, "127.0.0.1:0", "kvm-test-host-loopback\n")
	anyPort := serveOn(t, "0.0.0.0:0", "kvm-test-host-any\n")

	a := startNetAgent(t, t.TempDir())
	ctx := context.Background()
	targets := [][2]string{
		{"internet", internetAddr + ":8080"},
		{"gateway-loopback", fmt.Sprintf("10.0.2.2:%d", loopbackPort)},
		{"gateway-any", fmt.Sprintf("10.0.2.2:%d", anyPort)},
		{"host-address", fmt.Sprintf("%s:%d", uplinkAddr, anyPort)},
		{"private", privateAddr + ":8080"},
		{"metadata", metadataAddr + ":8080"},
	}
	spec := guest
	spec.NICs = []agentapi.NIC{{Network: "default", Mode: agentapi.NetworkUser, MACAddress: "52:54:00:50:00:01",
		PortForwards: []agentapi.PortForward{{GuestPort: 80}}}}
	spec.Seed = &agentapi.SeedSpec{Hostname: "fenced", UserData: probeScript(targets)}
	vm, err := a.client.CreateVM(ctx, "fenced", spec)
	if err != nil {
		t.Fatal(err)
	}
	// Its own forward answers on the host's loopback.
	f := vm.NICs[0].PortForwards[0]
	if body := get(t, fmt.Sprintf("http://127.0.0.1:%d/", f.HostPort), bootWait); !strings.Contains(body, "kvm-guest fenced") {
		t.Fatalf("forward 127.0.0.1:%d answered %q; want the guest's page", f.HostPort, body)
	}

	deadline := time.Now().Add(bootWait)
	for !strings.Contains(a.console(t, "fenced"), "kvm-probe done") {
		if time.Now().After(deadline) {
			t.Fatalf("the guest's probes did not finish within %s; console:\n%s", bootWait, a.console(t, "fenced"))
		}
		time.Sleep(200 * time.Millisecond)
	}
	con := a.console(t, "fenced")
	results := map[string]string{}
	for _, m := range regexp.MustCompile(`(?m)^kvm-probe (\S+) (answered.*|nothing)\r?$`).FindAllStringSubmatch(con, -1) {
		results[m[1]] = m[2]
	}
	for _, tg := range targets {
		got, ok := results[tg[0]]
		switch {
		case !ok:
			t.Errorf("no result for probe %s (%s); console:\n%s", tg[0], tg[1], con)
		case tg[0] == "internet" && !strings.Contains(got, "kvm-test-internet"):
			t.Errorf("the guest did not reach the internet-like server %s through NAT: %s; console:\n%s", tg[1], got, con)
		case tg[0] != "internet" && got != "nothing":
			t.Errorf("the guest reached %s (%s): %s", tg[0], tg[1], got)
		}
	}
}

// TestUserModeNICWithoutPasstFailsNamingThePackage: no silent fallback to
// QEMU's slirp (which would hand the guest the host's loopback): a
// user-mode NIC on a host without passt fails, naming the package.
func TestUserModeNICWithoutPasstFailsNamingThePackage(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d, err := qemu.New(ctx, qemu.Options{ImageDir: testenv.GuestImageDir(t), Accel: testenv.Accel(), Passt: "kvm-test-no-such-passt",
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	a, err := agent.New(ctx, agent.Config{StateDir: dir, Driver: d, Token: "agent-token", Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(a.Handler())
	t.Cleanup(func() {
		srv.Close()
		_ = a.Close()
		d.Close()
		for _, pid := range qemu.ProcessesUnder(dir) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	})
	spec := guest
	spec.NICs = []agentapi.NIC{{Network: "default", Mode: agentapi.NetworkUser, MACAddress: "52:54:00:50:00:02"}}
	_, err = agentapi.NewClient(srv.URL, "agent-token").CreateVM(ctx, "nopasst", spec)
	if err == nil || !strings.Contains(err.Error(), "apt-get install passt") {
		t.Fatalf("create with a user-mode nic and no passt: %v; want an error naming the package passt", err)
	}
	if pids := qemu.ProcessesUnder(dir); len(pids) != 0 {
		t.Fatalf("qemu processes %v run for a vm whose nic failed", pids)
	}
}
