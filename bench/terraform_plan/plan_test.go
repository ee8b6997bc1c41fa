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
	"github.com/kvmfleet/terraform-provider-kvm/internal/timing"
)

// Environment of the measurement.
const (
	envRun   = "KVM_BENCH_TFPLAN"       // set to 1 to run
	envCount = "KVM_BENCH_TFPLAN_N"     // resources per configuration, default 1000
	envRuns  = "KVM_BENCH_TFPLAN_RUNS"  // plans of each kind, alternating, default 1
	envFloor = "KVM_BENCH_TFPLAN_FLOOR" // set to 1 to also time the do-nothing floor providers
	// envBaseline names a terraform-provider-kvm binary (another build, e.g.
	// of main) to time beside this one, run by run, over the same VMs.
	envBaseline = "KVM_BENCH_TFPLAN_BASELINE"
	// envProfile names a folder for CPU profiles of the provider processes of
	// the timed plans: <folder>/<kind>-run<r>/<binary>.<pid>.pprof.
	envProfile = "KVM_BENCH_TFPLAN_PROFILE"
)

// The floor providers (./floorprovider): kvm_vm's schema, no work.
var floors = []string{"floorfw", "floorraw"}

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
	withFloor := os.Getenv(envFloor) != ""
	baseline := os.Getenv(envBaseline)
	profileDir := os.Getenv(envProfile)
	tf, work, bin := terraformAndProvider(t)
	overrides := map[string]string{"kvmfleet/kvm": bin}
	if baseline != "" {
		copyFile(t, baseline, filepath.Join(bin, "terraform-provider-kvmbase"))
		overrides["kvmfleet/kvmbase"] = bin
	}
	if withFloor {
		// One binary; its name chooses the mode.
		goBuild(t, filepath.Join(bin, "terraform-provider-"+floors[0]), "./bench/terraform_plan/floorprovider")
		for _, f := range floors[1:] {
			if err := os.Link(filepath.Join(bin, "terraform-provider-"+floors[0]), filepath.Join(bin, "terraform-provider-"+f)); err != nil {
				t.Fatal(err)
			}
		}
		for _, f := range floors {
			overrides["kvmfleet/"+f] = bin
		}
	}
	rc := filepath.Join(work, "terraformrc")
	writeFile(t, rc, testenv.DevOverridesConfig(overrides))

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
	writeFile(t, filepath.Join(vmDir, "main.tf"), vmConfig("kvm", fmt.Sprintf(`
provider "kvm" {
  endpoint = %q
  token    = %q
}
`, proxy.URL, control.Token), n))
	dataDir := filepath.Join(work, "data")
	writeFile(t, filepath.Join(dataDir, "main.tf"), fmt.Sprintf(`resource "terraform_data" "d" {
  count = %d
  input = count.index
}
`, n))

	terraform := func(dir string, args ...string) planTime { return runTerraform(t, tf, rc, nil, dir, args...) }
	// plan times a plan with refresh; -detailed-exitcode makes a plan with
	// changes (exit status 2) an error, since a refresh that finds nothing to
	// do is what is measured. With envProfile its provider writes a CPU
	// profile to <profileDir>/<kind>-run<r>.
	run := 0
	plan := func(dir string) planTime {
		t.Helper()
		var env []string
		if profileDir != "" {
			d := filepath.Join(profileDir, fmt.Sprintf("%s-run%d", filepath.Base(dir), run+1))
			if err := os.MkdirAll(d, 0o755); err != nil {
				t.Fatal(err)
			}
			env = []string{"KVM_PROVIDER_CPUPROFILE=" + d}
		}
		return runTerraform(t, tf, rc, env, dir, "plan", "-input=false", "-lock=false", "-detailed-exitcode")
	}

	vmApply := terraform(vmDir, "apply", "-auto-approve", "-input=false", "-parallelism=20")
	dataApply := terraform(dataDir, "apply", "-auto-approve", "-input=false")
	t.Logf("setup: apply of %d kvm_vm %v, of %d terraform_data %v", n, vmApply.wall.Round(time.Millisecond), n, dataApply.wall.Round(time.Millisecond))
	baseDir := filepath.Join(work, "kvmbase")
	if baseline != "" {
		// The same VMs, planned by the baseline build: a copy of the state
		// with its provider renamed.
		writeFile(t, filepath.Join(baseDir, "main.tf"), strings.Replace(vmConfig("kvm", fmt.Sprintf(`
provider "kvm" {
  endpoint = %q
  token    = %q
}
`, proxy.URL, control.Token), n), `source = "kvmfleet/kvm"`, `source = "kvmfleet/kvmbase"`, 1))
		copyFile(t, filepath.Join(vmDir, "terraform.tfstate"), filepath.Join(baseDir, "terraform.tfstate"))
		terraform(baseDir, "state", "replace-provider", "-auto-approve", "-lock=false",
			// No host: each CLI resolves these against its own registry,
			// as it did the configuration's sources.
			"kvmfleet/kvm", "kvmfleet/kvmbase")
	}
	floorDirs := map[string]string{}
	if withFloor {
		for _, f := range floors {
			floorDirs[f] = filepath.Join(work, f)
			writeFile(t, filepath.Join(floorDirs[f], "main.tf"), vmConfig(f, "", n))
			apply := terraform(floorDirs[f], "apply", "-auto-approve", "-input=false")
			t.Logf("setup: apply of %d %s_vm %v", n, f, apply.wall.Round(time.Millisecond))
		}
	}

	var kvmRatios, ownRatios ratios      // ownRatios: kvm_vm over floorfw_vm
	var baseRatios, baseOwnRatios ratios // the baseline build's
	floorRatios := map[string]*ratios{}
	for _, f := range floors {
		floorRatios[f] = &ratios{}
	}
	for r := 0; r < runs; r++ {
		run = r
		// The baseline plans first on even runs and second on odd ones, so
		// that neither build always follows the other.
		var baseTime planTime
		planBase := func() {
			if baseline == "" {
				return
			}
			baseTime = plan(baseDir)
		}
		if r%2 == 0 {
			planBase()
		}
		proxy.reset()
		kvmTime := plan(vmDir)
		reqs := proxy.snapshot()
		if r%2 == 1 {
			planBase()
		}
		dataTime := plan(dataDir)
		wall, cpu := kvmRatios.add(kvmTime, dataTime)
		t.Logf("run %d: terraform plan over %d kvm_vm: %v; over %d terraform_data: %v; "+
			"ratio wall %.2f, CPU %.2f; provider HTTP requests: %s", r+1, n, kvmTime, n, dataTime, wall, cpu, reqs)
		if baseline != "" {
			wall, cpu := baseRatios.add(baseTime, dataTime)
			t.Logf("run %d: terraform plan over %d kvm_vm with the baseline build: %v; ratio to terraform_data wall %.2f, CPU %.2f",
				r+1, n, baseTime, wall, cpu)
		}
		if !withFloor {
			continue
		}
		floorTimes := map[string]planTime{}
		for _, f := range floors {
			floorTimes[f] = plan(floorDirs[f])
			wall, cpu := floorRatios[f].add(floorTimes[f], dataTime)
			t.Logf("run %d: terraform plan over %d %s_vm: %v; ratio to terraform_data wall %.2f, CPU %.2f",
				r+1, n, f, floorTimes[f], wall, cpu)
		}
		wall, cpu = ownRatios.add(kvmTime, floorTimes[floors[0]])
		t.Logf("run %d: kvm_vm/%s_vm wall %.2f, CPU %.2f", r+1, floors[0], wall, cpu)
		if baseline != "" {
			wall, cpu = baseOwnRatios.add(baseTime, floorTimes[floors[0]])
			t.Logf("run %d: baseline kvm_vm/%s_vm wall %.2f, CPU %.2f", r+1, floors[0], wall, cpu)
		}
	}
	kvmRatios.log(t, "kvm_vm/terraform_data", "")
	if withFloor {
		for _, f := range floors {
			floorRatios[f].log(t, f+"_vm/terraform_data", "")
		}
		ownRatios.log(t, "kvm_vm/"+floors[0]+"_vm", " (the provider's own work; goal <= 1.15)")
	}
	if baseline != "" {
		baseRatios.log(t, "baseline kvm_vm/terraform_data", "")
		if withFloor {
			baseOwnRatios.log(t, "baseline kvm_vm/"+floors[0]+"_vm", "")
		}
	}
}

// terraformAndProvider finds the CLI as the provider's acceptance tests do
// (TF_ACC_TERRAFORM_PATH, a terraform or tofu binary, else terraform on
// PATH) and builds the provider into work/bin, work being a new temporary
// directory.
func terraformAndProvider(t *testing.T) (tf, work, bin string) {
	t.Helper()
	cli, err := testenv.FindCLI()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("CLI: %s v%s (%s)", cli.Product, cli.Version, cli.Path)
	tf = cli.Path
	work = t.TempDir()
	bin = filepath.Join(work, "bin")
	testenv.BuildProvider(t, bin)
	return tf, work, bin
}

// runTerraform runs one terraform command in dir with the CLI
// configuration rc and returns its wall time and CPU time (user + system,
// including the provider processes it waited for). A failing command fails
// the test with the end of its output.
func runTerraform(t *testing.T, tf, rc string, env []string, dir string, args ...string) planTime {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, tf, args...)
	cmd.Dir = dir
	cmd.Env = append(append(os.Environ(), "TF_CLI_CONFIG_FILE="+rc, "TF_IN_AUTOMATION=1", "CHECKPOINT_DISABLE=1"), env...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	start := time.Now()
	err := cmd.Run()
	d := time.Since(start)
	if err != nil {
		t.Fatalf("terraform %s in %s: %v\n%s", strings.Join(args, " "), dir, err, tailOf(out.String(), 4000))
	}
	return planTime{wall: d, cpu: cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()}
}

// planTime is the wall and CPU time of one terraform command.
type planTime struct{ wall, cpu time.Duration }

func (p planTime) String() string {
	return fmt.Sprintf("wall %v, CPU %v", p.wall.Round(time.Millisecond), p.cpu.Round(time.Millisecond))
}

// ratios collects, run by run, the wall and CPU ratios of one plan to another.
type ratios struct{ wall, cpu []float64 }

func (r *ratios) add(num, den planTime) (wall, cpu float64) {
	wall, cpu = num.wall.Seconds()/den.wall.Seconds(), num.cpu.Seconds()/den.cpu.Seconds()
	r.wall, r.cpu = append(r.wall, wall), append(r.cpu, cpu)
	return wall, cpu
}

func (r *ratios) log(t *testing.T, what, note string) {
	t.Helper()
	t.Logf("%s over %d run(s): median wall ratio %.2f, median CPU ratio %.2f%s", what, len(r.wall), median(r.wall), median(r.cpu), note)
}

func median(xs []float64) float64 {
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	return s[len(s)/2]
}

// vmConfig is n VMs of the named provider (kvm or a floor), all alike.
func vmConfig(providerName, providerBlock string, n int) string {
	return fmt.Sprintf(`terraform {
  required_providers {
    %[1]s = { source = "kvmfleet/%[1]s" }
  }
}
%[2]s
resource "%[1]s_vm" "vm" {
  count      = %[3]d
  name       = "bench-${count.index}"
  image      = "sim"
  vcpus      = 1
  memory_mib = 64
  disk_mib   = 64
}
`, providerName, providerBlock, n)
}

func goBuild(t *testing.T, out, pkg string) {
	t.Helper()
	build := exec.Command("go", "build", "-o", out, pkg)
	build.Dir = repoRoot(t)
	if b, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building %s: %v\n%s", pkg, err, b)
	}
}

// countingProxy forwards to the control API and counts requests by method
// and path pattern.
type countingProxy struct {
	URL  string
	mu   sync.Mutex
	n    map[string]int
	busy map[string]time.Duration // summed time to answer, by the same key
	// steps sums the Server-Timing steps of the answers, by the same key.
	steps map[string]map[string]time.Duration
}

func newCountingProxy(t *testing.T, target string) *countingProxy {
	u, err := url.Parse(target)
	if err != nil {
		t.Fatalf("control URL %q: %v", target, err)
	}
	p := &countingProxy{}
	p.reset()
	rp := httputil.NewSingleHostReverseProxy(u)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Method + " " + pathPattern(r.URL.Path)
		start := time.Now()
		rp.ServeHTTP(w, r)
		p.mu.Lock()
		p.n[key]++
		p.busy[key] += time.Since(start)
		for _, st := range timing.Parse(w.Header().Get("Server-Timing")) {
			if p.steps[key] == nil {
				p.steps[key] = map[string]time.Duration{}
			}
			p.steps[key][st.Name] += st.Duration
		}
		p.mu.Unlock()
	}))
	t.Cleanup(srv.Close)
	p.URL = srv.URL
	return p
}

func (p *countingProxy) reset() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.n, p.busy, p.steps = map[string]int{}, map[string]time.Duration{}, map[string]map[string]time.Duration{}
}

// latencies renders the mean time to answer by key, e.g.
// "DELETE /v1/vms/{id}: 20 x 45ms".
func (p *countingProxy) latencies() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	keys := make([]string, 0, len(p.n))
	for k := range p.n {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		n := time.Duration(p.n[k])
		parts[i] = fmt.Sprintf("%s: %d x %v", k, p.n[k], (p.busy[k] / n).Round(100*time.Microsecond))
		var names []string
		for name := range p.steps[k] {
			names = append(names, name)
		}
		sort.Strings(names)
		var steps []string
		for _, name := range names {
			steps = append(steps, fmt.Sprintf("%s %v", name, (p.steps[k][name]/n).Round(100*time.Microsecond)))
		}
		if len(steps) > 0 {
			parts[i] += " (mean steps: " + strings.Join(steps, ", ") + ")"
		}
	}
	return strings.Join(parts, "; ")
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

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	b, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Dir(to), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(to, b, 0o755); err != nil {
		t.Fatal(err)
	}
}

func tailOf(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[len(s)-n:]
}
