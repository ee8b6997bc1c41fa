package provider_test

import (
	"context"
	"fmt"
	"strings"
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

// A VM the operator migrates behind Terraform's back shows no change
// (host is computed); a pinned host the user changes migrates the VM in
// place, keeping its id.
func TestAccVM_migrate(t *testing.T) {
	f := newFleet(t, "h1", "h2")
	sameID := statecheck.CompareValue(compare.ValuesSame())
	var id string
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{
				Config: vmConfig(f, "web", "sim", 1, ""),
				ConfigStateChecks: []statecheck.StateCheck{
					sameID.AddStateValue(vmAddr, tfjsonpath.New("id")),
				},
				Check: captureAttr(vmAddr, "id", &id),
			},
			{
				// Moved out of band: the next plan is empty.
				PreConfig: func() {
					if _, err := f.Control.Client.MigrateVM(context.Background(), id, ""); err != nil {
						t.Fatalf("migrate %s behind Terraform's back: %v", id, err)
					}
				},
				Config: vmConfig(f, "web", "sim", 1, ""),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					sameID.AddStateValue(vmAddr, tfjsonpath.New("id")),
				},
				Check: f.vmOnHost(&id, "", true),
			},
			{
				// Pinned to h1: an in-place update that migrates it there.
				Config: vmConfig(f, "web", "sim", 1, `  host = "h1"`),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionUpdate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("host"), knownvalue.StringExact("h1")),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("observed_state"), knownvalue.StringExact("running")),
					sameID.AddStateValue(vmAddr, tfjsonpath.New("id")),
				},
				Check: f.vmOnHost(&id, "h1", false),
			},
			{
				Config: vmConfig(f, "web", "sim", 1, `  host = "h2"`),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionUpdate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("host"), knownvalue.StringExact("h2")),
					sameID.AddStateValue(vmAddr, tfjsonpath.New("id")),
				},
				Check: f.vmOnHost(&id, "h2", false),
			},
		},
	})
}

// vmOnHost checks that VM *id runs on host ("": any) with exactly one
// agent holding a copy, and, when moved, that no migration is left.
func (f *fleet) vmOnHost(id *string, host string, moved bool) resource.TestCheckFunc {
	return func(*terraform.State) error {
		ctx := context.Background()
		vm, err := f.Control.Client.GetVM(ctx, *id)
		if err != nil {
			return err
		}
		if host != "" && vm.Host != host {
			return fmt.Errorf("vm %s is on %s; want %s", *id, vm.Host, host)
		}
		var on []string
		for name, a := range f.Agents {
			if _, err := a.Client.GetVM(ctx, *id); err == nil {
				on = append(on, name)
			}
		}
		if len(on) != 1 || on[0] != vm.Host {
			return fmt.Errorf("vm %s: row on %s, agents with a copy %v", *id, vm.Host, on)
		}
		if moved && vm.Migration != nil {
			return fmt.Errorf("vm %s still migrating: %+v", *id, *vm.Migration)
		}
		return nil
	}
}

// drainConfig is h1 (managed here, drain as given) holding six VMs: db-0
// and web-0 are in groups capped at one VM per host, whose other members
// are pinned to h2 and h3. pinned places the six on h1 (the first step);
// afterwards they are left unpinned, so wherever the drain takes them
// shows no change.
func drainConfig(f *fleet, address string, drain, pinned bool) string {
	return drainConfigOf(f, address, drain, pinned, drainSimShape)
}

// drainSimShape and drainBusyboxShape are the image and size of
// drainConfigOf's VMs: sim, or small real busybox guests.
const (
	drainSimShape     = "  image = \"sim\"\n  vcpus = 1\n  memory_mib = 512\n  disk_mib = 1024\n"
	drainBusyboxShape = "  image = \"busybox\"\n  vcpus = 1\n  memory_mib = 128\n  disk_mib = 64\n"
)

// drainConfigOf is drainConfig with VMs of the given shape.
func drainConfigOf(f *fleet, address string, drain, pinned bool, shape string) string {
	var b strings.Builder
	b.WriteString(f.providerBlock())
	fmt.Fprintf(&b, `
resource "kvm_host" "h1" {
  name    = "h1"
  address = %q
  drain   = %t
}
`, address, drain)
	vm := func(name, host, group string, dependsOnH1 bool) {
		fmt.Fprintf(&b, "resource \"kvm_vm\" %q {\n  name = %q\n%s", name, name, shape)
		if host != "" {
			fmt.Fprintf(&b, "  host = %q\n", host)
		}
		if group != "" {
			fmt.Fprintf(&b, "  constraints {\n    group = %q\n    max_per_domain = 1\n  }\n", group)
		}
		if dependsOnH1 {
			b.WriteString("  depends_on = [kvm_host.h1]\n")
		}
		b.WriteString("}\n")
	}
	onH1 := ""
	if pinned {
		onH1 = "h1"
	}
	vm("db-0", onH1, "db", true)
	vm("web-0", onH1, "web", true)
	for i := range 4 {
		vm(fmt.Sprintf("app-%d", i), onH1, "", true)
	}
	vm("db-1", "h2", "db", false)
	vm("web-1", "h3", "web", false)
	return b.String()
}

// Acceptance: a drain of a host with six VMs, two of them in groups capped
// at one per host across three hosts, moves all of them, keeps the caps,
// and the plan afterwards is empty.
func TestAccHost_drain(t *testing.T) {
	f := newFleet(t, "h2", "h3")
	a := f.startAgent(t)
	f.Agents["h1"] = a
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkHostsGone("h1"),
		Steps: []resource.TestStep{
			{
				Config: drainConfig(f, a.Address, false, true),
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue("kvm_vm.db-0", tfjsonpath.New("host"), knownvalue.StringExact("h1")),
					statecheck.ExpectKnownValue("kvm_host.h1", tfjsonpath.New("drain"), knownvalue.Bool(false)),
				},
			},
			{
				Config: drainConfig(f, a.Address, true, false),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{
						plancheck.ExpectResourceAction("kvm_host.h1", plancheck.ResourceActionUpdate),
						plancheck.ExpectResourceAction("kvm_vm.db-0", plancheck.ResourceActionNoop),
					},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue("kvm_host.h1", tfjsonpath.New("drain"), knownvalue.Bool(true)),
					statecheck.ExpectKnownValue("kvm_host.h1", tfjsonpath.New("drain_status"), knownvalue.ObjectExact(map[string]knownvalue.Check{
						"state": knownvalue.StringExact(api.DrainDrained), "total": knownvalue.Int64Exact(6), "moved": knownvalue.Int64Exact(6),
						"remaining": knownvalue.Int64Exact(0), "failed": knownvalue.ListSizeExact(0),
					})),
				},
				Check: f.drainedWithCaps,
			},
			{
				// A refresh after the drain: still nothing to do.
				Config:   drainConfig(f, a.Address, true, false),
				PlanOnly: true,
			},
			{
				// Back in service before the destroy.
				Config: drainConfig(f, a.Address, false, false),
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue("kvm_host.h1", tfjsonpath.New("drain_status").AtMapKey("state"), knownvalue.StringExact("")),
				},
			},
		},
	})
}

// drainedWithCaps checks that h1 holds no VM, that db-0 went to h3 and
// web-0 to h2 (the only hosts their caps allow), and that every VM has
// one copy, on the host its row names.
func (f *fleet) drainedWithCaps(*terraform.State) error {
	ctx := context.Background()
	vms, err := f.Control.Client.AllVMs(ctx, client.ListOptions{})
	if err != nil {
		return err
	}
	hosts := map[string]string{}
	for _, vm := range vms {
		hosts[vm.Name] = vm.Host
		var on []string
		for name, a := range f.Agents {
			if _, err := a.Client.GetVM(ctx, vm.ID); err == nil {
				on = append(on, name)
			}
		}
		if len(on) != 1 || on[0] != vm.Host || vm.Migration != nil {
			return fmt.Errorf("vm %s: row on %s (migration %+v), agents with a copy %v", vm.Name, vm.Host, vm.Migration, on)
		}
	}
	for name, host := range hosts {
		if host == "h1" {
			return fmt.Errorf("vm %s is still on the drained host h1", name)
		}
	}
	if hosts["db-0"] != "h3" || hosts["web-0"] != "h2" {
		return fmt.Errorf("db-0 went to %s and web-0 to %s; their caps of one per host allow only h3 and h2", hosts["db-0"], hosts["web-0"])
	}
	return nil
}
