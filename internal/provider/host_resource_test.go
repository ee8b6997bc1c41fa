package provider_test

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
)

const hostAddr = "kvm_host.test"

func hostConfig(f *fleet, name, address, extra string) string {
	return f.providerBlock() + fmt.Sprintf(`
resource "kvm_host" "test" {
  name    = %q
  address = %q
%s
}
`, name, address, extra)
}

// checkHostGone is the CheckDestroy of kvm_host tests.
func (f *fleet) checkHostsGone(names ...string) resource.TestCheckFunc {
	return func(s *terraform.State) error {
		for _, name := range names {
			_, err := f.Control.Client.GetHost(context.Background(), name)
			if err == nil {
				return fmt.Errorf("host %s is still registered after destroy", name)
			}
			if !errors.Is(err, client.ErrNotFound) {
				return fmt.Errorf("reading host %s after destroy: %w", name, err)
			}
		}
		return f.checkFleetEmpty(s)
	}
}

func resourcesValue(r api.Resources) knownvalue.Check {
	return knownvalue.ObjectExact(map[string]knownvalue.Check{
		"vcpus":      knownvalue.Int64Exact(r.VCPUs),
		"memory_mib": knownvalue.Int64Exact(r.MemoryMiB),
		"disk_mib":   knownvalue.Int64Exact(r.DiskMiB),
	})
}

func TestAccHost_basic(t *testing.T) {
	f := newFleet(t)
	a := f.startAgent(t)
	full := api.Resources{VCPUs: testHostVCPUs, MemoryMiB: testHostMemoryMiB, DiskMiB: testHostDiskMiB}

	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkHostsGone("node-a", "node-b"),
		Steps: []resource.TestStep{
			{
				Config: hostConfig(f, "node-a", a.Address, ""),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(hostAddr, plancheck.ResourceActionCreate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(hostAddr, tfjsonpath.New("address"), knownvalue.StringExact(a.Address)),
					statecheck.ExpectKnownValue(hostAddr, tfjsonpath.New("schedulable"), knownvalue.Bool(true)),
					statecheck.ExpectKnownValue(hostAddr, tfjsonpath.New("cpu_allocation_ratio"), knownvalue.Float64Exact(1)),
					statecheck.ExpectKnownValue(hostAddr, tfjsonpath.New("memory_reserved_mib"), knownvalue.Int64Exact(0)),
					statecheck.ExpectKnownValue(hostAddr, tfjsonpath.New("labels"), knownvalue.MapSizeExact(0)),
					statecheck.ExpectKnownValue(hostAddr, tfjsonpath.New("alive"), knownvalue.Bool(true)),
					statecheck.ExpectKnownValue(hostAddr, tfjsonpath.New("driver"), knownvalue.StringExact("sim")),
					statecheck.ExpectKnownValue(hostAddr, tfjsonpath.New("images"),
						knownvalue.ListPartial(map[int]knownvalue.Check{0: knownvalue.StringExact("sim")})),
					statecheck.ExpectKnownValue(hostAddr, tfjsonpath.New("capacity"), resourcesValue(full)),
					statecheck.ExpectKnownValue(hostAddr, tfjsonpath.New("allocated"), resourcesValue(api.Resources{})),
					statecheck.ExpectKnownValue(hostAddr, tfjsonpath.New("free"), resourcesValue(full)),
				},
			},
			{
				ResourceName:                         hostAddr,
				ImportState:                          true,
				ImportStateId:                        "node-a",
				ImportStateVerify:                    true,
				ImportStateVerifyIdentifierAttribute: "name",
			},
			{
				// Every argument but the name changes in place.
				Config: hostConfig(f, "node-a", a.Address, `
  labels               = { rack = "r1" }
  schedulable          = false
  cpu_allocation_ratio = 2
  memory_reserved_mib  = 1024
`),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(hostAddr, plancheck.ResourceActionUpdate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(hostAddr, tfjsonpath.New("labels"),
						knownvalue.MapExact(map[string]knownvalue.Check{"rack": knownvalue.StringExact("r1")})),
					statecheck.ExpectKnownValue(hostAddr, tfjsonpath.New("schedulable"), knownvalue.Bool(false)),
					statecheck.ExpectKnownValue(hostAddr, tfjsonpath.New("cpu_allocation_ratio"), knownvalue.Float64Exact(2)),
					statecheck.ExpectKnownValue(hostAddr, tfjsonpath.New("memory_reserved_mib"), knownvalue.Int64Exact(1024)),
					// capacity = (total - reserved) x ratio, ratio on vCPUs only.
					statecheck.ExpectKnownValue(hostAddr, tfjsonpath.New("capacity").AtMapKey("vcpus"),
						knownvalue.Int64Exact(2*testHostVCPUs)),
					statecheck.ExpectKnownValue(hostAddr, tfjsonpath.New("capacity").AtMapKey("memory_mib"),
						knownvalue.Int64Exact(testHostMemoryMiB-1024)),
				},
			},
			{
				Config: hostConfig(f, "node-b", a.Address, `
  labels               = { rack = "r1" }
  schedulable          = false
  cpu_allocation_ratio = 2
  memory_reserved_mib  = 1024
`),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(hostAddr, plancheck.ResourceActionDestroyBeforeCreate)},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(hostAddr, tfjsonpath.New("name"), knownvalue.StringExact("node-b")),
				},
				Check: func(s *terraform.State) error { return f.checkHostsGone("node-a")(s) },
			},
		},
	})
}

func TestAccHost_disappears(t *testing.T) {
	f := newFleet(t)
	a := f.startAgent(t)
	cfg := hostConfig(f, "node-d", a.Address, "")
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkHostsGone("node-d"),
		Steps: []resource.TestStep{
			{
				Config: cfg,
				Check: func(*terraform.State) error {
					return f.Control.Client.DeleteHost(context.Background(), "node-d")
				},
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectResourceAction(hostAddr, plancheck.ResourceActionCreate)},
				},
				ExpectNonEmptyPlan: true,
			},
			{
				Config: cfg,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(hostAddr, plancheck.ResourceActionCreate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
			},
		},
	})
}

func TestAccHost_alreadyRegistered(t *testing.T) {
	f := newFleet(t, "taken")
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		Steps: []resource.TestStep{
			{
				Config:      hostConfig(f, "taken", f.Agents["taken"].Address, ""),
				ExpectError: regexp.MustCompile(`Host "taken" is already registered`),
			},
		},
	})
}

// TestAccHost_deregisterWithVMs: a host with a VM on it cannot be
// deregistered; the error says why, and destroy works once the VM is gone.
func TestAccHost_deregisterWithVMs(t *testing.T) {
	f := newFleet(t)
	a := f.startAgent(t)
	f.Agents["busy"] = a
	cfg := hostConfig(f, "busy", a.Address, "")
	var vmID string
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkHostsGone("busy"),
		Steps: []resource.TestStep{
			{
				Config: cfg,
				Check: func(*terraform.State) error {
					vm, err := f.Control.Client.CreateVM(context.Background(), api.VMCreate{
						Name: "outside", Image: "sim", VCPUs: 1, MemoryMiB: 64, DiskMiB: 64, Host: "busy",
					}, "")
					vmID = vm.ID
					return err
				},
			},
			{
				Config:      f.providerBlock(),
				ExpectError: regexp.MustCompile(`Host "busy" still has VMs placed on it`),
			},
			{
				PreConfig: func() {
					if err := f.Control.Client.DeleteVM(ctxT(t), vmID); err != nil {
						t.Fatalf("deleting VM %s: %v", vmID, err)
					}
				},
				Config: f.providerBlock(),
			},
		},
	})
}

func retireConfig(f *fleet, gone, stays string, retired bool, staysSchedulable bool) string {
	return f.providerBlock() + fmt.Sprintf(`
resource "kvm_host" "gone" {
  name    = "node-gone"
  address = %q
  retired = %t
}

resource "kvm_host" "stays" {
  name        = "node-stays"
  address     = %q
  schedulable = %t
}

resource "kvm_vm" "a" {
  name       = "on-gone"
  image      = "sim"
  vcpus      = 1
  memory_mib = 512
  disk_mib   = 2048
  depends_on = [kvm_host.gone, kvm_host.stays]
}
`, gone, retired, stays, staysSchedulable)
}

// TestAccHost_retire: a host whose agent is gone for good is retired with
// retired = true. The plan shows the change (retired false -> true, and a
// warning naming the VMs it loses); the apply marks its VM lost and
// releases the capacity; the next plan makes that kvm_vm again, on the
// other host; un-retiring is refused at plan time; destroy deregisters
// the retired host.
func TestAccHost_retire(t *testing.T) {
	f := newFleet(t)
	gone, stays := f.startAgent(t), f.startAgent(t)
	const vmAddr = "kvm_vm.a"
	var lostID string
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkHostsGone("node-gone", "node-stays"),
		Steps: []resource.TestStep{
			{
				// node-stays takes no VM yet: the VM lands on node-gone.
				Config: retireConfig(f, gone.Address, stays.Address, false, false),
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("host"), knownvalue.StringExact("node-gone")),
					statecheck.ExpectKnownValue("kvm_host.gone", tfjsonpath.New("retired"), knownvalue.Bool(false)),
					statecheck.ExpectKnownValue("kvm_host.gone", tfjsonpath.New("retired_at"), knownvalue.Null()),
				},
				Check: func(s *terraform.State) error {
					lostID = s.RootModule().Resources[vmAddr].Primary.ID
					return nil
				},
			},
			{
				// The agent of node-gone goes away for good.
				PreConfig: func() {
					gone.Stop()
					deadline := time.Now().Add(time.Minute)
					for {
						h, err := f.Control.Client.GetHost(ctxT(t), "node-gone")
						if err == nil && !h.Alive {
							return
						}
						if time.Now().After(deadline) {
							t.Fatalf("host node-gone still alive a minute after its agent stopped: %+v %v", h, err)
						}
						time.Sleep(100 * time.Millisecond)
					}
				},
				Config: retireConfig(f, gone.Address, stays.Address, true, true),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{
						plancheck.ExpectResourceAction("kvm_host.gone", plancheck.ResourceActionUpdate),
						plancheck.ExpectKnownValue("kvm_host.gone", tfjsonpath.New("retired"), knownvalue.Bool(true)),
						plancheck.ExpectUnknownValue("kvm_host.gone", tfjsonpath.New("retired_at")),
					},
					// Refreshed after the retire, the lost VM is to be made again.
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionCreate)},
				},
				Check: func(*terraform.State) error {
					ctx := ctxT(t)
					vm, err := f.Control.Client.GetVM(ctx, lostID)
					if err != nil {
						return err
					}
					if vm.ObservedState != api.StateLost {
						return fmt.Errorf("vm on the retired host is %s, want lost", vm.ObservedState)
					}
					h, err := f.Control.Client.GetHost(ctx, "node-gone")
					if err != nil {
						return err
					}
					if h.RetiredAt == nil || h.Allocated != (api.Resources{}) {
						return fmt.Errorf("retired host = %+v; want retired_at set and nothing allocated", h)
					}
					return nil
				},
				ExpectNonEmptyPlan: true,
			},
			{
				Config: retireConfig(f, gone.Address, stays.Address, true, true),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionCreate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("host"), knownvalue.StringExact("node-stays")),
					statecheck.ExpectKnownValue("kvm_host.gone", tfjsonpath.New("retired"), knownvalue.Bool(true)),
					statecheck.ExpectKnownValue("kvm_host.gone", tfjsonpath.New("alive"), knownvalue.Bool(false)),
				},
			},
			{
				Config:      retireConfig(f, gone.Address, stays.Address, false, true),
				ExpectError: regexp.MustCompile(`(?s)is retired and cannot return to service`),
			},
		},
	})
}
