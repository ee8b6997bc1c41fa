package provider_test

import (
	"context"
	"fmt"
	"regexp"
	"testing"

	"github.com/hashicorp/terraform-plugin-testing/compare"
	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
)

// rackFleet is a fleet of h1, h2, h3 labelled rack=a, b, c.
func rackFleet(t *testing.T) *fleet {
	t.Helper()
	f := newFleet(t, "h1", "h2", "h3")
	for name, rack := range map[string]string{"h1": "a", "h2": "b", "h3": "c"} {
		f.setLabels(t, name, map[string]string{"rack": rack})
	}
	return f
}

func (f *fleet) setLabels(t *testing.T, host string, labels map[string]string) {
	t.Helper()
	if _, err := f.Control.Client.PutHost(ctxT(t), host, api.HostPut{Address: f.Agents[host].Address, Labels: labels}); err != nil {
		t.Fatal(err)
	}
}

func TestAccVM_constraints(t *testing.T) {
	f := rackFleet(t)
	sameID := statecheck.CompareValue(compare.ValuesSame())
	constraints := func(rack string) string {
		return fmt.Sprintf(`
  constraints {
    host_labels    = { rack = %q }
    group          = "web"
    spread_by      = "label:rack"
    max_per_domain = 2
  }
`, rack)
	}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{
				Config: vmConfig(f, "web-1", "sim", 1, constraints("b")),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionCreate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("host"), knownvalue.StringExact("h2")),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("constraints"), knownvalue.ObjectExact(map[string]knownvalue.Check{
						"host_labels":    knownvalue.MapExact(map[string]knownvalue.Check{"rack": knownvalue.StringExact("b")}),
						"group":          knownvalue.StringExact("web"),
						"spread_by":      knownvalue.StringExact("label:rack"),
						"max_per_domain": knownvalue.Int64Exact(2),
					})),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("constraints_violated"), knownvalue.StringExact("")),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("placement_summary"),
						knownvalue.StringRegexp(regexp.MustCompile(`h1: labels; h3: labels$`))),
					sameID.AddStateValue(vmAddr, tfjsonpath.New("id")),
				},
			},
			{
				// Import reads the constraints back from the API.
				ResourceName:            vmAddr,
				ImportState:             true,
				ImportStateVerify:       true,
				ImportStateVerifyIgnore: []string{"timeouts"},
			},
			{
				// New constraints are an update in place: stored, the VM
				// stays on h2, and the mismatch is reported.
				Config: vmConfig(f, "web-1", "sim", 1, constraints("c")),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{
						plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionUpdate),
						plancheck.ExpectKnownValue(vmAddr, tfjsonpath.New("host"), knownvalue.StringExact("h2")),
						plancheck.ExpectKnownValue(vmAddr, tfjsonpath.New("id"), knownvalue.NotNull()),
					},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("host"), knownvalue.StringExact("h2")),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("constraints").AtMapKey("host_labels"),
						knownvalue.MapExact(map[string]knownvalue.Check{"rack": knownvalue.StringExact("c")})),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("constraints_violated"),
						knownvalue.StringExact("host h2 no longer has label rack=c (now rack=b)")),
					sameID.AddStateValue(vmAddr, tfjsonpath.New("id")),
				},
				Check: f.checkVMsOn(map[string]string{"web-1": "h2"}),
			},
			{
				// Removing the block clears them, in place as well.
				Config: vmConfig(f, "web-1", "sim", 1, ""),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionUpdate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("constraints"), knownvalue.Null()),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("constraints_violated"), knownvalue.StringExact("")),
					sameID.AddStateValue(vmAddr, tfjsonpath.New("id")),
				},
			},
		},
	})
}

// checkVMsOn checks, through the API, which host each named VM runs on.
func (f *fleet) checkVMsOn(want map[string]string) resource.TestCheckFunc {
	return func(*terraform.State) error {
		vms, err := f.Control.Client.AllVMs(context.Background(), client.ListOptions{})
		if err != nil {
			return err
		}
		got := map[string]string{}
		for _, vm := range vms {
			got[vm.Name] = vm.Host
		}
		for name, host := range want {
			if got[name] != host {
				return fmt.Errorf("VM %s is on %q, want %q (all: %v)", name, got[name], host, got)
			}
		}
		return nil
	}
}

// Three VMs of one group with strict anti-affinity land on three hosts; a
// fourth is refused with group_cap named for every host.
func TestAccVM_constraintsAntiAffinity(t *testing.T) {
	f := rackFleet(t)
	config := func(n int) string {
		return f.providerBlock() + fmt.Sprintf(`
resource "kvm_vm" "db" {
  count      = %d
  name       = "db-${count.index}"
  image      = "sim"
  vcpus      = 1
  memory_mib = 512
  disk_mib   = 1024
  constraints {
    group          = "db"
    spread_by      = "host"
    max_per_domain = 1
  }
}
`, n)
	}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{
				Config: config(3),
				Check:  f.checkDistinctHosts("db-0", "db-1", "db-2"),
			},
			{
				Config:      config(4),
				ExpectError: regexp.MustCompile(`(?s)h1: group_cap.*h2: group_cap.*h3: group_cap`),
			},
		},
	})
}

func (f *fleet) checkDistinctHosts(names ...string) resource.TestCheckFunc {
	return func(*terraform.State) error {
		vms, err := f.Control.Client.AllVMs(context.Background(), client.ListOptions{})
		if err != nil {
			return err
		}
		seen := map[string]string{}
		for _, vm := range vms {
			if prev, ok := seen[vm.Host]; ok {
				return fmt.Errorf("VMs %s and %s share host %s", prev, vm.Name, vm.Host)
			}
			seen[vm.Host] = vm.Name
		}
		if len(vms) != len(names) {
			return fmt.Errorf("%d VMs, want %d", len(vms), len(names))
		}
		return nil
	}
}

func TestAccVM_constraintsBadInput(t *testing.T) {
	f := newFleet(t, "h1")
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{
				Config:      vmConfig(f, "bad", "sim", 1, "constraints {\n max_per_domain = 1\n}"),
				ExpectError: regexp.MustCompile(`(?s)"constraints.group" must be specified.*"constraints.max_per_domain"`),
			},
			{
				Config:      vmConfig(f, "bad", "sim", 1, "constraints {\n group = \"g\"\n spread_by = \"rack\"\n}"),
				ExpectError: regexp.MustCompile(`(?s)constraints.spread_by.*host.*label:<key>`),
			},
			{
				Config:      vmConfig(f, "bad", "sim", 1, "constraints {\n group = \"g\"\n max_per_domain = -1\n}"),
				ExpectError: regexp.MustCompile(`(?s)max_per_domain.*between 0 and 100000`),
			},
		},
	})
}

// kvm_host changes labels in place, and a VM whose host no longer matches
// its host_labels reports it on the next refresh, still on that host.
func TestAccHost_labelsInPlaceReportViolation(t *testing.T) {
	f := newFleet(t)
	agent := f.startAgent(t)
	config := func(rack string) string {
		return f.providerBlock() + fmt.Sprintf(`
resource "kvm_host" "test" {
  name    = "h9"
  address = %q
  labels  = { rack = %q }
}

resource "kvm_vm" "test" {
  name       = "on-rack-a"
  image      = "sim"
  vcpus      = 1
  memory_mib = 512
  disk_mib   = 1024
  constraints {
    host_labels = { rack = "a" }
  }
  depends_on = [kvm_host.test]
}
`, agent.Address, rack)
	}
	sameHost := statecheck.CompareValue(compare.ValuesSame())
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkHostsGone("h9"),
		Steps: []resource.TestStep{
			{
				Config: config("a"),
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("host"), knownvalue.StringExact("h9")),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("constraints_violated"), knownvalue.StringExact("")),
					sameHost.AddStateValue(vmAddr, tfjsonpath.New("id")),
				},
			},
			{
				Config: config("b"),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{
						plancheck.ExpectResourceAction(hostAddr, plancheck.ResourceActionUpdate),
						plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionNoop),
					},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(hostAddr, tfjsonpath.New("labels"),
						knownvalue.MapExact(map[string]knownvalue.Check{"rack": knownvalue.StringExact("b")})),
					sameHost.AddStateValue(vmAddr, tfjsonpath.New("id")),
				},
			},
			{
				RefreshState: true,
				Check: resource.ComposeAggregateTestCheckFunc(
					resource.TestCheckResourceAttr(vmAddr, "host", "h9"),
					resource.TestCheckResourceAttr(vmAddr, "observed_state", "running"),
					resource.TestCheckResourceAttr(vmAddr, "constraints_violated", "host h9 no longer has label rack=a (now rack=b)"),
				),
			},
		},
	})
}

func TestAccPlacement_constraints(t *testing.T) {
	f := rackFleet(t)
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		Steps: []resource.TestStep{
			{
				Config: f.providerBlock() + `
data "kvm_placement" "test" {
  image      = "sim"
  vcpus      = 1
  memory_mib = 512
  disk_mib   = 1024
  constraints {
    host_labels = { rack = "c" }
  }
}
`,
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue("data.kvm_placement.test", tfjsonpath.New("chosen_host"), knownvalue.StringExact("h3")),
					statecheck.ExpectKnownValue("data.kvm_placement.test", tfjsonpath.New("rejected"), knownvalue.ListExact([]knownvalue.Check{
						knownvalue.ObjectExact(map[string]knownvalue.Check{"host": knownvalue.StringExact("h1"),
							"reason": knownvalue.StringExact("labels"), "detail": knownvalue.StringExact("labels: needs rack=c, has rack=a")}),
						knownvalue.ObjectExact(map[string]knownvalue.Check{"host": knownvalue.StringExact("h2"),
							"reason": knownvalue.StringExact("labels"), "detail": knownvalue.StringExact("labels: needs rack=c, has rack=b")}),
					})),
				},
			},
		},
	})
}

func TestAccFork_constraintsSpreadChildren(t *testing.T) {
	f := rackFleet(t)
	spread := `
  placement = "colocate"
  constraints {
    spread_by      = "host"
    max_per_domain = 1
  }
`
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{
				Config: forkConfig(f, 1, 3, spread),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(forkAddr, tfjsonpath.New("children"), knownvalue.ListExact([]knownvalue.Check{
						child("h1"), child("h2"), child("h3"),
					})),
					statecheck.ExpectKnownValue(forkAddr, tfjsonpath.New("constraints"), knownvalue.ObjectExact(map[string]knownvalue.Check{
						"host_labels": knownvalue.Null(), "group": knownvalue.Null(),
						"spread_by": knownvalue.StringExact("host"), "max_per_domain": knownvalue.Int64Exact(1),
					})),
				},
			},
			{
				ResourceName:            forkAddr,
				ImportState:             true,
				ImportStateVerify:       true,
				ImportStateVerifyIgnore: []string{"timeouts"},
			},
			{
				// Lifting the cap is an update in place: the children stay.
				Config: forkConfig(f, 1, 3, `
  placement = "colocate"
  constraints {
    spread_by = "host"
  }
`),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(forkAddr, plancheck.ResourceActionUpdate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(forkAddr, tfjsonpath.New("children"), knownvalue.ListExact([]knownvalue.Check{
						child("h1"), child("h2"), child("h3"),
					})),
				},
			},
		},
	})
}
