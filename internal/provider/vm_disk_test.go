package provider_test

import (
	"fmt"
	"regexp"
	"testing"

	"github.com/hashicorp/terraform-plugin-testing/compare"
	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

func diskConfig(f *fleet, diskMiB int) string {
	return f.providerBlock() + fmt.Sprintf(`
resource "kvm_vm" "test" {
  name       = "disk-grows"
  image      = "sim"
  vcpus      = 1
  memory_mib = 512
  disk_mib   = %d
}
`, diskMiB)
}

// disk_mib grows in place (plan: update, same id, the host's allocation
// grows); a smaller value is refused with the reason.
func TestAccVM_diskGrowsInPlace(t *testing.T) {
	f := newFleet(t, "h1")
	sameID := statecheck.CompareValue(compare.ValuesSame())
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{
				Config:            diskConfig(f, 1024),
				ConfigStateChecks: []statecheck.StateCheck{sameID.AddStateValue(vmAddr, tfjsonpath.New("id"))},
			},
			{
				Config: diskConfig(f, 4096),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionUpdate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("disk_mib"), knownvalue.Int64Exact(4096)),
					sameID.AddStateValue(vmAddr, tfjsonpath.New("id")),
				},
				Check: f.checkHostAllocated("h1", api.Resources{VCPUs: 1, MemoryMiB: 512, DiskMiB: 4096}),
			},
			{
				Config:      diskConfig(f, 2048),
				ExpectError: regexp.MustCompile(`(?s)disk_mib 2048 is smaller than VM.*4096 MiB disk: disks grow, never\s+shrink`),
			},
		},
	})
}
