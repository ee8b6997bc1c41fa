package provider_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-testing/compare"
	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/provider"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

const vmAddr = "kvm_vm.test"

// vmConfig is one kvm_vm named name with the given extra arguments.
func vmConfig(f *fleet, name, image string, vcpus int, extra string) string {
	return f.providerBlock() + fmt.Sprintf(`
resource "kvm_vm" "test" {
  name       = %q
  image      = %q
  vcpus      = %d
  memory_mib = 512
  disk_mib   = 2048
%s
}
`, name, image, vcpus, extra)
}

func TestAccVM_basic(t *testing.T) {
	f := newFleet(t, "h1")
	sameID := statecheck.CompareValue(compare.ValuesSame())

	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{
				Config: vmConfig(f, "web-1", "sim", 2, `
  labels = { role = "web" }
  timeouts {
    create = "3m"
  }
`),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionCreate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("id"), knownvalue.NotNull()),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("name"), knownvalue.StringExact("web-1")),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("vcpus"), knownvalue.Int64Exact(2)),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("memory_mib"), knownvalue.Int64Exact(512)),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("host"), knownvalue.StringExact("h1")),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("power_state"), knownvalue.StringExact("running")),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("observed_state"), knownvalue.StringExact("running")),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("started_from"), knownvalue.StringExact("cold")),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("secure_boot"), knownvalue.Bool(false)),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("placement_score"), knownvalue.NotNull()),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("placement_summary"),
						knownvalue.StringRegexp(regexp.MustCompile(`^placed on h1 \(score \d+\.\d{5}\)`))),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("created_at"),
						knownvalue.StringRegexp(regexp.MustCompile(`^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$`))),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("labels"),
						knownvalue.MapExact(map[string]knownvalue.Check{"role": knownvalue.StringExact("web")})),
					sameID.AddStateValue(vmAddr, tfjsonpath.New("id")),
				},
				Check: f.checkHostAllocated("h1", api.Resources{VCPUs: 2, MemoryMiB: 512, DiskMiB: 2048}),
			},
			{
				ResourceName:            vmAddr,
				ImportState:             true,
				ImportStateVerify:       true,
				ImportStateVerifyIgnore: []string{"timeouts"},
			},
			{
				// power_state and labels change in place: same id.
				Config: vmConfig(f, "web-1", "sim", 2, `
  power_state = "stopped"
  labels      = { role = "web", tier = "front" }
`),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionUpdate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("power_state"), knownvalue.StringExact("stopped")),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("observed_state"), knownvalue.StringExact("stopped")),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("labels"), knownvalue.MapExact(map[string]knownvalue.Check{
						"role": knownvalue.StringExact("web"), "tier": knownvalue.StringExact("front"),
					})),
					sameID.AddStateValue(vmAddr, tfjsonpath.New("id")),
				},
			},
			{
				// vcpus changes in place too: same id, the host holds the new shape.
				Config: vmConfig(f, "web-1", "sim", 4, `
  power_state = "stopped"
  labels      = { role = "web", tier = "front" }
`),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionUpdate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("vcpus"), knownvalue.Int64Exact(4)),
					sameID.AddStateValue(vmAddr, tfjsonpath.New("id")),
				},
				Check: f.checkHostAllocated("h1", api.Resources{VCPUs: 4, MemoryMiB: 512, DiskMiB: 2048}),
			},
			{
				// A larger disk grows in place too (a new image would replace the
				// VM: TestAccVM_nameAndShapeInPlaceImageReplaces).
				Config: strings.Replace(vmConfig(f, "web-1", "sim", 4, `
  power_state = "stopped"
  labels      = { role = "web", tier = "front" }
`), "disk_mib   = 2048", "disk_mib   = 4096", 1),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionUpdate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("disk_mib"), knownvalue.Int64Exact(4096)),
					sameID.AddStateValue(vmAddr, tfjsonpath.New("id")),
				},
				// The host holds the growth.
				Check: f.checkHostAllocated("h1", api.Resources{VCPUs: 4, MemoryMiB: 512, DiskMiB: 4096}),
			},
		},
	})
}

// checkHostAllocated checks the allocation the control API reports for host.
func (f *fleet) checkHostAllocated(host string, want api.Resources) resource.TestCheckFunc {
	return func(*terraform.State) error {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		h, err := f.Control.Client.GetHost(ctx, host)
		if err != nil {
			return err
		}
		if h.Allocated != want {
			return fmt.Errorf("host %s has %+v allocated, want %+v", host, h.Allocated, want)
		}
		return nil
	}
}

// A new name and a new shape change the VM in place (same id, plan says
// update); a name another VM holds fails naming it and changes nothing; a
// new image replaces the VM.
func TestAccVM_nameAndShapeInPlaceImageReplaces(t *testing.T) {
	accPreCheck(t)
	images := t.TempDir()
	if err := os.MkdirAll(filepath.Join(images, "other"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(images, "other", "image.json"), []byte(`{"name":"other","kind":"kernel"}`), 0o644); err != nil {
		t.Fatal(err)
	}
	f := &fleet{Control: testenv.StartControl(t, testenv.ControlOptions{}), Agents: map[string]*testenv.Agent{}}
	f.addHostWith(t, "h1", testenv.AgentOptions{VCPUs: testHostVCPUs, MemoryMiB: testHostMemoryMiB,
		DiskMiB: testHostDiskMiB, ImageDir: images})
	holder, err := f.Control.Client.CreateVM(ctxT(t), api.VMCreate{Name: "taken", Image: "sim", VCPUs: 1, MemoryMiB: 512, DiskMiB: 512}, "")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Control.Client.DeleteVM(context.Background(), holder.ID) })
	sameID := statecheck.CompareValue(compare.ValuesSame())
	newID := statecheck.CompareValue(compare.ValuesDiffer())
	cfg := func(name, image string, vcpus int, memory int) string {
		return strings.Replace(vmConfig(f, name, image, vcpus, ""), "memory_mib = 512", fmt.Sprintf("memory_mib = %d", memory), 1)
	}
	// The other VM's 1 vCPU, 512 MiB, 512 MiB of disk stay on the host throughout.
	alloc := func(vcpus, memory int64) resource.TestCheckFunc {
		return f.checkHostAllocated("h1", api.Resources{VCPUs: vcpus + 1, MemoryMiB: memory + 512, DiskMiB: 2048 + 512})
	}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		Steps: []resource.TestStep{
			{
				Config: cfg("a", "sim", 1, 512),
				ConfigStateChecks: []statecheck.StateCheck{
					sameID.AddStateValue(vmAddr, tfjsonpath.New("id")),
					newID.AddStateValue(vmAddr, tfjsonpath.New("id")),
				},
				Check: alloc(1, 512),
			},
			{
				Config: cfg("b", "sim", 1, 512),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionUpdate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("name"), knownvalue.StringExact("b")),
					sameID.AddStateValue(vmAddr, tfjsonpath.New("id")),
				},
				Check: alloc(1, 512),
			},
			{
				Config:      cfg("taken", "sim", 1, 512),
				ExpectError: regexp.MustCompile(`(?s)VM Name Already Taken.*` + holder.ID),
			},
			{
				Config: cfg("b", "sim", 3, 2048),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionUpdate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("name"), knownvalue.StringExact("b")),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("vcpus"), knownvalue.Int64Exact(3)),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("memory_mib"), knownvalue.Int64Exact(2048)),
					sameID.AddStateValue(vmAddr, tfjsonpath.New("id")),
				},
				Check: alloc(3, 2048),
			},
			{
				// More than the host has: the apply fails naming the host and
				// what is short, and nothing changes.
				Config:      cfg("b", "sim", 3, testHostMemoryMiB),
				ExpectError: regexp.MustCompile(`(?s)cannot\s+grow\s+to\s+3\s+vCPUs\s+and\s+16384\s+MiB.*host\s+h1\s+has\s+no\s+room.*memory:\s+14336\s+MiB\s+more\s+asked`),
			},
			{
				Config: cfg("b", "sim", 3, 2048),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{sameID.AddStateValue(vmAddr, tfjsonpath.New("id"))},
				Check:             alloc(3, 2048),
			},
			{
				ResourceName:            vmAddr,
				ImportState:             true,
				ImportStateVerify:       true,
				ImportStateVerifyIgnore: []string{"timeouts"},
			},
			{
				Config: cfg("b", "other", 3, 2048),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionDestroyBeforeCreate)},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("image"), knownvalue.StringExact("other")),
					newID.AddStateValue(vmAddr, tfjsonpath.New("id")),
				},
				Check: alloc(3, 2048),
			},
		},
	})
}

func TestAccVM_hostPin(t *testing.T) {
	f := newFleet(t, "h1", "h2")
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{
				Config: vmConfig(f, "pinned", "sim", 1, `host = "h2"`),
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("host"), knownvalue.StringExact("h2")),
				},
				Check: f.checkAgentVMCount("h2", 1),
			},
			{
				// Another pin migrates the VM there in place: the same VM
				// (TestAccVM_migrate checks its id), only on the other host.
				Config: vmConfig(f, "pinned", "sim", 1, `host = "h1"`),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionUpdate)},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("host"), knownvalue.StringExact("h1")),
				},
				Check: resource.ComposeTestCheckFunc(f.checkAgentVMCount("h1", 1), f.checkAgentVMCount("h2", 0)),
			},
			{
				// Dropping the pin keeps the VM where it is.
				Config: vmConfig(f, "pinned", "sim", 1, ""),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("host"), knownvalue.StringExact("h1")),
				},
			},
		},
	})
}

func (f *fleet) checkAgentVMCount(host string, want int) resource.TestCheckFunc {
	return func(*terraform.State) error {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		vms, err := f.Agents[host].Client.ListVMs(ctx)
		if err != nil {
			return err
		}
		if len(vms) != want {
			return fmt.Errorf("agent of host %s has %d VMs, want %d", host, len(vms), want)
		}
		return nil
	}
}

func TestAccVM_disappears(t *testing.T) {
	f := newFleet(t, "h1")
	var id string
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{
				Config: vmConfig(f, "gone", "sim", 1, ""),
				Check: resource.ComposeTestCheckFunc(
					captureAttr(vmAddr, "id", &id),
					func(*terraform.State) error { return f.Control.Client.DeleteVM(context.Background(), id) },
				),
				// Deleted behind Terraform's back: the refresh drops it and
				// the plan creates it again.
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionCreate)},
				},
				ExpectNonEmptyPlan: true,
			},
			{
				Config: vmConfig(f, "gone", "sim", 1, ""),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionCreate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				Check: f.checkAgentVMCount("h1", 1),
			},
		},
	})
}

func TestAccVM_missingOnHostIsRecreated(t *testing.T) {
	f := newFleet(t, "h1")
	var id string
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{
				Config: vmConfig(f, "lost", "sim", 1, ""),
				Check:  captureAttr(vmAddr, "id", &id),
			},
			{
				// The host loses the VM; the control API marks it missing.
				PreConfig: func() {
					ctx := ctxT(t)
					if err := f.Agents["h1"].Client.DeleteVM(ctx, id); err != nil {
						t.Fatalf("deleting VM %s on its agent: %v", id, err)
					}
					waitFor(t, "the control API to mark VM "+id+" missing", func(ctx context.Context) (bool, error) {
						vm, err := f.Control.Client.GetVM(ctx, id)
						return err == nil && vm.ObservedState == api.StateMissing, err
					})
				},
				Config: vmConfig(f, "lost", "sim", 1, ""),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionCreate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("observed_state"), knownvalue.StringExact("running")),
				},
				Check: f.checkAgentVMCount("h1", 1),
			},
		},
	})
}

func TestAccVM_powerStateDrift(t *testing.T) {
	f := newFleet(t, "h1")
	var id string
	sameID := statecheck.CompareValue(compare.ValuesSame())
	cfg := vmConfig(f, "drift", "sim", 1, "")
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{
				Config:            cfg,
				Check:             captureAttr(vmAddr, "id", &id),
				ConfigStateChecks: []statecheck.StateCheck{sameID.AddStateValue(vmAddr, tfjsonpath.New("id"))},
			},
			{
				// Someone stops the VM through the control API.
				PreConfig: func() {
					stopped := api.PowerStopped
					if _, err := f.Control.Client.UpdateVM(ctxT(t), id, api.VMPatch{PowerState: &stopped}); err != nil {
						t.Fatalf("stopping VM %s through the API: %v", id, err)
					}
				},
				Config: cfg,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{
						plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionUpdate),
						plancheck.ExpectKnownValue(vmAddr, tfjsonpath.New("power_state"), knownvalue.StringExact("running")),
					},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("observed_state"), knownvalue.StringExact("running")),
					sameID.AddStateValue(vmAddr, tfjsonpath.New("id")),
				},
				Check: f.checkAgentVMState("h1", &id, api.StateRunning),
			},
		},
	})
}

func TestAccVM_powerStateDriftOnHost(t *testing.T) {
	f := newFleet(t, "h1")
	var id string
	cfg := vmConfig(f, "drift-host", "sim", 1, "")
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{Config: cfg, Check: captureAttr(vmAddr, "id", &id)},
			{
				// The VM stops on its host, behind the control API's back too;
				// the control API's host monitor observes it.
				PreConfig: func() {
					if _, err := f.Agents["h1"].Client.Action(ctxT(t), id, "stop"); err != nil {
						t.Fatalf("stopping VM %s on its agent: %v", id, err)
					}
					waitFor(t, "the control API to observe VM "+id+" stopped", func(ctx context.Context) (bool, error) {
						vm, err := f.Control.Client.GetVM(ctx, id)
						return err == nil && vm.ObservedState == api.StateStopped, err
					})
				},
				Config: cfg,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{
						plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionUpdate),
					},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				Check: f.checkAgentVMState("h1", &id, api.StateRunning),
			},
		},
	})
}

func (f *fleet) checkAgentVMState(host string, id *string, want string) resource.TestCheckFunc {
	return func(*terraform.State) error {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		vm, err := f.Agents[host].Client.GetVM(ctx, *id)
		if err != nil {
			return fmt.Errorf("reading VM %s on agent %s: %w", *id, host, err)
		}
		if vm.State != want {
			return fmt.Errorf("VM %s on agent %s is %s, want %s", *id, host, vm.State, want)
		}
		return nil
	}
}

func TestAccVM_deadHostShowsUnknown(t *testing.T) {
	f := newFleet(t, "h1")
	cfg := vmConfig(f, "orphan", "sim", 1, "")
	hostAlive := func(want bool) func() {
		return func() {
			waitFor(t, fmt.Sprintf("host h1 alive=%v", want), func(ctx context.Context) (bool, error) {
				h, err := f.Control.Client.GetHost(ctx, "h1")
				return err == nil && h.Alive == want, err
			})
		}
	}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{Config: cfg},
			{
				// The agent dies: the VM stays in state, observed unknown, and
				// nothing is planned (Terraform cannot act on a dead host).
				PreConfig: func() {
					f.Agents["h1"].Stop()
					hostAlive(false)()
				},
				RefreshState: true,
				Check: resource.ComposeTestCheckFunc(
					resource.TestCheckResourceAttr(vmAddr, "observed_state", api.StateUnknown),
					resource.TestCheckResourceAttr(vmAddr, "power_state", api.PowerRunning),
				),
			},
			{
				PreConfig: func() {
					f.Agents["h1"].Restart(t)
					hostAlive(true)()
				},
				Config: cfg,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("observed_state"), knownvalue.StringExact("running")),
				},
			},
		},
	})
}

func TestAccVM_idempotentCreateAfterLostAnswer(t *testing.T) {
	f := newFleet(t, "h1")
	lossy := &loseFirstAnswer{path: "/v1/vms", next: http.DefaultTransport}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(provider.WithHTTPClient(&http.Client{Transport: lossy})),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{
				Config: vmConfig(f, "once", "sim", 1, ""),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				Check: resource.ComposeTestCheckFunc(
					f.checkAgentVMCount("h1", 1),
					func(s *terraform.State) error {
						keys := lossy.createKeys()
						if len(keys) != 2 {
							return fmt.Errorf("saw %d creates, want 2 (the lost one and its retry): %q", len(keys), keys)
						}
						if keys[0] == "" || keys[0] != keys[1] {
							return fmt.Errorf("the retry sent Idempotency-Key %q, the first create %q: want the same key", keys[1], keys[0])
						}
						vms, err := f.Control.Client.AllVMs(context.Background(), client.ListOptions{})
						if err != nil {
							return err
						}
						if len(vms) != 1 {
							return fmt.Errorf("the control API has %d VMs, want 1", len(vms))
						}
						return resource.TestCheckResourceAttr(vmAddr, "id", vms[0].ID)(s)
					},
				),
			},
		},
	})
}

// TestAccVM_refreshListsOnce proves that a refresh of many VMs costs one list
// call per provider instance, not one GET per VM.
func TestAccVM_refreshListsOnce(t *testing.T) {
	const n = 25
	f := newFleet(t)
	f.addHostWith(t, "h1", testenv.AgentOptions{VCPUs: 64, MemoryMiB: 65536, DiskMiB: 65536})
	var (
		mu       sync.Mutex
		counters []*requestCounter
	)
	cfg := f.providerBlock() + fmt.Sprintf(`
resource "kvm_vm" "many" {
  count      = %d
  name       = "many-${count.index}"
  image      = "sim"
  vcpus      = 1
  memory_mib = 64
  disk_mib   = 64
}
`, n)
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: countingFactories(&mu, &counters),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{
				Config: cfg,
				Check:  resource.TestCheckResourceAttr("kvm_vm.many.24", "observed_state", "running"),
			},
			{
				PreConfig: func() {
					mu.Lock()
					counters = nil
					mu.Unlock()
				},
				Config: cfg,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				Check: func(*terraform.State) error {
					mu.Lock()
					defer mu.Unlock()
					lists, gets := 0, 0
					for i, c := range counters {
						l, g := c.count("GET /v1/vms"), c.count("GET /v1/vms/{id}")
						if l > 1 {
							return fmt.Errorf("provider instance %d listed VMs %d times in one command, want at most once", i, l)
						}
						lists, gets = lists+l, gets+g
					}
					if lists == 0 {
						return fmt.Errorf("no provider instance listed VMs during a refresh of %d VMs", n)
					}
					if gets != 0 {
						return fmt.Errorf("refreshing %d VMs made %d single-VM GETs (and %d lists), want 0", n, gets, lists)
					}
					return nil
				},
			},
		},
	})
}

// TestAccVM_qemuGuest boots a real guest with QEMU (TCG on this machine),
// stops it in place, and destroys it.
func TestAccVM_qemuGuest(t *testing.T) {
	accPreCheck(t)
	f := &fleet{Control: testenv.StartControl(t, testenv.ControlOptions{}), Agents: map[string]*testenv.Agent{}}
	a := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu"})
	f.Control.RegisterHost(t, "q1", a.Address)
	f.Agents["q1"] = a

	var id string
	cfg := func(power string) string {
		return f.providerBlock() + fmt.Sprintf(`
resource "kvm_vm" "test" {
  name        = "guest"
  image       = "busybox"
  vcpus       = 1
  memory_mib  = 256
  disk_mib    = 256
  power_state = %q
}
`, power)
	}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{
				Config: cfg("running"),
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("host"), knownvalue.StringExact("q1")),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("observed_state"), knownvalue.StringExact("running")),
				},
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				Check: resource.ComposeTestCheckFunc(
					captureAttr(vmAddr, "id", &id),
					func(*terraform.State) error { return waitForConsole(a, id, "kvm-guest-ready") },
				),
			},
			{
				Config: cfg("stopped"),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionUpdate)},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("observed_state"), knownvalue.StringExact("stopped")),
				},
				Check: f.checkAgentVMState("q1", &id, api.StateStopped),
			},
		},
	})
}

// waitForConsole waits until the guest's serial console shows line.
func waitForConsole(a *testenv.Agent, id, line string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var last string
	for {
		out, err := a.Client.Console(ctx, id)
		if err == nil && strings.Contains(out, line) {
			return nil
		}
		if err == nil {
			last = out
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("guest %s never printed %q; its console ends with:\n%s", id, line, tail(last, 2000))
		case <-time.After(time.Second):
		}
	}
}

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[len(s)-n:]
}

// failingReads answers every GET with 503 while on, as a control API that is
// briefly unavailable would.
type failingReads struct {
	next http.RoundTripper
	on   atomic.Bool
}

func (f *failingReads) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Method != http.MethodGet || !f.on.Load() {
		return f.next.RoundTrip(req)
	}
	body := `{"error":{"code":"unavailable","message":"injected: the control API is briefly unavailable"}}`
	return &http.Response{
		StatusCode: http.StatusServiceUnavailable, Status: "503 Service Unavailable",
		Header:  http.Header{"Content-Type": []string{"application/json"}},
		Body:    io.NopCloser(strings.NewReader(body)),
		Request: req,
	}, nil
}

// TestAccVM_readErrorKeepsState: a refresh that cannot reach the control API
// fails with an error and never drops the VM from state.
func TestAccVM_readErrorKeepsState(t *testing.T) {
	f := newFleet(t, "h1")
	fail := &failingReads{next: http.DefaultTransport}
	sameID := statecheck.CompareValue(compare.ValuesSame())
	cfg := vmConfig(f, "steady", "sim", 1, "")
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(provider.WithHTTPClient(&http.Client{Transport: fail})),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{
				Config:            cfg,
				ConfigStateChecks: []statecheck.StateCheck{sameID.AddStateValue(vmAddr, tfjsonpath.New("id"))},
			},
			{
				PreConfig:   func() { fail.on.Store(true) },
				Config:      cfg,
				ExpectError: regexp.MustCompile(`(?s)Unable to Read VM.*did not answer successfully`),
			},
			{
				PreConfig: func() { fail.on.Store(false) },
				Config:    cfg,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{sameID.AddStateValue(vmAddr, tfjsonpath.New("id"))},
				Check:             f.checkAgentVMCount("h1", 1),
			},
		},
	})
}

// secure_boot on a VM whose image boots with bios is refused at create,
// with what to set, and nothing is left.
func TestAccVM_secureBootNeedsAUEFIImage(t *testing.T) {
	f := newFleet(t, "h1")
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{{
			Config:      vmConfig(f, "sb-1", "sim", 1, "  secure_boot = true\n"),
			ExpectError: regexp.MustCompile(`secure_boot needs a uefi image`),
			Check:       f.checkFleetEmpty,
		}},
	})
}
