package provider_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
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
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// migQEMUHost starts a real QEMU agent (TCG) with room for a few small
// busybox guests; register names it as a host now ("" leaves that to the
// test's kvm_host resource).
func migQEMUHost(t *testing.T, f *fleet, register string) *testenv.Agent {
	t.Helper()
	a := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu", VCPUs: 12, MemoryMiB: 4096, DiskMiB: 20000})
	if register != "" {
		f.Control.RegisterHost(t, register, a.Address)
		f.Agents[register] = a
	}
	return a
}

// migQEMUControl is a control API for busy TCG agents on a shared
// machine: an agent that answers slowly while its guests boot is not dead.
func migQEMUControl(t *testing.T) *fleet {
	t.Helper()
	accPreCheck(t)
	return &fleet{Control: testenv.StartControl(t, testenv.ControlOptions{AgentTimeout: 30 * time.Second, DeadAfter: 20}),
		Agents: map[string]*testenv.Agent{}}
}

// migWaitBooted waits until every VM on host (by the control API) printed
// its ready line: a guest migrated before it booted would prove less. Then
// it waits until the other hosts are alive again, as a drain needs.
func (f *fleet) migWaitBooted(t *testing.T, host string, others ...string) {
	t.Helper()
	defer func() {
		for _, name := range others {
			for poll := 0; ; poll++ {
				h, err := f.Control.Client.GetHost(context.Background(), name)
				if err == nil && h.Alive {
					break
				}
				if poll == 60 {
					t.Fatalf("host %s not alive after 60 polls (about two minutes): %+v, %v", name, h, err)
				}
				time.Sleep(2 * time.Second)
			}
		}
	}()
	vms, err := f.Control.Client.AllVMs(context.Background(), client.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, vm := range vms {
		if vm.Host != host {
			continue
		}
		// Six TCG guests boot at once on a shared machine: minutes, not
		// waitFor's one.
		for poll := 0; ; poll++ {
			con, err := f.Control.Client.VMConsole(context.Background(), vm.ID, 1<<16)
			if err == nil && strings.Contains(con, "kvm-guest-ready") {
				break
			}
			if poll == 240 {
				t.Fatalf("vm %s on %s has not booted after 240 polls (about 8 minutes): %v; console:\n%s", vm.Name, host, err, tail(con, 1500))
			}
			time.Sleep(2 * time.Second)
		}
	}
}

// migNoReboot checks that every VM runs on its host with the console of
// a guest that came by migration: the target's console starts with the
// migration, so a guest that booted there again would print its ready line.
func (f *fleet) migNoReboot(*terraform.State) error {
	ctx := context.Background()
	vms, err := f.Control.Client.AllVMs(ctx, client.ListOptions{})
	if err != nil {
		return err
	}
	for _, vm := range vms {
		if vm.ObservedState != api.StateRunning {
			return fmt.Errorf("vm %s on %s is %s after the drain; want running", vm.Name, vm.Host, vm.ObservedState)
		}
		if !strings.HasPrefix(vm.Name, "db-0") && !strings.HasPrefix(vm.Name, "web-0") && !strings.HasPrefix(vm.Name, "app-") {
			continue // never moved
		}
		con, err := f.Agents[vm.Host].Client.Console(ctx, vm.ID)
		if err != nil {
			return fmt.Errorf("console of vm %s on %s: %w", vm.Name, vm.Host, err)
		}
		if strings.Contains(con, "kvm-guest-ready") {
			return fmt.Errorf("vm %s booted again on %s instead of migrating live; console:\n%s", vm.Name, vm.Host, tail(con, 1500))
		}
	}
	return nil
}

// Acceptance with real guests: TestAccHost_drain on three QEMU agents
// (TCG) with six running busybox guests, applied by the terraform CLI. The
// drain moves every guest live (none boots again), keeps the caps of one
// per host, finishes (drain_status), and the next plan is empty; undrain
// puts the host back in service.
func TestAccHost_drainQEMU(t *testing.T) {
	f := migQEMUControl(t)
	migQEMUHost(t, f, "h2")
	migQEMUHost(t, f, "h3")
	a := migQEMUHost(t, f, "")
	f.Agents["h1"] = a
	cfg := func(drain, pinned bool) string { return drainConfigOf(f, a.Address, drain, pinned, drainBusyboxShape) }
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkHostsGone("h1"),
		Steps: []resource.TestStep{
			{
				Config: cfg(false, true),
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue("kvm_vm.db-0", tfjsonpath.New("host"), knownvalue.StringExact("h1")),
					statecheck.ExpectKnownValue("kvm_vm.app-3", tfjsonpath.New("host"), knownvalue.StringExact("h1")),
					statecheck.ExpectKnownValue("kvm_host.h1", tfjsonpath.New("drain"), knownvalue.Bool(false)),
				},
			},
			{
				PreConfig: func() { f.migWaitBooted(t, "h1", "h2", "h3") },
				Config:    cfg(true, false),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{
						plancheck.ExpectResourceAction("kvm_host.h1", plancheck.ResourceActionUpdate),
						plancheck.ExpectResourceAction("kvm_vm.db-0", plancheck.ResourceActionNoop),
						plancheck.ExpectResourceAction("kvm_vm.app-0", plancheck.ResourceActionNoop),
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
				Check: resource.ComposeAggregateTestCheckFunc(f.drainedWithCaps, f.migNoReboot),
			},
			{
				// The next plan after the drain: nothing to do.
				Config:             cfg(true, false),
				PlanOnly:           true,
				ExpectNonEmptyPlan: false,
			},
			{
				// Undrain: back in service.
				Config: cfg(false, false),
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue("kvm_host.h1", tfjsonpath.New("drain"), knownvalue.Bool(false)),
					statecheck.ExpectKnownValue("kvm_host.h1", tfjsonpath.New("drain_status").AtMapKey("state"), knownvalue.StringExact("")),
				},
				Check: func(*terraform.State) error {
					h, err := f.Control.Client.GetHost(context.Background(), "h1")
					if err != nil {
						return err
					}
					if !h.Schedulable || h.Drain.State != "" {
						return fmt.Errorf("h1 after undrain: schedulable %t, drain %+v; want schedulable, no drain", h.Schedulable, h.Drain)
					}
					return nil
				},
			},
		},
	})
}

// migUserNetConfig is a busybox guest on the user-mode network "default"
// whose HTTP server (port 80) is forwarded to a host port.
func migUserNetConfig(f *fleet) string {
	return f.providerBlock() + `
resource "kvm_vm" "test" {
  name       = "web-mover"
  image      = "busybox"
  vcpus      = 1
  memory_mib = 128
  disk_mib   = 64

  network_interface {
    network = "default"
    port_forward {
      guest_port = 80
    }
  }
}
`
}

// migHTTPGet fetches http://127.0.0.1:port/ from the guest, retrying for
// a bounded while (the guest's httpd starts once its NIC is up).
func migHTTPGet(port string) (string, error) {
	c := &http.Client{Timeout: 5 * time.Second}
	var last error
	for range 60 {
		resp, err := c.Get("http://" + net.JoinHostPort("127.0.0.1", port) + "/")
		if err == nil {
			body, rerr := io.ReadAll(io.LimitReader(resp.Body, 4096))
			_ = resp.Body.Close()
			if rerr == nil && resp.StatusCode == http.StatusOK {
				return string(body), nil
			}
			err = fmt.Errorf("status %d, %v", resp.StatusCode, rerr)
		}
		last = err
		time.Sleep(time.Second)
	}
	return "", fmt.Errorf("GET http://127.0.0.1:%s/: %w", port, last)
}

// A guest serving HTTP on a user network, migrated through the control
// API: it answers through its new forward on the target, the VM reports
// that forward, and a refresh puts the new host_port in state (no plan).
func TestAccVM_migrateUserNetQEMU(t *testing.T) {
	f := migQEMUControl(t)
	migQEMUHost(t, f, "h1")
	migQEMUHost(t, f, "h2")
	sameID := statecheck.CompareValue(compare.ValuesSame())
	var id, oldPort, oldHost, page string
	var moved api.VM
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{
				Config: migUserNetConfig(f),
				ConfigStateChecks: []statecheck.StateCheck{
					sameID.AddStateValue(vmAddr, tfjsonpath.New("id")),
				},
				Check: resource.ComposeTestCheckFunc(
					captureAttr(vmAddr, "id", &id),
					captureAttr(vmAddr, "host", &oldHost),
					captureAttr(vmAddr, "network_interface.0.port_forward.0.host_port", &oldPort),
					func(*terraform.State) error {
						var err error
						page, err = migHTTPGet(oldPort)
						if err == nil && len(strings.Fields(page)) < 2 {
							err = fmt.Errorf("the guest's page is %q", page)
						}
						return err
					},
				),
			},
			{
				// Migrated through the API behind Terraform's back; the
				// refresh brings the new forward.
				PreConfig: func() {
					var err error
					moved, err = f.Control.Client.MigrateVM(context.Background(), id, "")
					if err != nil {
						t.Fatalf("migrate vm %s: %v", id, err)
					}
				},
				RefreshState: true,
				Check: resource.ComposeTestCheckFunc(
					func(*terraform.State) error {
						if moved.Host == oldHost || len(moved.NetworkInterfaces) != 1 || len(moved.NetworkInterfaces[0].PortForwards) != 1 {
							return fmt.Errorf("migrated vm %s: host %s (was %s), nics %+v", id, moved.Host, oldHost, moved.NetworkInterfaces)
						}
						fw := moved.NetworkInterfaces[0].PortForwards[0]
						if fw.GuestPort != 80 || fw.HostPort == 0 || strconv.Itoa(fw.HostPort) == oldPort {
							return fmt.Errorf("migrated vm %s reports forward %+v; want guest port 80 on a new host port (was %s)", id, fw, oldPort)
						}
						return nil
					},
					resource.TestCheckResourceAttrWith(vmAddr, "host", func(v string) error {
						if v != moved.Host {
							return fmt.Errorf("host in state %s; the vm runs on %s", v, moved.Host)
						}
						return nil
					}),
					resource.TestCheckResourceAttrWith(vmAddr, "network_interface.0.port_forward.0.host_port", func(v string) error {
						if v != strconv.Itoa(moved.NetworkInterfaces[0].PortForwards[0].HostPort) {
							return fmt.Errorf("host_port in state %s; the vm reports %d", v, moved.NetworkInterfaces[0].PortForwards[0].HostPort)
						}
						got, err := migHTTPGet(v)
						if err != nil {
							return fmt.Errorf("through the new forward: %w", err)
						}
						t.Logf("vm %s: %s 127.0.0.1:%s before, %s 127.0.0.1:%s after the migration; it answers %q", id, oldHost, oldPort, moved.Host, v, got)
						// "kvm-guest <hostname> [<address>]": the same guest.
						if !strings.HasPrefix(got, strings.Join(strings.Fields(page)[:2], " ")) {
							return fmt.Errorf("through the new forward the guest answers %q; before the migration %q", got, page)
						}
						return nil
					}),
					f.vmOnHost(&id, "", true),
				),
			},
			{
				// The refreshed state matches the configuration: no plan.
				Config:   migUserNetConfig(f),
				PlanOnly: true,
			},
		},
	})
}
