package bench

// Create-to-reachable of a busybox guest with one NIC, against
// create-to-ready (its kvm-guest-ready line), per network mode:
//
//	go test ./bench -run '^$' -bench 'AgentReachable' -benchtime 5x
//
// user: the guest's HTTP server through its forward on 127.0.0.1; nat: at
// its address, from inside a network namespace the benchmark makes (it runs
// itself again under unshare -n, as root; skipped otherwise). Reachable is
// the first 200 of GET / (polled every 20 ms). Numbers only, no pass/fail.

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

var ipLine = regexp.MustCompile(`(?m)^kvm-guest-ip \S+\r?$`)

func BenchmarkAgentReachable(b *testing.B) {
	defer machineState(b)()
	b.Run("user", func(b *testing.B) {
		measureReachable(b, func(i int) (agentapi.NIC, func(agentapi.VM) string) {
			nic := agentapi.NIC{Network: "default", Mode: agentapi.NetworkUser, MACAddress: fmt.Sprintf("52:54:00:50:00:%02x", i),
				PortForwards: []agentapi.PortForward{{GuestPort: 80}}}
			return nic, func(vm agentapi.VM) string {
				return fmt.Sprintf("http://127.0.0.1:%d/", vm.NICs[0].PortForwards[0].HostPort)
			}
		})
	})
	b.Run("nat", func(b *testing.B) {
		if os.Getenv("KVM_BENCH_NETNS") == "" {
			reexecInNetNS(b)
			return
		}
		lo, err := netlink.LinkByName("lo")
		if err == nil {
			err = netlink.LinkSetUp(lo)
		}
		if err != nil {
			b.Fatal(err)
		}
		measureReachable(b, func(i int) (agentapi.NIC, func(agentapi.VM) string) {
			addr := fmt.Sprintf("10.78.0.%d", 10+i)
			nic := agentapi.NIC{Network: "bench", Mode: agentapi.NetworkNAT, MACAddress: fmt.Sprintf("52:54:00:50:01:%02x", i),
				CIDR: "10.78.0.0/24", Gateway: "10.78.0.1", DHCP: true, IPv4Address: addr}
			return nic, func(agentapi.VM) string { return "http://" + addr + "/" }
		})
	})
}

// reexecInNetNS runs the nat sub-benchmark again in a process of its own
// in a new network namespace, and logs its output (with its figures).
func reexecInNetNS(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("nat needs root: it makes a network namespace with a bridge, taps and NAT rules")
	}
	benchtime := "5x"
	if f := lookupFlag("test.benchtime"); f != "" {
		benchtime = f
	}
	cmd := exec.Command("unshare", "-n", "--", os.Args[0], "-test.run=^$", "-test.bench=^BenchmarkAgentReachable$/^nat$",
		"-test.benchtime="+benchtime, "-test.count=1")
	cmd.Env = append(os.Environ(), "KVM_BENCH_NETNS=1")
	// The figures are the child's: its output goes straight to ours.
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	fmt.Println("BenchmarkAgentReachable/nat runs in its own network namespace (unshare -n):")
	if err := cmd.Run(); err != nil {
		b.Fatalf("nat benchmark: %v", err)
	}
	b.SkipNow()
}

func lookupFlag(name string) string {
	for _, a := range os.Args {
		if v, ok := strings.CutPrefix(a, "-"+name+"="); ok {
			return v
		}
	}
	return ""
}

func measureReachable(b *testing.B, nicOf func(i int) (agentapi.NIC, func(agentapi.VM) string)) {
	a := startBenchAgent(b)
	ctx := context.Background()
	client := &http.Client{Timeout: 2 * time.Second}
	var readies, ips, reachables []time.Duration
	for i := 0; i < b.N; i++ {
		id := fmt.Sprintf("net-%d", i)
		nic, urlOf := nicOf(i)
		spec := benchGuest
		spec.NICs = []agentapi.NIC{nic}
		t0 := time.Now()
		vm, err := a.Client.CreateVM(ctx, id, spec)
		if err != nil {
			b.Fatal(err)
		}
		url := urlOf(vm)
		reached := make(chan time.Time, 1)
		go func() {
			deadline := time.Now().Add(3 * time.Minute)
			for time.Now().Before(deadline) {
				if resp, err := client.Get(url); err == nil {
					_ = resp.Body.Close()
					if resp.StatusCode == http.StatusOK {
						reached <- time.Now()
						return
					}
				}
				time.Sleep(20 * time.Millisecond)
			}
			reached <- time.Time{}
		}()
		console := filepath.Join(a.StateDir, "vms", id, "console.log")
		tReady, _ := waitLine(b, console, readyLine)
		tIP, _ := waitLine(b, console, ipLine)
		tReach := <-reached
		if tReach.IsZero() {
			b.Fatalf("vm %s: %s never answered 200 within 3 minutes", id, url)
		}
		readies, ips, reachables = append(readies, tReady.Sub(t0)), append(ips, tIP.Sub(t0)), append(reachables, tReach.Sub(t0))
		b.StopTimer()
		if err := a.Client.DeleteVM(ctx, id); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
	b.ReportMetric(p50(readies), "ready-p50-ms")
	b.ReportMetric(p50(ips), "guest-ip-p50-ms")
	b.ReportMetric(p50(reachables), "reachable-p50-ms")
}
