package bench

// Agent measurements with real guests (TCG here, KVM where a host allows it):
//
//	go test ./bench -run '^$' -bench 'AgentColdBoot|AgentQMP' -benchtime 5x
//
// They report numbers and never pass or fail on time.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/qemu"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

var benchGuest = agentapi.VMSpec{Image: "busybox", VCPUs: 1, MemoryMiB: 128, DiskMiB: 64}

func startBenchAgent(b *testing.B) *testenv.Agent {
	a := testenv.StartAgent(b, testenv.AgentOptions{Driver: "qemu"})
	b.Cleanup(func() {
		dirs, _ := filepath.Glob(filepath.Join(a.StateDir, "vms", "*"))
		for _, dir := range dirs {
			for _, pid := range qemu.ProcessesOf(dir) {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
		}
	})
	return a
}

// waitLine polls the console file every millisecond until it holds a line
// matching re, and returns when it was seen and the match.
func waitLine(b *testing.B, path string, re *regexp.Regexp) (time.Time, []byte) {
	deadline := time.Now().Add(3 * time.Minute)
	for time.Now().Before(deadline) {
		data, _ := os.ReadFile(path)
		if m := re.Find(data); m != nil {
			return time.Now(), m
		}
		time.Sleep(time.Millisecond)
	}
	b.Fatalf("%s: no line matching %s within 3 minutes", path, re)
	return time.Time{}, nil
}

func p50(ds []time.Duration) float64 {
	s := slices.Clone(ds)
	slices.Sort(s)
	return float64(s[len(s)/2].Microseconds()) / 1000
}

var (
	initLine  = regexp.MustCompile(`kvm-guest-init uptime ([0-9.]+)`)
	readyLine = regexp.MustCompile(`(?m)^kvm-guest-ready\r?$`)
)

// BenchmarkAgentColdBoot: PUT /v1/vms/{id} of a new VM until the guest's
// ready line, split into
//   - start-ms: the PUT (qemu-img overlay, QEMU exec until it daemonizes
//     and QMP answers),
//   - kernel-ms: from there to the init's first line (firmware + kernel),
//   - init-ms: from the init's first line to kvm-guest-ready,
//
// and guest-uptime-at-init-ms, the guest kernel's own clock when init ran.
func BenchmarkAgentColdBoot(b *testing.B) {
	defer machineState(b)()
	a := startBenchAgent(b)
	info, err := a.Client.Info(context.Background())
	if err != nil {
		b.Fatal(err)
	}
	b.Logf("accel %s (%s)", info.Accel, info.AccelNote)
	ctx := context.Background()
	var starts, kernels, inits, totals []time.Duration
	var uptimes []time.Duration
	for i := 0; i < b.N; i++ {
		id := fmt.Sprintf("boot-%d", i)
		console := filepath.Join(a.StateDir, "vms", id, "console.log")
		t0 := time.Now()
		if _, err := a.Client.CreateVM(ctx, id, benchGuest); err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		t2, m := waitLine(b, console, initLine)
		t3, _ := waitLine(b, console, readyLine)
		starts, kernels, inits, totals = append(starts, t1.Sub(t0)), append(kernels, t2.Sub(t1)),
			append(inits, t3.Sub(t2)), append(totals, t3.Sub(t0))
		if up, err := strconv.ParseFloat(string(initLine.FindSubmatch(m)[1]), 64); err == nil {
			uptimes = append(uptimes, time.Duration(up*float64(time.Second)))
		}
		b.StopTimer()
		if err := a.Client.DeleteVM(ctx, id); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
	b.ReportMetric(p50(totals), "ready-p50-ms")
	b.ReportMetric(p50(starts), "start-p50-ms")
	b.ReportMetric(p50(kernels), "kernel-p50-ms")
	b.ReportMetric(p50(inits), "init-p50-ms")
	if len(uptimes) > 0 {
		b.ReportMetric(p50(uptimes), "guest-uptime-at-init-p50-ms")
	}
}

// BenchmarkAgentQMP measures the QMP round trip of query-status on a
// running guest: on an open QMP session (the command alone), a fresh session
// per call (what the agent does: connect, greeting, qmp_capabilities,
// command), and GET /v1/vms/{id} through the agent (HTTP + pid checks + a
// QMP session).
func BenchmarkAgentQMP(b *testing.B) {
	defer machineState(b)()
	a := startBenchAgent(b)
	ctx := context.Background()
	if _, err := a.Client.CreateVM(ctx, "qmp", benchGuest); err != nil {
		b.Fatal(err)
	}
	sock := filepath.Join(a.StateDir, "vms", "qmp", "qmp.sock")
	waitLine(b, filepath.Join(a.StateDir, "vms", "qmp", "console.log"), readyLine)

	b.Run("command", func(b *testing.B) {
		s := openQMP(b, sock)
		defer func() { _ = s.conn.Close() }()
		for b.Loop() {
			s.call(b, "query-status")
		}
	})
	b.Run("session", func(b *testing.B) {
		for b.Loop() {
			s := openQMP(b, sock)
			s.call(b, "query-status")
			_ = s.conn.Close()
		}
	})
	b.Run("agent-get-vm", func(b *testing.B) {
		for b.Loop() {
			if vm, err := a.Client.GetVM(ctx, "qmp"); err != nil || vm.State != agentapi.StateRunning {
				b.Fatalf("GET vm: %+v, %v", vm, err)
			}
		}
	})
}

// qmpSession is the smallest QMP client that measures the monitor itself.
type qmpSession struct {
	conn net.Conn
	r    *bufio.Reader
}

func openQMP(b *testing.B, sock string) *qmpSession {
	conn, err := net.DialTimeout("unix", sock, 5*time.Second)
	if err != nil {
		b.Fatalf("dial %s: %v (state dir path too long for a socket?)", sock, err)
	}
	_ = conn.SetDeadline(time.Now().Add(time.Minute))
	s := &qmpSession{conn: conn, r: bufio.NewReader(conn)}
	if _, err := s.r.ReadBytes('\n'); err != nil { // greeting
		b.Fatal(err)
	}
	s.call(b, "qmp_capabilities")
	return s
}

func (s *qmpSession) call(b *testing.B, cmd string) {
	if _, err := fmt.Fprintf(s.conn, `{"execute":%q}`, cmd); err != nil {
		b.Fatal(err)
	}
	for {
		line, err := s.r.ReadBytes('\n')
		if err != nil {
			b.Fatal(err)
		}
		if bytes.Contains(line, []byte(`"event"`)) {
			continue
		}
		var m map[string]json.RawMessage
		if err := json.Unmarshal(line, &m); err != nil || m["return"] == nil {
			b.Fatalf("qmp %s: %s", cmd, line)
		}
		return
	}
}
