package bench

// Every bench prints the machine's state beside its figures: the same fork
// bench gave 279 ms p50 on one machine of this kind and 1,119-1,438 ms on
// another, and figures without the load they were taken under cannot be
// compared. Each Benchmark starts with
//
//	defer machineState(b)()
//
// which adds to its result line:
//   - load1: the 1-minute load average when the bench ends;
//   - cpu-some-%: /proc/pressure/cpu "some" avg10 when it ends (the share
//     of the last 10 s in which some runnable task waited for a CPU);
//   - steal-%: the CPU time the hypervisor took from this machine during
//     the bench (/proc/stat, from its start to its end);
//   - busy-%: the CPU time spent by anything but idle and iowait during the
//     bench, the bench's own work included.
//
// A file this machine lacks (no PSI in the kernel, say) leaves its metric
// out and says so once in the log.

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
)

func machineState(b *testing.B) func() {
	b.Helper()
	start, startErr := readCPUTimes()
	return func() {
		if l, err := loadAverage(); err == nil {
			b.ReportMetric(l, "load1")
		} else {
			b.Logf("machine state: %v", err)
		}
		if p, err := cpuPressure(); err == nil {
			b.ReportMetric(p, "cpu-some-%")
		} else {
			b.Logf("machine state: %v", err)
		}
		end, err := readCPUTimes()
		if startErr != nil || err != nil {
			b.Logf("machine state: /proc/stat: %v %v", startErr, err)
			return
		}
		steal, busy := end.since(start)
		b.ReportMetric(steal, "steal-%")
		b.ReportMetric(busy, "busy-%")
	}
}

func loadAverage() (float64, error) {
	s, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0, err
	}
	f := strings.Fields(string(s))
	if len(f) == 0 {
		return 0, fmt.Errorf("/proc/loadavg is empty")
	}
	return strconv.ParseFloat(f[0], 64)
}

// cpuPressure is avg10 of the "some" line of /proc/pressure/cpu, in %.
func cpuPressure() (float64, error) {
	s, err := os.ReadFile("/proc/pressure/cpu")
	if err != nil {
		return 0, err
	}
	for _, l := range strings.Split(string(s), "\n") {
		if !strings.HasPrefix(l, "some ") {
			continue
		}
		for _, kv := range strings.Fields(l)[1:] {
			if v, ok := strings.CutPrefix(kv, "avg10="); ok {
				return strconv.ParseFloat(v, 64)
			}
		}
	}
	return 0, fmt.Errorf("/proc/pressure/cpu has no some avg10: %q", s)
}

// cpuTimes is the aggregate "cpu" line of /proc/stat, in clock ticks.
type cpuTimes struct{ total, idle, steal uint64 }

func readCPUTimes() (cpuTimes, error) {
	s, err := os.ReadFile("/proc/stat")
	if err != nil {
		return cpuTimes{}, err
	}
	line, _, _ := strings.Cut(string(s), "\n")
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return cpuTimes{}, fmt.Errorf("/proc/stat starts with %q, want the cpu line", line)
	}
	var t cpuTimes
	for i, v := range f[1:] {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			return cpuTimes{}, fmt.Errorf("/proc/stat cpu field %d: %w", i+1, err)
		}
		// user nice system idle iowait irq softirq steal guest guest_nice:
		// guest time is counted in user already.
		switch i {
		case 3, 4:
			t.idle += n
		case 7:
			t.steal += n
		}
		if i < 8 {
			t.total += n
		}
	}
	return t, nil
}

// since is the steal and busy share of the CPU time from s to t, in %.
func (t cpuTimes) since(s cpuTimes) (steal, busy float64) {
	total := float64(t.total - s.total)
	if total <= 0 {
		return 0, 0
	}
	steal = 100 * float64(t.steal-s.steal) / total
	busy = 100 * float64((t.total-s.total)-(t.idle-s.idle)-(t.steal-s.steal)) / total
	return steal, busy
}
