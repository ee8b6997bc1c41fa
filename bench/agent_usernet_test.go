package bench

// Guest-to-outside throughput on the user-mode network: a busybox guest
// fetches KVM_BENCH_USERNET_MB (default 200) MB through the network's NAT
// from a server on a documentation address (198.51.100.2) in a network
// namespace of its own, behind a veth of the namespace the agent runs in:
//
//	go test ./bench -run '^$' -bench 'AgentUserNetThroughput' -benchtime 3x -timeout 30m
//
// It runs itself again under unshare -n (root; skipped otherwise), so the
// transfer never leaves the namespaces it makes. Figures: MB/s as the
// guest timed it (its uptime before the connect and after the last byte)
// and as the server did (accept to the last write), p50 of the runs.

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

var dlLine = regexp.MustCompile(`(?m)^kvm-dl (\d+) ([0-9.]+) ([0-9.]+)\r?$`)

func BenchmarkAgentUserNetThroughput(b *testing.B) {
	defer machineState(b)()
	if os.Getenv("KVM_BENCH_NETNS") == "" {
		if os.Geteuid() != 0 {
			b.Skip("needs root: it makes network namespaces and a veth")
		}
		benchtime := "3x"
		if f := lookupFlag("test.benchtime"); f != "" {
			benchtime = f
		}
		cmd := exec.Command("unshare", "-n", "--", os.Args[0], "-test.run=^$", "-test.bench=^BenchmarkAgentUserNetThroughput$",
			"-test.benchtime="+benchtime, "-test.count=1", "-test.timeout=60m")
		cmd.Env = append(os.Environ(), "KVM_BENCH_NETNS=1")
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
		fmt.Println("BenchmarkAgentUserNetThroughput runs in its own network namespace (unshare -n):")
		if err := cmd.Run(); err != nil {
			b.Fatalf("user-mode throughput benchmark: %v", err)
		}
		b.SkipNow()
	}
	mb := 200
	if v, err := strconv.Atoi(os.Getenv("KVM_BENCH_USERNET_MB")); err == nil && v > 0 {
		mb = v
	}
	size := int64(mb) << 20
	lo, err := netlink.LinkByName("lo")
	if err == nil {
		err = netlink.LinkSetUp(lo)
	}
	if err != nil {
		b.Fatal(err)
	}
	served := benchInternet(b, size)

	a := startBenchAgent(b)
	ctx := context.Background()
	var guestRates, serverRates []float64
	for i := 0; i < b.N; i++ {
		id := fmt.Sprintf("dl-%d", i)
		spec := benchGuest
		spec.NICs = []agentapi.NIC{{Network: "default", Mode: agentapi.NetworkUser, MACAddress: fmt.Sprintf("52:54:00:51:00:%02x", i)}}
		// stdin held open by a FIFO opened read-write: nc ends at the
		// server's close, not at its own end of input (the passt of
		// Debian 12 never passes on a server's close after the guest's).
		spec.Seed = &agentapi.SeedSpec{Hostname: id, UserData: `#!/bin/sh
i=0
while [ $i -lt 180 ] && ! ip -4 addr show dev eth0 | grep -q 'inet '; do sleep 1; i=$((i + 1)); done
mkfifo /tmp/in
exec 3<>/tmp/in
s=$(cut -d' ' -f1 /proc/uptime)
n=$(nc 198.51.100.2 8080 <&3 | wc -c)
e=$(cut -d' ' -f1 /proc/uptime)
echo "kvm-dl $n $s $e"
`}
		if _, err := a.Client.CreateVM(ctx, id, spec); err != nil {
			b.Fatal(err)
		}
		console := filepath.Join(a.StateDir, "vms", id, "console.log")
		deadline := time.Now().Add(15 * time.Minute)
		var m []string
		for m == nil {
			data, _ := os.ReadFile(console)
			m = dlLine.FindStringSubmatch(string(data))
			if time.Now().After(deadline) {
				b.Fatalf("vm %s: no kvm-dl line within 15 minutes", id)
			}
			time.Sleep(100 * time.Millisecond)
		}
		n, _ := strconv.ParseInt(m[1], 10, 64)
		s, _ := strconv.ParseFloat(m[2], 64)
		e, _ := strconv.ParseFloat(m[3], 64)
		if n != size {
			b.Fatalf("vm %s received %d bytes; want %d", id, n, size)
		}
		guestRates = append(guestRates, float64(n)/(1<<20)/(e-s))
		select {
		case d := <-served:
			serverRates = append(serverRates, float64(size)/(1<<20)/d.Seconds())
		case <-time.After(time.Minute):
			b.Fatalf("vm %s: the server did not report its transfer", id)
		}
		b.StopTimer()
		if err := a.Client.DeleteVM(ctx, id); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
	b.ReportMetric(medianOf(guestRates), "guest-MB/s")
	b.ReportMetric(medianOf(serverRates), "server-MB/s")
}

func medianOf(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

// benchInternet makes 198.51.100.2/24 in a namespace of its own behind a
// veth (198.51.100.1 on this side, the default route), serving size bytes
// to each TCP connection on port 8080 and then closing it; each transfer's
// duration comes on the channel.
func benchInternet(b *testing.B, size int64) <-chan time.Duration {
	name := fmt.Sprintf("kvmb-inet-%d", os.Getpid())
	var inet netns.NsHandle
	var ln net.Listener
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with the goroutine
		orig, err := netns.Get()
		if err == nil {
			inet, err = netns.NewNamed(name)
		}
		if err == nil {
			var l netlink.Link
			if l, err = netlink.LinkByName("lo"); err == nil {
				err = netlink.LinkSetUp(l)
			}
		}
		if err == nil {
			ln, err = net.Listen("tcp", "0.0.0.0:8080")
		}
		if err == nil {
			err = netns.Set(orig)
		}
		done <- err
	}()
	if err := <-done; err != nil {
		b.Fatalf("internet namespace: %v", err)
	}
	b.Cleanup(func() { _ = ln.Close(); _ = netns.DeleteNamed(name); _ = inet.Close() })
	if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "kvmb-up"}, PeerName: "kvmb-up-far"}); err != nil {
		b.Fatal(err)
	}
	// Deleted here, at once: the namespace's end takes its peer only later
	// (in the kernel's own time), and the benchmark's next round adds the
	// veth again.
	b.Cleanup(func() {
		if l, err := netlink.LinkByName("kvmb-up"); err == nil {
			_ = netlink.LinkDel(l)
		}
	})
	far, err := netlink.LinkByName("kvmb-up-far")
	if err == nil {
		err = netlink.LinkSetNsFd(far, int(inet))
	}
	if err != nil {
		b.Fatal(err)
	}
	h, err := netlink.NewHandleAt(inet)
	if err != nil {
		b.Fatal(err)
	}
	defer h.Close()
	far, err = h.LinkByName("kvmb-up-far")
	if err == nil {
		err = h.AddrAdd(far, &netlink.Addr{IPNet: &net.IPNet{IP: net.IPv4(198, 51, 100, 2), Mask: net.CIDRMask(24, 32)}})
	}
	if err == nil {
		err = h.LinkSetUp(far)
	}
	near, err2 := netlink.LinkByName("kvmb-up")
	if err == nil {
		err = err2
	}
	if err == nil {
		err = netlink.AddrAdd(near, &netlink.Addr{IPNet: &net.IPNet{IP: net.IPv4(198, 51, 100, 1), Mask: net.CIDRMask(24, 32)}})
	}
	if err == nil {
		err = netlink.LinkSetUp(near)
	}
	if err == nil {
		err = netlink.RouteAdd(&netlink.Route{LinkIndex: near.Attrs().Index, Gw: net.IPv4(198, 51, 100, 2)})
	}
	if err != nil {
		b.Fatalf("veth to the internet namespace: %v", err)
	}
	served := make(chan time.Duration, 16)
	go func() {
		buf := make([]byte, 1<<20)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer func() { _ = c.Close() }()
				t0 := time.Now()
				for left := size; left > 0; {
					n := min(left, int64(len(buf)))
					if _, err := c.Write(buf[:n]); err != nil {
						return
					}
					left -= n
				}
				served <- time.Since(t0)
			}()
		}
	}()
	return served
}
