package control_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// BenchmarkDrainTenIdleVMs drains a host of ten idle VMs onto two others
// (sim agents: each simulated live migration takes the sim driver's
// default 100 ms of pre-copy), from the drain call until GET shows the
// host drained: the control plane's share of a drain, two migrations at a
// time. Run with -benchtime=1x; it reports s/drain.
func BenchmarkDrainTenIdleVMs(b *testing.B) {
	for range b.N {
		b.StopTimer()
		c := testenv.StartControl(b, testenv.ControlOptions{})
		for i := 1; i <= 3; i++ {
			a := testenv.StartAgent(b, testenv.AgentOptions{Driver: "sim", VCPUs: 16, MemoryMiB: 16384, DiskMiB: 102400})
			c.RegisterHost(b, fmt.Sprintf("h%d", i), a.Address)
		}
		ctx := b.Context()
		for i := range 10 {
			if _, err := c.Client.CreateVM(ctx, api.VMCreate{Name: fmt.Sprintf("idle-%d", i), Image: "sim", VCPUs: 1, MemoryMiB: 256,
				DiskMiB: 1024, Host: "h1"}, ""); err != nil {
				b.Fatal(err)
			}
		}
		b.StartTimer()
		if _, err := c.Client.DrainHost(ctx, "h1"); err != nil {
			b.Fatal(err)
		}
		for poll := 0; ; poll++ {
			if poll == 6000 {
				b.Fatal("h1 still draining after 6000 polls (about two minutes)")
			}
			time.Sleep(20 * time.Millisecond)
			h, err := c.Client.GetHost(ctx, "h1")
			if err != nil {
				b.Fatal(err)
			}
			if h.Drain.State != api.DrainDraining {
				if h.Drain.State != api.DrainDrained || h.Drain.Moved != 10 {
					b.Fatalf("drain ended %+v; want drained, 10 moved", h.Drain)
				}
				break
			}
		}
		b.StopTimer()
		c.Stop()
	}
	b.ReportMetric(b.Elapsed().Seconds()/float64(b.N), "s/drain")
}

// BenchmarkQEMUDrainTenIdleBusybox is BenchmarkDrainTenIdleVMs with real
// busybox guests (128 MiB, booted and idle) on qemu agents: the wall time
// of a drain of ten live migrations, two at a time. It reports s/drain.
func BenchmarkQEMUDrainTenIdleBusybox(b *testing.B) {
	for range b.N {
		b.StopTimer()
		c := testenv.StartControl(b, testenv.ControlOptions{})
		for i := 1; i <= 3; i++ {
			a := testenv.StartAgent(b, testenv.AgentOptions{Driver: "qemu", VCPUs: 12, MemoryMiB: 6144})
			c.RegisterHost(b, fmt.Sprintf("h%d", i), a.Address)
		}
		ctx := b.Context()
		var ids []string
		for i := range 10 {
			vm, err := c.Client.CreateVM(ctx, api.VMCreate{Name: fmt.Sprintf("idle-%d", i), Image: "busybox", VCPUs: 1, MemoryMiB: 128,
				DiskMiB: 64, Host: "h1"}, "")
			if err != nil {
				b.Fatal(err)
			}
			ids = append(ids, vm.ID)
		}
		for _, id := range ids {
			for poll := 0; ; poll++ {
				if poll == 600 {
					b.Fatalf("vm %s did not boot within about five minutes", id)
				}
				con, err := c.Client.VMConsole(ctx, id, 1<<16)
				if err == nil && strings.Contains(con, "kvm-guest-ready") {
					break
				}
				time.Sleep(500 * time.Millisecond)
			}
		}
		b.StartTimer()
		if _, err := c.Client.DrainHost(ctx, "h1"); err != nil {
			b.Fatal(err)
		}
		for poll := 0; ; poll++ {
			if poll == 3000 {
				b.Fatal("h1 still draining after 3000 polls (about ten minutes)")
			}
			time.Sleep(200 * time.Millisecond)
			h, err := c.Client.GetHost(ctx, "h1")
			if err != nil {
				b.Fatal(err)
			}
			if h.Drain.State != api.DrainDraining {
				if h.Drain.State != api.DrainDrained || h.Drain.Moved != 10 {
					b.Fatalf("drain ended %+v; want drained, 10 moved", h.Drain)
				}
				break
			}
		}
		b.StopTimer()
		c.Stop()
	}
	b.ReportMetric(b.Elapsed().Seconds()/float64(b.N), "s/drain")
}
