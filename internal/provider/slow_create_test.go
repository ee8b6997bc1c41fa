package provider_test

import (
	"context"
	"fmt"
	"regexp"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// A create slower than the provider's request_timeout and than the
// resource's create timeout: the control API keeps going and makes the
// VM. The provider does not lose track of it: it waits out 409 in_flight
// on its own Idempotency-Key until the create timeout, then finds the VM
// and keeps it in state as tainted; the next apply replaces it, and in the
// end exactly one VM runs, the one in state.
func TestAccVMSlowCreateIsKeptAsTainted(t *testing.T) {
	accPreCheck(t)
	f := &fleet{Control: testenv.StartControl(t, testenv.ControlOptions{}), Agents: map[string]*testenv.Agent{}}
	slow := testenv.StartSlowAgent(t, testenv.AgentOptions{VCPUs: testHostVCPUs, MemoryMiB: testHostMemoryMiB, DiskMiB: testHostDiskMiB}, 6*time.Second)
	f.Control.RegisterHost(t, "h1", slow.Address)
	f.Agents["h1"] = slow.Agent
	cfg := fmt.Sprintf(`
provider "kvm" {
  endpoint        = %q
  token           = %q
  request_timeout = "1s"
}

resource "kvm_vm" "slow" {
  name       = "slow"
  image      = "sim"
  vcpus      = 1
  memory_mib = 512
  disk_mib   = 1024
  timeouts {
    create = "3s"
  }
}
`, f.Control.URL, f.Control.Token)
	var firstID string
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{
				Config:      cfg,
				ExpectError: regexp.MustCompile(`kept in\s+state\s+as\s+tainted`),
			},
			{
				PreConfig: func() {
					slow.Slow.Store(false)
					waitFor(t, "the first create finishes on the server", func(ctx context.Context) (bool, error) {
						vms, err := f.Control.Client.AllVMs(ctx, client.ListOptions{Name: "slow"})
						if err != nil || len(vms) != 1 {
							return false, err
						}
						firstID = vms[0].ID
						return vms[0].ObservedState == api.StateRunning, nil
					})
				},
				Config: cfg,
				ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{
					plancheck.ExpectResourceAction("kvm_vm.slow", plancheck.ResourceActionReplace),
				}},
				Check: func(s *terraform.State) error {
					vms, err := f.Control.Client.AllVMs(context.Background(), client.ListOptions{})
					if err != nil {
						return err
					}
					id := s.RootModule().Resources["kvm_vm.slow"].Primary.ID
					if len(vms) != 1 || vms[0].ID != id || id == firstID {
						return fmt.Errorf("%d VMs exist (%v); want one, the replacement %s in state (the tainted %s deleted)", len(vms), vms, id, firstID)
					}
					return nil
				},
			},
		},
	})
}
