package provider_test

import (
	"regexp"
	"testing"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"
	"github.com/vishvananda/netlink"

	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv/netnstest"
)

// kvm_host.underlay_address: proved by the agent (started with
// --underlay-address) at registration, changed in place, refused when the
// agent does not have it, and the host then takes overlay VMs. The agent
// needs the address on an interface, so the test runs in a network
// namespace of its own with a veth that has it.
func TestAccHost_underlayAddress(t *testing.T) {
	if !netnstest.InOwnNetNS(t) {
		return
	}
	accPreCheck(t)
	ul := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "ovtf0"}, PeerName: "ovtf1"}
	if err := netlink.LinkAdd(ul); err != nil {
		t.Fatal(err)
	}
	addr, _ := netlink.ParseAddr("10.97.0.1/24")
	if err := netlink.AddrAdd(ul, addr); err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkSetUp(ul); err != nil {
		t.Fatal(err)
	}
	f := &fleet{Control: testenv.StartControl(t, testenv.ControlOptions{}), Agents: map[string]*testenv.Agent{}}
	a := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: testHostVCPUs, MemoryMiB: testHostMemoryMiB, DiskMiB: testHostDiskMiB,
		UnderlayAddress: "10.97.0.1"})
	overlayVM := `
resource "kvm_network" "ov" {
  name = "ov"
  mode = "overlay"
  cidr = "10.73.0.0/24"
}
resource "kvm_vm" "v" {
  name       = "v"
  image      = "sim"
  vcpus      = 1
  memory_mib = 256
  disk_mib   = 1024
  host       = kvm_host.test.name
  network_interface {
    network = kvm_network.ov.name
  }
}
`
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkHostsGone("u1"),
		Steps: []resource.TestStep{
			{
				Config: hostConfig(f, "u1", a.Address, ""),
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(hostAddr, tfjsonpath.New("underlay_address"), knownvalue.Null()),
				},
			},
			{
				// Without an underlay address the host takes no overlay NIC.
				Config:      hostConfig(f, "u1", a.Address, "") + overlayVM,
				ExpectError: regexp.MustCompile(`(?s)underlay_address`),
			},
			{
				Config: hostConfig(f, "u1", a.Address, `  underlay_address = "10.97.0.9"`),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(hostAddr, plancheck.ResourceActionUpdate)},
				},
				ExpectError: regexp.MustCompile(`(?s)refused to prove.*underlay_address.*10\.97\.0\.9`),
			},
			{
				Config: hostConfig(f, "u1", a.Address, `  underlay_address = "10.97.0.1"`) + overlayVM,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(hostAddr, plancheck.ResourceActionUpdate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(hostAddr, tfjsonpath.New("underlay_address"), knownvalue.StringExact("10.97.0.1")),
					statecheck.ExpectKnownValue("kvm_vm.v", tfjsonpath.New("host"), knownvalue.StringExact("u1")),
				},
			},
			{
				ResourceName:                         hostAddr,
				ImportState:                          true,
				ImportStateId:                        "u1",
				ImportStateVerify:                    true,
				ImportStateVerifyIdentifierAttribute: "name",
				ImportStateVerifyIgnore:              []string{"allocated", "free"},
			},
		},
	})
}
