package provider_test

import (
	"context"
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
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// The warm shape of the QEMU warm pool test: the busybox guest at 128 MiB.
const warmPoolConfig = `
  warm_pool = [{
    image      = "busybox"
    vcpus      = 1
    memory_mib = 128
    disk_mib   = 64
    size       = 2
  }]
`

// waitWarmReady is a check that polls the control API until the host shows
// n ready warm VMs of the busybox shape (bounded: 4 minutes of TCG boots).
func waitWarmReady(f *fleet, host string, n int) resource.TestCheckFunc {
	return func(*terraform.State) error {
		ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
		defer cancel()
		var last api.Host
		for {
			h, err := f.Control.Client.GetHost(ctx, host)
			if err == nil {
				last = h
				for _, p := range h.WarmPool {
					if p.Image == "busybox" && p.MemoryMiB == 128 && p.Ready >= n {
						return nil
					}
				}
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("host %s never reported %d ready warm VMs; its warm_pool: %+v", host, n, last.WarmPool)
			case <-time.After(500 * time.Millisecond):
			}
		}
	}
}

// checkStartedFrom counts the started_from values of the kvm_vm.w
// instances: exactly warm warm starts and cold cold starts.
func checkStartedFrom(count, warm, cold int) resource.TestCheckFunc {
	return func(s *terraform.State) error {
		got := map[string]int{}
		for i := range count {
			addr := fmt.Sprintf("kvm_vm.w.%d", i)
			rs, ok := s.RootModule().Resources[addr]
			if !ok {
				return fmt.Errorf("%s is not in state", addr)
			}
			got[rs.Primary.Attributes["started_from"]]++
		}
		if got[api.StartedWarm] != warm || got[api.StartedCold] != cold {
			return fmt.Errorf("started_from of the %d VMs = %v, want %d warm and %d cold", count, got, warm, cold)
		}
		return nil
	}
}

// TestAccHost_warmPoolQEMU: a kvm_host with a warm pool of 2 for the busybox
// shape on a real QEMU agent; once both are ready, three kvm_vm creates of
// that shape start two warm and one cold. Removing warm_pool empties it.
func TestAccHost_warmPoolQEMU(t *testing.T) {
	accPreCheck(t)
	f := &fleet{Control: testenv.StartControl(t, testenv.ControlOptions{}), Agents: map[string]*testenv.Agent{}}
	a := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu"})
	f.Agents["q1"] = a
	// Two cores here: overcommit vCPUs so that 3 VMs and 2 warm VMs fit.
	hostCfg := func(extra string) string { return hostConfig(f, "q1", a.Address, "  cpu_allocation_ratio = 8\n"+extra) }
	vms := `
resource "kvm_vm" "w" {
  count      = 3
  name       = "warm-${count.index}"
  image      = "busybox"
  vcpus      = 1
  memory_mib = 128
  disk_mib   = 64
  host       = kvm_host.test.name
}

data "kvm_host" "q1" {
  name       = kvm_host.test.name
  depends_on = [kvm_vm.w]
}
`
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkHostsGone("q1"),
		Steps: []resource.TestStep{
			{
				Config: hostCfg(warmPoolConfig),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(hostAddr, tfjsonpath.New("warm_pool"), knownvalue.ListExact([]knownvalue.Check{
						knownvalue.ObjectExact(map[string]knownvalue.Check{
							"image": knownvalue.StringExact("busybox"), "vcpus": knownvalue.Int64Exact(1),
							"memory_mib": knownvalue.Int64Exact(128), "disk_mib": knownvalue.Int64Exact(64),
							"size": knownvalue.Int64Exact(2),
						}),
					})),
				},
				Check: waitWarmReady(f, "q1", 2),
			},
			{
				Config: hostCfg(warmPoolConfig) + vms,
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue("data.kvm_host.q1", tfjsonpath.New("warm_pool").AtSliceIndex(0).AtMapKey("size"),
						knownvalue.Int64Exact(2)),
					statecheck.ExpectKnownValue("data.kvm_host.q1", tfjsonpath.New("warm_pool").AtSliceIndex(0).AtMapKey("ready"),
						knownvalue.NotNull()),
				},
				Check: checkStartedFrom(3, 2, 1),
			},
			{
				// Removing warm_pool changes the host in place and empties the agent's pool.
				Config: hostCfg(""),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(hostAddr, plancheck.ResourceActionUpdate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(hostAddr, tfjsonpath.New("warm_pool"), knownvalue.Null()),
				},
				Check: func(*terraform.State) error {
					pool, err := a.Client.Pool(context.Background())
					if err != nil {
						return err
					}
					for _, p := range pool {
						if p.Size != 0 {
							return fmt.Errorf("agent pool after warm_pool was removed: %+v, want no targets", pool)
						}
					}
					return nil
				},
			},
		},
	})
}

// TestAccPlacement_warmPreference: kvm_placement shows the warm
// preference: of two equal sim hosts, the one with a ready warm VM of the
// shape is chosen, with a note and its warm_ready count.
func TestAccPlacement_warmPreference(t *testing.T) {
	f := newFleet(t, "alpha", "beta")
	ctx := ctxT(t)
	warm := []api.WarmPoolTarget{{Image: "sim", VCPUs: 1, MemoryMiB: 512, DiskMiB: 1024, Size: 1}}
	if _, err := f.Control.Client.PutHost(ctx, "beta", api.HostPut{Address: f.Agents["beta"].Address, WarmPool: warm}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "beta reports a ready warm VM", func(ctx context.Context) (bool, error) {
		h, err := f.Control.Client.GetHost(ctx, "beta")
		return err == nil && len(h.WarmPool) == 1 && h.WarmPool[0].Ready == 1, err
	})
	cfg := f.providerBlock() + `
data "kvm_placement" "warm" {
  image      = "sim"
  vcpus      = 1
  memory_mib = 512
  disk_mib   = 1024
}

data "kvm_placement" "other_shape" {
  image      = "sim"
  vcpus      = 2
  memory_mib = 512
  disk_mib   = 1024
}
`
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		Steps: []resource.TestStep{{
			Config: cfg,
			ConfigStateChecks: []statecheck.StateCheck{
				statecheck.ExpectKnownValue("data.kvm_placement.warm", tfjsonpath.New("chosen_host"), knownvalue.StringExact("beta")),
				statecheck.ExpectKnownValue("data.kvm_placement.warm", tfjsonpath.New("note"),
					knownvalue.StringRegexp(regexp.MustCompile(`^warm preference decided: host beta has 1 ready warm VMs`))),
				statecheck.ExpectKnownValue("data.kvm_placement.warm", tfjsonpath.New("ranked"), knownvalue.ListExact([]knownvalue.Check{
					knownvalue.ObjectPartial(map[string]knownvalue.Check{"host": knownvalue.StringExact("beta"), "warm_ready": knownvalue.Int64Exact(1)}),
					knownvalue.ObjectPartial(map[string]knownvalue.Check{"host": knownvalue.StringExact("alpha"), "warm_ready": knownvalue.Int64Exact(0)}),
				})),
				statecheck.ExpectKnownValue("data.kvm_placement.other_shape", tfjsonpath.New("chosen_host"), knownvalue.StringExact("alpha")),
				statecheck.ExpectKnownValue("data.kvm_placement.other_shape", tfjsonpath.New("note"), knownvalue.Null()),
			},
		}},
	})
}
