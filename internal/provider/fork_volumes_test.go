package provider_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"
)

// TestAccFork_volumes forks a VM with a volume through the terraform CLI
// on sim hosts: each child lists one volume of its own, the control API's
// volume "data-<child name>", on the child's host, attached to it.
func TestAccFork_volumes(t *testing.T) {
	f := newVolumeFleet(t, "h1", "h2")
	config := f.providerBlock() + `
resource "kvm_volume" "data" {
  name     = "data"
  size_mib = 64
  host     = "h1"
}

resource "kvm_vm" "source" {
  name       = "fork-source"
  image      = "sim"
  vcpus      = 1
  memory_mib = 512
  disk_mib   = 1024

  volume_attachment {
    volume = kvm_volume.data.id
  }
}

resource "kvm_fork" "test" {
  source_vm_id = kvm_vm.source.id
  child_count  = 2
}
`
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		Steps: []resource.TestStep{{
			Config: config,
			ConfigPlanChecks: resource.ConfigPlanChecks{
				PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
			},
			ConfigStateChecks: []statecheck.StateCheck{
				statecheck.ExpectKnownValue(forkAddr, tfjsonpath.New("children").AtSliceIndex(0).AtMapKey("volume_ids"), knownvalue.ListSizeExact(1)),
				statecheck.ExpectKnownValue(forkAddr, tfjsonpath.New("children").AtSliceIndex(1).AtMapKey("volume_ids"), knownvalue.ListSizeExact(1)),
			},
			Check: func(s *terraform.State) error {
				rs := s.RootModule().Resources[forkAddr]
				for i := range 2 {
					child, vol := rs.Primary.Attributes[fmt.Sprintf("children.%d.id", i)], rs.Primary.Attributes[fmt.Sprintf("children.%d.volume_ids.0", i)]
					name := rs.Primary.Attributes[fmt.Sprintf("children.%d.name", i)]
					v, err := f.Control.Client.GetVolume(context.Background(), vol)
					if err != nil {
						return fmt.Errorf("child %s's volume %s: %w", name, vol, err)
					}
					if v.Name != "data-"+name || len(v.AttachedTo) != 1 || v.AttachedTo[0].VMID != child ||
						v.Host != rs.Primary.Attributes[fmt.Sprintf("children.%d.host", i)] {
						return fmt.Errorf("child %s's volume = %+v, want data-%s on its host, attached to it", name, v, name)
					}
				}
				return nil
			},
		}},
	})
}
