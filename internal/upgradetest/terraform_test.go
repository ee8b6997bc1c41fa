package upgradetest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// tfskewConfig is the configuration the Terraform test applies: a nat
// network, vm_count VMs on it pinned round-robin to the three hosts (so
// every agent runs some), kvm_vm.vm[1] with resized_vcpus, and a fork of
// kvm_vm.vm[0] (on host-0) whose children are spread over the fleet.
const tfskewConfig = `terraform {
  required_providers {
    kvm = { source = "kvmfleet/kvm" }
  }
}

variable "endpoint" { type = string }
variable "vm_count" { type = number }
variable "resized_vcpus" { type = number }
variable "fork_children" { type = number }

provider "kvm" {
  endpoint = var.endpoint
  token    = "control-token"
}

resource "kvm_network" "lan" {
  name = "tfskew-lan"
  mode = "nat"
  cidr = "10.77.0.0/24"
}

resource "kvm_vm" "vm" {
  count      = var.vm_count
  name       = "tfskew-${count.index}"
  image      = "sim"
  host       = "host-${count.index % 3}"
  vcpus      = count.index == 1 ? var.resized_vcpus : 1
  memory_mib = 256
  disk_mib   = 1024

  network_interface {
    network = kvm_network.lan.name
  }
}

resource "kvm_fork" "fork" {
  source_vm_id = kvm_vm.vm[0].id
  child_count  = var.fork_children
  placement    = "spread"
}

output "vm_ids" { value = kvm_vm.vm[*].id }
output "fork_id" { value = kvm_fork.fork.id }
`

// tfskewVars are the values of tfskewConfig's variables that the steps
// change.
type tfskewVars struct{ vms, resizedVCPUs, forkChildren int }

// want is what the VMs of the configuration are, by id (ids in the order
// of kvm_vm.vm), for fleetAgrees.
func (v tfskewVars) want(ids []string) map[string]api.VMCreate {
	out := map[string]api.VMCreate{}
	for i, id := range ids {
		in := upgradeVM(fmt.Sprintf("tfskew-%d", i))
		in.MemoryMiB = 256
		if i == 1 {
			in.VCPUs = int64(v.resizedVCPUs)
		}
		out[id] = in
	}
	return out
}

// tfDir is a working directory of the real terraform CLI with this tree's
// provider installed through dev_overrides (no init, no registry).
type tfDir struct {
	cli, rc, dir string
}

func newTFDir(t *testing.T) *tfDir {
	t.Helper()
	cli, err := testenv.FindCLI()
	if err != nil {
		t.Fatal(err)
	}
	work := t.TempDir()
	bin := filepath.Join(work, "bin")
	testenv.BuildProvider(t, bin)
	d := &tfDir{cli: cli.Path, rc: filepath.Join(work, "terraformrc"), dir: filepath.Join(work, "config")}
	if err := os.WriteFile(d.rc, []byte(testenv.DevOverridesConfig(map[string]string{"kvmfleet/kvm": bin})), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(d.dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(d.dir, "main.tf"), []byte(tfskewConfig), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("CLI: %s v%s (%s), provider of this tree from %s (dev_overrides)", cli.Product, cli.Version, cli.Path, bin)
	return d
}

// run runs one CLI command against the control API at endpoint with the
// variables v and returns its output and exit status.
func (d *tfDir) run(t *testing.T, ctx context.Context, endpoint string, v tfskewVars, args ...string) (string, int) {
	t.Helper()
	args = append(args, "-no-color",
		"-var", "endpoint="+endpoint,
		"-var", fmt.Sprintf("vm_count=%d", v.vms),
		"-var", fmt.Sprintf("resized_vcpus=%d", v.resizedVCPUs),
		"-var", fmt.Sprintf("fork_children=%d", v.forkChildren))
	out, err := d.command(ctx, args...).CombinedOutput()
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		return string(out), exit.ExitCode()
	}
	if err != nil {
		t.Fatalf("run %s %s: %v", d.cli, args[0], err)
	}
	return string(out), 0
}

// apply applies v through endpoint; it fails the test when the apply does.
func (d *tfDir) apply(t *testing.T, ctx context.Context, endpoint string, v tfskewVars, what string) {
	t.Helper()
	if out, code := d.run(t, ctx, endpoint, v, "apply", "-auto-approve", "-input=false"); code != 0 {
		t.Fatalf("%s: terraform apply through %s exited %d:\n%s", what, endpoint, code, tailOf(out))
	}
}

// planEmpty runs `terraform plan -detailed-exitcode` (with refresh)
// through each endpoint: each must exit 0, no changes.
func (d *tfDir) planEmpty(t *testing.T, ctx context.Context, endpoints []string, v tfskewVars, when string) {
	t.Helper()
	for _, e := range endpoints {
		if out, code := d.run(t, ctx, e, v, "plan", "-input=false", "-detailed-exitcode"); code != 0 {
			t.Errorf("%s: terraform plan -detailed-exitcode through %s exited %d, want 0 (no changes):\n%s", when, e, code, tailOf(out))
		}
	}
}

// command is the CLI with args in the working directory. The caller's
// KVM_* settings are left out: the configuration says where and as whom.
func (d *tfDir) command(ctx context.Context, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, d.cli, args...)
	cmd.Dir = d.dir
	for _, e := range os.Environ() {
		if !strings.HasPrefix(e, "KVM_") {
			cmd.Env = append(cmd.Env, e)
		}
	}
	cmd.Env = append(cmd.Env, "TF_CLI_CONFIG_FILE="+d.rc, "TF_IN_AUTOMATION=1", "CHECKPOINT_DISABLE=1")
	return cmd
}

// tfskewOutputs are the configuration's outputs: kvm_vm.vm[*].id and the
// fork's id.
type tfskewOutputs struct {
	VMIDs  []string
	ForkID string
}

func (d *tfDir) outputs(t *testing.T, ctx context.Context) tfskewOutputs {
	t.Helper()
	b, err := d.command(ctx, "output", "-json").Output()
	if err != nil {
		t.Fatalf("terraform output -json: %v", err)
	}
	var raw struct {
		VMIDs  struct{ Value []string } `json:"vm_ids"`
		ForkID struct{ Value string }   `json:"fork_id"`
	}
	if err := json.Unmarshal(b, &raw); err != nil {
		t.Fatalf("terraform output -json printed %q: %v", b, err)
	}
	return tfskewOutputs{VMIDs: raw.VMIDs.Value, ForkID: raw.ForkID.Value}
}

func tailOf(s string) string {
	const n = 6000
	if len(s) <= n {
		return s
	}
	return "..." + s[len(s)-n:]
}

// Contract: Terraform manages a fleet in the middle of a rolling upgrade.
// This tree's provider, run by the real terraform CLI (dev_overrides),
// applies a nat network, VMs pinned to each of three hosts and a fork
// with children spread over them, on 2 control replicas and 3 agents of
// the previous release. The fleet is then upgraded one process at a time
// (one replica, the agents one by one, the other replica: every mix of
// the two releases a rolling upgrade passes through). After each step
// `terraform plan -detailed-exitcode` through each replica exits 0, an
// apply that changes something (a VM added, a resize, a fork grown, a VM
// deleted) works, the plan through each replica is empty again and the
// fleet agrees with the state (nothing lost, every VM on exactly one
// agent). `terraform destroy` leaves no VM, fork or network.
func TestUpgradeTerraformAcrossRollingUpgrade(t *testing.T) {
	b := upgradeBinaries(t)
	tf := newTFDir(t)
	ctx := ctxFor(t, 20*time.Minute)
	db := postgres(t)
	replicas := []*kvmdProc{startUpgradeControl(t, b.old, db), startUpgradeControl(t, b.old, db)}
	agents := registerAndSync(t, ctx, replicas[0].client(),
		[]*kvmdProc{startUpgradeAgent(t, b.old), startUpgradeAgent(t, b.old), startUpgradeAgent(t, b.old)})
	clients := []*client.Client{replicas[0].client(), replicas[1].client()}
	endpoints := []string{replicas[0].url, replicas[1].url}

	vars := tfskewVars{vms: 3, resizedVCPUs: 1, forkChildren: 2}
	tf.apply(t, ctx, endpoints[0], vars, "the previous release")
	tf.planEmpty(t, ctx, endpoints, vars, "the previous release")
	// The same plan shows a change when there is one: exit 0 below means
	// no changes, not a plan that cannot see them.
	resized := vars
	resized.resizedVCPUs++
	if out, code := tf.run(t, ctx, endpoints[1], resized, "plan", "-input=false", "-detailed-exitcode"); code != 2 ||
		!strings.Contains(out, "1 to change") {
		t.Fatalf("terraform plan of a resize exited %d, want 2 (changes) with 1 to change:\n%s", code, tailOf(out))
	}
	checkFleet(t, ctx, clients, agents, vars.want(tf.outputs(t, ctx).VMIDs))
	t.Logf("applied on the previous release (%s): %d VMs, a fork of %d children, a network", b.oldCommit[:7], vars.vms, vars.forkChildren)

	steps := []struct {
		proc   *kvmdProc
		what   string
		change func(*tfskewVars)
		apply  string
	}{
		{replicas[0], "control replica 0", func(v *tfskewVars) { v.vms++ }, "a VM added"},
		{agents["host-0"], "the agent of host-0", func(v *tfskewVars) { v.resizedVCPUs = 2 }, "tfskew-1 resized to 2 vCPUs"},
		{agents["host-1"], "the agent of host-1", func(v *tfskewVars) { v.forkChildren++ }, "the fork grown by a child"},
		{agents["host-2"], "the agent of host-2", func(v *tfskewVars) { v.vms-- }, "a VM deleted"},
		{replicas[1], "control replica 1", func(v *tfskewVars) { v.vms += 2; v.resizedVCPUs = 1 }, "two VMs added, tfskew-1 back to 1 vCPU"},
	}
	for i, s := range steps {
		s.proc.restartAs(t, b.current)
		waitFor(t, "every host alive after upgrading "+s.what, func() error { return allAlive(ctx, clients[0]) })
		when := "after upgrading " + s.what
		tf.planEmpty(t, ctx, endpoints, vars, when)
		s.change(&vars)
		through := endpoints[i%2]
		tf.apply(t, ctx, through, vars, when+": "+s.apply)
		tf.planEmpty(t, ctx, endpoints, vars, when+", after the apply of "+s.apply)
		checkFleet(t, ctx, clients, agents, vars.want(tf.outputs(t, ctx).VMIDs))
		t.Logf("%s: plans empty through both replicas; applied %s through %s", when, s.apply, through)
	}

	forkID := tf.outputs(t, ctx).ForkID
	if out, code := tf.run(t, ctx, endpoints[1], vars, "destroy", "-auto-approve", "-input=false"); code != 0 {
		t.Fatalf("terraform destroy through %s exited %d:\n%s", endpoints[1], code, tailOf(out))
	}
	for _, c := range clients {
		waitFor(t, "nothing left after terraform destroy, through "+c.Endpoint(), func() error {
			return fleetEmpty(ctx, c, agents, forkID, "tfskew-lan")
		})
	}
}

// fleetEmpty says what is left of the configuration after a destroy: a VM
// row that is not gone, the fork, the network, or anything fleetAgrees
// finds (an agent still running a VM, capacity still allocated).
func fleetEmpty(ctx context.Context, c *client.Client, agents map[string]*kvmdProc, forkID, network string) error {
	if err := fleetAgrees(ctx, c, agents, nil); err != nil {
		return err
	}
	vms, err := c.AllVMs(ctx, client.ListOptions{})
	if err != nil {
		return err
	}
	for _, vm := range vms {
		if !api.Gone(vm.ObservedState) {
			return fmt.Errorf("vm %s (%s) on %s is %s after the destroy", vm.ID, vm.Name, vm.Host, vm.ObservedState)
		}
	}
	if f, err := c.GetFork(ctx, forkID); !errors.Is(err, client.ErrNotFound) {
		return fmt.Errorf("fork %s after the destroy: phase %q, %v; want not found", forkID, f.Phase, err)
	}
	if n, err := c.GetNetwork(ctx, network); !errors.Is(err, client.ErrNotFound) {
		return fmt.Errorf("network %s after the destroy: %+v, %v; want not found", network, n, err)
	}
	return nil
}
