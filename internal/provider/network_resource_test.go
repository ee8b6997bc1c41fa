package provider_test

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"regexp"
	"testing"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"

	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

const netAddr = "kvm_network.test"

func networkConfig(f *fleet, body string) string {
	return f.providerBlock() + fmt.Sprintf(`
resource "kvm_network" "test" {
%s
}
`, body)
}

// checkNetworksGone is the CheckDestroy of kvm_network tests.
func (f *fleet) checkNetworksGone(names ...string) resource.TestCheckFunc {
	return func(s *terraform.State) error {
		for _, name := range names {
			_, err := f.Control.Client.GetNetwork(context.Background(), name)
			if err == nil {
				return fmt.Errorf("network %s still exists after destroy", name)
			}
			if !errors.Is(err, client.ErrNotFound) {
				return fmt.Errorf("reading network %s after destroy: %w", name, err)
			}
		}
		return f.checkFleetEmpty(s)
	}
}

func TestAccNetwork_basic(t *testing.T) {
	f := newFleet(t, "node-a")
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkNetworksGone("lan", "lan2"),
		Steps: []resource.TestStep{
			{
				Config: networkConfig(f, `
  name = "lan"
  mode = "nat"
  cidr = "10.20.0.0/24"
`),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(netAddr, plancheck.ResourceActionCreate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(netAddr, tfjsonpath.New("gateway"), knownvalue.StringExact("10.20.0.1")),
					statecheck.ExpectKnownValue(netAddr, tfjsonpath.New("dhcp"), knownvalue.Bool(true)),
					statecheck.ExpectKnownValue(netAddr, tfjsonpath.New("bridge"), knownvalue.Null()),
					statecheck.ExpectKnownValue(netAddr, tfjsonpath.New("hosts"), knownvalue.SetSizeExact(0)),
					statecheck.ExpectKnownValue(netAddr, tfjsonpath.New("allow"), knownvalue.SetSizeExact(0)),
					statecheck.ExpectKnownValue(netAddr, tfjsonpath.New("addresses_total"), knownvalue.Int64Exact(253)),
					statecheck.ExpectKnownValue(netAddr, tfjsonpath.New("addresses_used"), knownvalue.Int64Exact(0)),
				},
			},
			{
				ResourceName:                         netAddr,
				ImportState:                          true,
				ImportStateId:                        "lan",
				ImportStateVerify:                    true,
				ImportStateVerifyIdentifierAttribute: "name",
			},
			{
				// hosts changes in place.
				Config: networkConfig(f, `
  name  = "lan"
  mode  = "nat"
  cidr  = "10.20.0.0/24"
  hosts = ["node-a"]
`),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(netAddr, plancheck.ResourceActionUpdate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(netAddr, tfjsonpath.New("hosts"),
						knownvalue.SetExact([]knownvalue.Check{knownvalue.StringExact("node-a")})),
				},
			},
			{
				// The range does not change in place.
				Config: networkConfig(f, `
  name    = "lan"
  mode    = "nat"
  cidr    = "10.30.0.0/24"
  gateway = "10.30.0.254"
  hosts   = ["node-a"]
`),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(netAddr, plancheck.ResourceActionDestroyBeforeCreate)},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(netAddr, tfjsonpath.New("gateway"), knownvalue.StringExact("10.30.0.254")),
				},
			},
			{
				// Neither does the fence's allow list.
				Config: networkConfig(f, `
  name    = "lan"
  mode    = "nat"
  cidr    = "10.30.0.0/24"
  gateway = "10.30.0.254"
  hosts   = ["node-a"]
  allow   = ["lan2", "192.168.10.0/24"]
`),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(netAddr, plancheck.ResourceActionDestroyBeforeCreate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(netAddr, tfjsonpath.New("allow"), knownvalue.SetExact([]knownvalue.Check{
						knownvalue.StringExact("192.168.10.0/24"), knownvalue.StringExact("lan2")})),
				},
			},
			{
				ResourceName:                         netAddr,
				ImportState:                          true,
				ImportStateId:                        "lan",
				ImportStateVerify:                    true,
				ImportStateVerifyIdentifierAttribute: "name",
			},
		},
	})
}

func TestAccNetwork_userAndBadInput(t *testing.T) {
	f := newFleet(t, "node-a")
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkNetworksGone("lab"),
		Steps: []resource.TestStep{
			{
				Config: networkConfig(f, `
  name = "lab"
  mode = "nat"
  cidr = "10.20.0.0/24"
  gateway = "10.21.0.1"
`),
				ExpectError: regexp.MustCompile(`gateway 10\.21\.0\.1 is outside`),
			},
			{
				Config: networkConfig(f, `
  name  = "lab"
  mode  = "user"
  allow = ["10.0.0.0/8"]
`),
				ExpectError: regexp.MustCompile(`allow: only a nat network`),
			},
			{
				Config: networkConfig(f, `
  name = "lab"
  mode = "user"
`),
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(netAddr, tfjsonpath.New("cidr"), knownvalue.Null()),
					statecheck.ExpectKnownValue(netAddr, tfjsonpath.New("gateway"), knownvalue.Null()),
					statecheck.ExpectKnownValue(netAddr, tfjsonpath.New("dhcp"), knownvalue.Bool(false)),
					statecheck.ExpectKnownValue(netAddr, tfjsonpath.New("addresses_total"), knownvalue.Int64Exact(0)),
				},
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
			},
		},
	})
}

func TestAccNetwork_disappears(t *testing.T) {
	f := newFleet(t, "node-a")
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkNetworksGone("lan"),
		Steps: []resource.TestStep{
			{
				Config: networkConfig(f, `
  name = "lan"
  mode = "nat"
  cidr = "10.20.0.0/24"
`),
				Check: func(*terraform.State) error {
					return f.Control.Client.DeleteNetwork(context.Background(), "lan")
				},
				ExpectNonEmptyPlan: true,
			},
		},
	})
}

func TestAccNetworkDataSource_default(t *testing.T) {
	f := newFleet(t, "node-a")
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		Steps: []resource.TestStep{{
			Config: f.providerBlock() + `
data "kvm_network" "default" {
  name = "default"
}
`,
			ConfigStateChecks: []statecheck.StateCheck{
				statecheck.ExpectKnownValue("data.kvm_network.default", tfjsonpath.New("mode"), knownvalue.StringExact("user")),
				statecheck.ExpectKnownValue("data.kvm_network.default", tfjsonpath.New("cidr"), knownvalue.Null()),
			},
		}},
	})
}

const nicVMAddr = "kvm_vm.test"

func nicVMConfig(f *fleet, nics string) string {
	return f.providerBlock() + fmt.Sprintf(`
resource "kvm_network" "lan" {
  name = "lan"
  mode = "nat"
  cidr = "10.20.0.0/24"
}

resource "kvm_vm" "test" {
  name       = "web"
  image      = "sim"
  vcpus      = 1
  memory_mib = 512
  disk_mib   = 1024
%s
}
`, nics)
}

// inRange checks that a state value is an address of 10.20.0.0/24 other
// than the network, gateway and broadcast addresses.
type inRange struct{}

func (inRange) CheckValue(v any) error {
	s, ok := v.(string)
	if !ok {
		return fmt.Errorf("want a string, got %T", v)
	}
	a, err := netip.ParseAddr(s)
	if err != nil || !netip.MustParsePrefix("10.20.0.0/24").Contains(a) || s == "10.20.0.0" || s == "10.20.0.1" || s == "10.20.0.255" {
		return fmt.Errorf("%q is not an assignable address of 10.20.0.0/24", s)
	}
	return nil
}

func (inRange) String() string { return "an assignable address of 10.20.0.0/24" }

var macValue = knownvalue.StringRegexp(regexp.MustCompile(`^02(:[0-9a-f]{2}){5}$`))

func TestAccVM_networkInterfaces(t *testing.T) {
	// The agent double answers forwards with host ports the way the agent
	// contract says (the sim driver leaves NICs to the real agent's work).
	f := newFleet(t)
	f.Control.RegisterHost(t, "node-a", testenv.StartAgentDouble(t, testenv.AgentDoubleOptions{}).Address)
	var firstID string
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkNetworksGone("lan"),
		Steps: []resource.TestStep{
			{
				// No block: one NIC on the default user network, no diff.
				Config: nicVMConfig(f, ""),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(nicVMAddr, tfjsonpath.New("ipv4_address"), knownvalue.StringExact("10.0.2.15")),
					statecheck.ExpectKnownValue(nicVMAddr, tfjsonpath.New("network_interface"), knownvalue.ListSizeExact(0)),
				},
			},
			{
				// Adding NICs replaces the VM; the address is known right after apply.
				Config: nicVMConfig(f, `
  network_interface {
    network = kvm_network.lan.name
  }
  network_interface {
    network = "default"
    port_forward {
      guest_port = 80
    }
  }
`),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{
						plancheck.ExpectResourceAction(nicVMAddr, plancheck.ResourceActionDestroyBeforeCreate),
						plancheck.ExpectUnknownValue(nicVMAddr, tfjsonpath.New("ipv4_address")),
					},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(nicVMAddr, tfjsonpath.New("ipv4_address"), inRange{}),
					statecheck.ExpectKnownValue(nicVMAddr, tfjsonpath.New("network_interface").AtSliceIndex(0).AtMapKey("ipv4_address"), inRange{}),
					statecheck.ExpectKnownValue(nicVMAddr, tfjsonpath.New("network_interface").AtSliceIndex(0).AtMapKey("mac_address"), macValue),
					statecheck.ExpectKnownValue(nicVMAddr, tfjsonpath.New("network_interface").AtSliceIndex(1).AtMapKey("ipv4_address"),
						knownvalue.StringExact("10.0.2.15")),
					statecheck.ExpectKnownValue(nicVMAddr, tfjsonpath.New("network_interface").AtSliceIndex(1).AtMapKey("mac_address"), macValue),
					statecheck.ExpectKnownValue(nicVMAddr, tfjsonpath.New("network_interface").AtSliceIndex(1).AtMapKey("port_forward").AtSliceIndex(0),
						knownvalue.ObjectExact(map[string]knownvalue.Check{
							"guest_port":   knownvalue.Int64Exact(80),
							"host_address": knownvalue.NotNull(),
							"host_port":    knownvalue.NotNull(),
						})),
				},
				Check: captureAttr(nicVMAddr, "id", &firstID),
			},
			{
				ResourceName:            nicVMAddr,
				ImportState:             true,
				ImportStateVerify:       true,
				ImportStateVerifyIgnore: []string{"timeouts"},
			},
			{
				// Labels change in place: the NICs stay as they are.
				Config: nicVMConfig(f, `
  labels = { role = "web" }
  network_interface {
    network = kvm_network.lan.name
  }
  network_interface {
    network = "default"
    port_forward {
      guest_port = 80
    }
  }
`),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{
						plancheck.ExpectResourceAction(nicVMAddr, plancheck.ResourceActionUpdate),
						plancheck.ExpectKnownValue(nicVMAddr, tfjsonpath.New("ipv4_address"), inRange{}),
					},
				},
				Check: func(s *terraform.State) error {
					var id string
					if err := captureAttr(nicVMAddr, "id", &id)(s); err != nil {
						return err
					}
					if id != firstID {
						return fmt.Errorf("VM was replaced (%s -> %s) by a label change", firstID, id)
					}
					return nil
				},
			},
			{
				// A fixed address: a NIC change, so a replace.
				Config: nicVMConfig(f, `
  labels = { role = "web" }
  network_interface {
    network      = kvm_network.lan.name
    ipv4_address = "10.20.0.77"
  }
`),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(nicVMAddr, plancheck.ResourceActionDestroyBeforeCreate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(nicVMAddr, tfjsonpath.New("ipv4_address"), knownvalue.StringExact("10.20.0.77")),
				},
			},
		},
	})
}

// An unknown network is a clear error at apply, and nothing is created.
func TestAccVM_unknownNetwork(t *testing.T) {
	f := newFleet(t, "node-a")
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{{
			Config: f.providerBlock() + `
resource "kvm_vm" "test" {
  name       = "web"
  image      = "sim"
  vcpus      = 1
  memory_mib = 512
  disk_mib   = 1024
  network_interface {
    network = "nope"
  }
}
`,
			ExpectError: regexp.MustCompile(`network "nope" does not exist`),
		}},
	})
}

// A fixed address another VM holds is refused at apply, naming the holder,
// not mistaken for a taken VM name.
func TestAccVM_fixedAddressTaken(t *testing.T) {
	f := newFleet(t, "node-a")
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkNetworksGone("lan"),
		Steps: []resource.TestStep{{
			Config: f.providerBlock() + `
resource "kvm_network" "lan" {
  name = "lan"
  mode = "nat"
  cidr = "10.20.0.0/24"
}

resource "kvm_vm" "first" {
  name       = "first"
  image      = "sim"
  vcpus      = 1
  memory_mib = 512
  disk_mib   = 1024
  network_interface {
    network      = kvm_network.lan.name
    ipv4_address = "10.20.0.50"
  }
}

resource "kvm_vm" "second" {
  name       = "second"
  image      = "sim"
  vcpus      = 1
  memory_mib = 512
  disk_mib   = 1024
  network_interface {
    network      = kvm_network.lan.name
    ipv4_address = kvm_vm.first.ipv4_address
  }
}
`,
			ExpectError: regexp.MustCompile(`(?s)IPv4 Address Already Taken.*held\s+by\s+VM\s+first`),
		}},
	})
}

// An overlay network: vni and mtu come from the control plane when left
// out, and either one changed replaces the network.
func TestAccNetwork_overlay(t *testing.T) {
	f := newFleet(t, "node-a")
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkNetworksGone("ovl"),
		Steps: []resource.TestStep{
			{
				Config: networkConfig(f, `
  name = "ovl"
  mode = "overlay"
  cidr = "10.70.0.0/24"
`),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(netAddr, plancheck.ResourceActionCreate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(netAddr, tfjsonpath.New("vni"), knownvalue.Int64Exact(4096)),
					statecheck.ExpectKnownValue(netAddr, tfjsonpath.New("mtu"), knownvalue.Int64Exact(1450)),
					statecheck.ExpectKnownValue(netAddr, tfjsonpath.New("gateway"), knownvalue.StringExact("10.70.0.1")),
					statecheck.ExpectKnownValue(netAddr, tfjsonpath.New("dhcp"), knownvalue.Bool(true)),
					statecheck.ExpectKnownValue(netAddr, tfjsonpath.New("addresses_total"), knownvalue.Int64Exact(253)),
				},
			},
			{
				ResourceName:                         netAddr,
				ImportState:                          true,
				ImportStateId:                        "ovl",
				ImportStateVerify:                    true,
				ImportStateVerifyIdentifierAttribute: "name",
			},
			{
				// The computed vni written down changes nothing.
				Config: networkConfig(f, `
  name = "ovl"
  mode = "overlay"
  cidr = "10.70.0.0/24"
  vni  = 4096
`),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
			},
			{
				Config: networkConfig(f, `
  name = "ovl"
  mode = "overlay"
  cidr = "10.70.0.0/24"
  vni  = 70000
  mtu  = 8950
`),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(netAddr, plancheck.ResourceActionDestroyBeforeCreate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(netAddr, tfjsonpath.New("vni"), knownvalue.Int64Exact(70000)),
					statecheck.ExpectKnownValue(netAddr, tfjsonpath.New("mtu"), knownvalue.Int64Exact(8950)),
				},
			},
			{
				Config: networkConfig(f, `
  name = "ovl"
  mode = "overlay"
  cidr = "10.70.0.0/24"
  mtu  = 9000
`),
				ExpectError: regexp.MustCompile(`(?s)mtu.*576 and 8950`),
			},
			{
				Config: networkConfig(f, `
  name = "lan"
  mode = "nat"
  cidr = "10.71.0.0/24"
  vni  = 5000
`),
				ExpectError: regexp.MustCompile(`(?s)only an overlay network`),
			},
		},
	})
}

// A network without vni and mtu (nat) keeps them null.
func TestAccNetwork_natHasNoVNI(t *testing.T) {
	f := newFleet(t, "node-a")
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkNetworksGone("lan"),
		Steps: []resource.TestStep{{
			Config: networkConfig(f, `
  name = "lan"
  mode = "nat"
  cidr = "10.72.0.0/24"
`),
			ConfigPlanChecks: resource.ConfigPlanChecks{PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}},
			ConfigStateChecks: []statecheck.StateCheck{
				statecheck.ExpectKnownValue(netAddr, tfjsonpath.New("vni"), knownvalue.Null()),
				statecheck.ExpectKnownValue(netAddr, tfjsonpath.New("mtu"), knownvalue.Null()),
			},
		}},
	})
}
