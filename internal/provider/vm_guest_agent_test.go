package provider_test

import (
	"fmt"
	"regexp"
	"testing"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"
)

// TestAccVM_guestAgent walks guest_agent through the terraform CLI on a sim
// host: a VM with it is stored with it (the control API says so) and boots
// cold; wait_for = "agent" waits for the (simulated) guest agent, whose
// addresses are in state right after apply; a plan right after is empty and
// an import reads the same; turning it off replaces the VM, which then
// reports no guest addresses; wait_for = "agent" without it is refused at plan
// time, naming the attribute.
func TestAccVM_guestAgent(t *testing.T) {
	f := newFleet(t, "h1")
	withAgent := func(on bool) string {
		wait := "running"
		if on {
			wait = "agent"
		}
		return guestVMConfig(f, fmt.Sprintf(`  guest_agent = %v
  wait_for    = %q
  network_interface {
    network = "default"
  }
`, on, wait))
	}
	var id1, id2 string
	onServer := func(id *string, want bool) func(*terraform.State) error {
		return func(*terraform.State) error {
			vm, err := f.Control.Client.GetVM(ctxT(t), *id)
			if err != nil {
				return err
			}
			if vm.GuestAgent != want || (want && vm.StartedFrom != "cold") {
				return fmt.Errorf("VM %s on the control API: guest_agent %v (want %v), started_from %q", *id, vm.GuestAgent, want, vm.StartedFrom)
			}
			return nil
		}
	}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{
				Config:      guestVMConfig(f, `  wait_for = "agent"`),
				ExpectError: regexp.MustCompile(`(?s)Invalid Wait.*set guest_agent = true`),
			},
			{
				Config: withAgent(true),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("guest_agent"), knownvalue.Bool(true)),
					// The sim's guest agent reports the NIC's address: in
					// state right after the wait, not only at the next refresh.
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("network_interface").AtSliceIndex(0).AtMapKey("ipv4_addresses"),
						knownvalue.ListExact([]knownvalue.Check{knownvalue.StringExact("10.0.2.15")})),
				},
				Check: resource.ComposeTestCheckFunc(captureAttr(vmAddr, "id", &id1), onServer(&id1, true)),
			},
			{
				ResourceName:      vmAddr,
				ImportState:       true,
				ImportStateVerify: true,
				// An import reads the implied default NIC as no blocks,
				// and wait_for as its default.
				ImportStateVerifyIgnore: []string{"timeouts", "wait_for", "network_interface"},
			},
			{
				Config: withAgent(false),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionReplace)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("guest_agent"), knownvalue.Bool(false)),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("network_interface").AtSliceIndex(0).AtMapKey("ipv4_addresses"),
						knownvalue.Null()),
				},
				Check: resource.ComposeTestCheckFunc(captureAttr(vmAddr, "id", &id2), onServer(&id2, false)),
			},
		},
	})
}
