package bench

// What idle guests cost the host, and what the agent answers meanwhile
// (issue 31):
//
//	go test ./bench -run '^$' -bench 'IdleGuestsQEMU' -benchtime 1x -timeout 20m
//
// 20 busybox guests (128 MiB, 1 vCPU, cold boots) are started and left
// idle once each printed tick 2 (its init is done). Then, over 20 s:
//   - idle-cpu-%: the CPU time of all 20 QEMU processes (utime+stime of
//     /proc/<pid>/stat, every thread), in % of one core,
//   - idle-cpu-max-%: the busiest guest's share,
//   - get-p50/p95-ms: GET /v1/vms/{id} through the agent, 100 calls spread
//     over the window, while the guests idle,
//   - qemu-nice: the nice value the guests' QEMU processes run at.
//
// Then all 20 are deleted, 10 at a time (Terraform's default parallelism):
//   - destroy-ms: until the last DELETE answered,
//   - destroy-get-p50/p95-ms: GET /v1/vms/{id} of a guest that stays,
//     during the deletes,
//   - destroy-agent-cpu-%: the agent's CPU time meanwhile (this test
//     process: the agent runs in it), in % of one core.
//
// Numbers are reported, never asserted.

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

const (
	idleGuests = 20
	idleWindow = 20 * time.Second
	idleGets   = 100
)

var tick2Line = regexp.MustCompile(`(?m)^tick 2\r?$`)

// procCPU is the utime+stime of process pid, in clock ticks (USER_HZ, 100
// on Linux), and its nice value.
func procCPU(pid int) (ticks int64, nice int, err error) {
	p, err := readProcStat(pid)
	return p.ticks, p.nice, err
}

// procStat is what the benches read of /proc/<pid>/stat.
type procStat struct {
	ticks          int64 // utime+stime (fields 14, 15), clock ticks
	minflt, majflt int64 // page faults (fields 10, 12)
	nice           int   // field 19
}

func readProcStat(pid int) (procStat, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return procStat{}, err
	}
	s := string(b)
	// The fields after the command name, which may hold spaces: f[0] is
	// field 3 (the state).
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if len(f) < 17 {
		return procStat{}, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f))
	}
	num := func(i int) int64 { n, _ := strconv.ParseInt(f[i], 10, 64); return n }
	return procStat{ticks: num(11) + num(12), minflt: num(7), majflt: num(9), nice: int(num(16))}, nil
}

func BenchmarkIdleGuestsQEMU(b *testing.B) {
	defer machineState(b)()
	a := startBenchAgent(b)
	ctx := context.Background()
	spec := benchGuest
	spec.NoWarm = true
	for b.Loop() {
		pids := map[string]int{}
		for i := range idleGuests {
			id := fmt.Sprintf("idle-%d", i)
			vm, err := a.Client.CreateVM(ctx, id, spec)
			if err != nil {
				b.Fatal(err)
			}
			pids[id] = vm.PID
		}
		for id := range pids {
			waitLine(b, filepath.Join(a.StateDir, "vms", id, "console.log"), tick2Line)
		}
		time.Sleep(2 * time.Second)
		read := func() (map[string]int64, int) {
			out := map[string]int64{}
			nice := 0
			for id, pid := range pids {
				t, n, err := procCPU(pid)
				if err != nil {
					b.Fatalf("guest %s: %v", id, err)
				}
				out[id], nice = t, n
			}
			return out, nice
		}
		before, nice := read()
		t0 := time.Now()
		var gets []time.Duration
		for i := range idleGets {
			time.Sleep(idleWindow / idleGets)
			g0 := time.Now()
			if vm, err := a.Client.GetVM(ctx, fmt.Sprintf("idle-%d", i%idleGuests)); err != nil || vm.State != agentapi.StateRunning {
				b.Fatalf("GET vm: %+v, %v", vm, err)
			}
			gets = append(gets, time.Since(g0))
		}
		after, _ := read()
		window := time.Since(t0).Seconds()
		var total, busiest int64
		for id := range pids {
			d := after[id] - before[id]
			total += d
			busiest = max(busiest, d)
		}
		// Clock ticks are 1/100 s: ticks/s is % of one core.
		b.ReportMetric(float64(total)/window, "idle-cpu-%")
		b.ReportMetric(float64(busiest)/window, "idle-cpu-max-%")
		b.ReportMetric(pct(gets, 50), "get-p50-ms")
		b.ReportMetric(pct(gets, 95), "get-p95-ms")
		b.ReportMetric(float64(nice), "qemu-nice")

		// Destroy all but one, 10 at a time, while GETs of the one left run.
		stop := make(chan struct{})
		var during []time.Duration
		var wg sync.WaitGroup
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				case <-time.After(20 * time.Millisecond):
				}
				g0 := time.Now()
				if _, err := a.Client.GetVM(ctx, "idle-0"); err != nil {
					b.Errorf("GET vm during the deletes: %v", err)
					return
				}
				during = append(during, time.Since(g0))
			}
		})
		self0, _, _ := procCPU(os.Getpid())
		d0 := time.Now()
		sem := make(chan struct{}, 10)
		var dwg sync.WaitGroup
		for id := range pids {
			if id == "idle-0" {
				continue
			}
			sem <- struct{}{}
			dwg.Go(func() {
				defer func() { <-sem }()
				if err := a.Client.DeleteVM(ctx, id); err != nil {
					b.Errorf("delete %s: %v", id, err)
				}
			})
		}
		dwg.Wait()
		took := time.Since(d0)
		self1, _, _ := procCPU(os.Getpid())
		b.ReportMetric(float64(took.Milliseconds()), "destroy-ms")
		b.ReportMetric(float64(self1-self0)/took.Seconds(), "destroy-agent-cpu-%")
		close(stop)
		wg.Wait()
		if len(during) > 0 {
			b.ReportMetric(pct(during, 50), "destroy-get-p50-ms")
			b.ReportMetric(pct(during, 95), "destroy-get-p95-ms")
		}
		if err := a.Client.DeleteVM(ctx, "idle-0"); err != nil {
			b.Fatal(err)
		}
	}
}
