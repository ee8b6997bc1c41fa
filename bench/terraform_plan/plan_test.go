// Package terraformplan measures `terraform plan` (with refresh) over many
// kvm_vm against as many terraform_data, with the real terraform CLI and a
// locally built provider (dev_overrides). It reports numbers; it never
// passes or fails on time.
package terraformplan

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// Environment of the measurement.
const (
	envRun   = "KVM_BENCH_TFPLAN"      // set to 1 to run
	envCount = "KVM_BENCH_TFPLAN_N"    // resources per configuration, default 1000
	envRuns  = "KVM_BENCH_TFPLAN_RUNS" // plans of each kind, alternating, default 1
)

func envInt(t *testing.T, name string, def int) int {
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 {
		t.Fatalf("%s=%q: want a positive integer", name, s)
	}
	return n
}

// TestTerraformPlanRefresh is the measurement; run it with
//
//	KVM_BENCH_TFPLAN=1 go test -run TestTerraformPlanRefresh -v -timeout 60m ./bench/terraform_plan/
func TestTerraformPlanRefresh(t *testing.T) {
	if os.Getenv(envRun) == "" {
		t.Skipf("a measurement, not a test: set %s=1 to run it", envRun)
	}
	n := envInt(t, envCount, 1000)
	runs := envInt(t, envRuns, 1)
	tf, err := exec.LookPath("terraform")
	if err != nil {
		t.Fatalf("the terraform CLI is not on PATH: %v", err)
	}

	work := t.TempDir()
	bin := filepath.Join(work, "bin")
	build := exec.Command("go", "build", "-o", filepath.Join(bin, "terraform-provider-kvm"), "./provider")
	build.Dir = repoRoot(t)
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building the provider: %v\n%s", err, out)
	}
	rc := filepath.Join(work, "terraformrc")
	writeFile(t, rc, fmt.Sprintf(`provider_installation {
  dev_overrides {
    "kvmfleet/kvm" = %q
  }
  direct {}
}
`, bin))

	// A control API on SQLite and sim agents roomy enough for n VMs.
	control := testenv.StartControl(t, testenv.ControlOptions{})
	const agents = 4
	for i := 0; i < agents; i++ {
		a := testenv.StartAgent(t, testenv.AgentOptions{
			VCPUs: int64(n/agents + 16), MemoryMiB: int64(n/agents+16) * 64, DiskMiB: int64(n/agents+16) * 64,
		})
		control.RegisterHost(t, fmt.Sprintf("bench-%d", i), a.Address)
	}
	proxy := newCountingProxy(t, control.URL)

	vmDir := filepath.Join(work, "kvm")
	writeFile(t, filepath.Join(vmDir, "main.tf"), fmt.Sprintf(`terraform {
  required_providers {
    kvm = { source = "kvmfleet/kvm" }
  }
}

provider "kvm" {
  endpoint = %q
  token    = %q
}

resource "kvm_vm" "vm" {
  count      = %d
  name       = "bench-${count.index}"
  image      = "sim"
  vcpus      = 1
  memory_mib = 64
  disk_mib   = 64
}
`, proxy.URL, control.Token, n))
	dataDir := filepath.Join(work, "data")
	writeFile(t, filepath.Join(dataDir, "main.tf"), fmt.Sprintf(`resource "terraform_data" "d" {
  count = %d
  input = count.index
}
`, n))

	env := append(os.Environ(), "TF_CLI_CONFIG_FILE="+rc, "TF_IN_AUTOMATION=1", "CHECKPOINT_DISABLE=1")
	// terraform runs one command and returns its wall time and CPU time
	// (user + system, including the provider processes it waited for).
	terraform := func(dir string, args ...string) (time.Duration, time.Duration) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, tf, args...)
		cmd.Dir, cmd.Env = dir, env
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		start := time.Now()
		err := cmd.Run()
		d := time.Since(start)
		if err != nil {
			t.Fatalf("terraform %s in %s: %v\n%s", strings.Join(args, " "), dir, err, tailOf(out.String(), 4000))
		}
		return d, cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()
	}

	vmApply, _ := terraform(vmDir, "apply", "-auto-approve", "-input=false", "-parallelism=20")
	dataApply, _ := terraform(dataDir, "apply", "-auto-approve", "-input=false")
	t.Logf("setup: apply of %d kvm_vm %v, of %d terraform_data %v", n, vmApply.Round(time.Millisecond), n, dataApply.Round(time.Millisecond))

	var wallRatios, cpuRatios []float64
	for r := 0; r < runs; r++ {
		proxy.reset()
		kvmWall, kvmCPU := terraform(vmDir, "plan", "-input=false", "-lock=false")
		reqs := proxy.snapshot()
		dataWall, dataCPU := terraform(dataDir, "plan", "-input=false", "-lock=false")
		wallRatios = append(wallRatios, kvmWall.Seconds()/dataWall.Seconds())
		cpuRatios = append(cpuRatios, kvmCPU.Seconds()/dataCPU.Seconds())
		t.Logf("run %d: terraform plan over %d kvm_vm: wall %v, CPU %v; over %d terraform_data: wall %v, CPU %v; "+
			"ratio wall %.2f, CPU %.2f; provider HTTP requests: %s",
			r+1, n, kvmWall.Round(time.Millisecond), kvmCPU.Round(time.Millisecond), n, dataWall.Round(time.Millisecond),
			dataCPU.Round(time.Millisecond), wallRatios[r], cpuRatios[r], reqs)
	}
	sort.Float64s(wallRatios)
	sort.Float64s(cpuRatios)
	t.Logf("kvm_vm/terraform_data over %d run(s): median wall ratio %.2f, median CPU ratio %.2f (goal <= 1.5)",
		runs, wallRatios[len(wallRatios)/2], cpuRatios[len(cpuRatios)/2])
}

// countingProxy forwards to the control API and counts requests by method
// and path pattern.
type countingProxy struct {
	URL string
	mu  sync.Mutex
	n   map[string]int
}

func newCountingProxy(t *testing.T, target string) *countingProxy {
	u, err := url.Parse(target)
	if err != nil {
		t.Fatalf("control URL %q: %v", target, err)
	}
	p := &countingProxy{n: map[string]int{}}
	rp := httputil.NewSingleHostReverseProxy(u)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.mu.Lock()
		p.n[r.Method+" "+pathPattern(r.URL.Path)]++
		p.mu.Unlock()
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	p.URL = srv.URL
	return p
}

func (p *countingProxy) reset() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.n = map[string]int{}
}

// snapshot renders the counts, e.g. "total 1 (GET /v1/vms: 1)".
func (p *countingProxy) snapshot() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	keys := make([]string, 0, len(p.n))
	total := 0
	for k, v := range p.n {
		keys = append(keys, k)
		total += v
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s: %d", k, p.n[k])
	}
	return fmt.Sprintf("total %d (%s)", total, strings.Join(parts, ", "))
}

func pathPattern(p string) string {
	parts := strings.Split(strings.Trim(p, "/"), "/")
	if len(parts) >= 3 && parts[0] == "v1" {
		parts[2] = "{id}"
	}
	return "/" + strings.Join(parts, "/")
}

func repoRoot(t *testing.T) string {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		t.Fatalf("go env GOMOD: %v", err)
	}
	return filepath.Dir(strings.TrimSpace(string(out)))
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

func tailOf(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[len(s)-n:]
}
