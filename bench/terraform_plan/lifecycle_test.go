package terraformplan

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// Environment of the apply/destroy measurement.
const (
	envLifecycle      = "KVM_BENCH_TFLIFECYCLE"      // set to 1 to run
	envLifecycleCount = "KVM_BENCH_TFLIFECYCLE_N"    // VMs, default 20
	envLifecycleRuns  = "KVM_BENCH_TFLIFECYCLE_RUNS" // apply/destroy pairs, default 1
)

// TestTerraformApplyDestroyQEMU times `terraform apply` and `terraform
// destroy` of N running busybox guests (real QEMU, TCG here; running
// throughout, as the libvirt provider's figures were taken, but for a
// second plan with them paused) with the real terraform CLI at its default parallelism
// (10), against a control API on SQLite and one QEMU agent in process. It logs the wall time of each, and
// the requests the provider made with their mean time to answer, so that
// what terraform and the provider spend beyond the control API shows. It
// measures; it never fails on time:
//
//	KVM_BENCH_TFLIFECYCLE=1 go test -run TestTerraformApplyDestroyQEMU -v -timeout 30m ./bench/terraform_plan/
func TestTerraformApplyDestroyQEMU(t *testing.T) {
	if os.Getenv(envLifecycle) == "" {
		t.Skipf("a measurement, not a test: set %s=1 to run it", envLifecycle)
	}
	testenv.RequireQEMU(t)
	n := envInt(t, envLifecycleCount, 20)
	runs := envInt(t, envLifecycleRuns, 1)
	tf, work, bin := terraformAndProvider(t)
	rc := filepath.Join(work, "terraformrc")
	writeFile(t, rc, testenv.DevOverridesConfig(map[string]string{"kvmfleet/kvm": bin}))

	control := testenv.StartControl(t, testenv.ControlOptions{})
	agent := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu"})
	ratio := float64(n) // n guests of one vCPU fit whatever the host's cores
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	if _, err := control.Client.PutHost(ctx, "q1", api.HostPut{Address: agent.Address, CPUAllocationRatio: &ratio}); err != nil {
		t.Fatal(err)
	}
	proxy := newCountingProxy(t, control.URL)

	dir := filepath.Join(work, "vms")
	writeFile(t, filepath.Join(dir, "main.tf"), fmt.Sprintf(`terraform {
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
  name       = "life-${count.index}"
  image      = "busybox"
  vcpus      = 1
  memory_mib = 128
  disk_mib   = 64
}
`, proxy.URL, control.Token, n))
	terraform := func(args ...string) time.Duration { return runTerraform(t, tf, rc, nil, dir, args...).wall }
	for r := 1; r <= runs; r++ {
		proxy.reset()
		apply := terraform("apply", "-auto-approve", "-input=false")
		t.Logf("run %d: terraform apply of %d running busybox kvm_vm: %v; requests %s",
			r, n, apply.Round(time.Millisecond), proxy.latencies())
		// A plan over the running guests, then over the same guests paused
		// (QMP stop, through the agent), as the libvirt provider's plan
		// figure was taken: n idle TCG guests take CPU from terraform.
		running := terraform("plan", "-input=false", "-detailed-exitcode")
		vms, err := control.Client.AllVMs(ctx, client.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		action := func(a string) {
			for _, vm := range vms {
				if _, err := agent.Client.Action(ctx, vm.ID, a); err != nil {
					t.Fatalf("%s %s: %v", a, vm.ID, err)
				}
			}
		}
		action(agentapi.ActionPause)
		paused := terraform("plan", "-input=false", "-detailed-exitcode")
		t.Logf("run %d: terraform plan (refresh, no changes) of %d kvm_vm: %v with the guests running, %v with them paused",
			r, n, running.Round(time.Millisecond), paused.Round(time.Millisecond))
		// The destroy meets running guests, as the libvirt provider's did.
		action(agentapi.ActionResume)
		proxy.reset()
		destroy := terraform("destroy", "-auto-approve", "-input=false")
		t.Logf("run %d: terraform destroy of %d running busybox kvm_vm: %v; requests %s",
			r, n, destroy.Round(time.Millisecond), proxy.latencies())
	}
}
