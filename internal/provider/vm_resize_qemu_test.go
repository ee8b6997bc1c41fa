package provider_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
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
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// guestBoot is what the busybox guest printed on one boot.
type guestBoot struct {
	memoryKB int64
	cpus     int64
	marker   string
}

var (
	bootLine   = regexp.MustCompile(`(?m)^kvm-guest-ready\r?$`)
	memoryLine = regexp.MustCompile(`(?m)^kvm-guest-memory (\d+) kB\r?$`)
	cpusLine   = regexp.MustCompile(`(?m)^kvm-guest-cpus (\d+)\r?$`)
	markerLine = regexp.MustCompile(`(?m)^kvm-guest-disk-marker vda (\S+)\r?$`)
)

// waitForBoot waits until the guest's console shows its n-th boot with its
// shape report, and returns what that boot printed.
func waitForBoot(a *testenv.Agent, id string, n int) (guestBoot, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var last string
	for {
		out, err := a.Client.Console(ctx, id)
		if err == nil {
			last = out
			boots := bootLine.FindAllStringIndex(out, -1)
			if len(boots) > n {
				return guestBoot{}, fmt.Errorf("guest %s booted %d times, want %d; its console ends with:\n%s", id, len(boots), n, tail(out, 2000))
			}
			if len(boots) == n {
				this := out[boots[n-1][0]:]
				mem, cpus := memoryLine.FindStringSubmatch(this), cpusLine.FindStringSubmatch(this)
				if mem != nil && cpus != nil {
					b := guestBoot{}
					b.memoryKB, _ = strconv.ParseInt(mem[1], 10, 64)
					b.cpus, _ = strconv.ParseInt(cpus[1], 10, 64)
					if m := markerLine.FindStringSubmatch(this); m != nil {
						b.marker = m[1]
					}
					return b, nil
				}
			}
		}
		select {
		case <-ctx.Done():
			return guestBoot{}, fmt.Errorf("guest %s never finished boot %d; its console ends with:\n%s", id, n, tail(last, 2000))
		case <-time.After(time.Second):
		}
	}
}

// writeDiskMarker writes marker at the start of the stopped VM's disk with
// qemu-io, as a user's data on the disk.
func writeDiskMarker(a *testenv.Agent, id, marker string) error {
	src := filepath.Join(os.TempDir(), "kvm-marker-"+id)
	buf := make([]byte, 512)
	copy(buf, marker)
	if err := os.WriteFile(src, buf, 0o600); err != nil {
		return err
	}
	defer func() { _ = os.Remove(src) }()
	disk := filepath.Join(a.StateDir, "vms", id, "disk.qcow2")
	out, err := exec.Command("qemu-io", "-f", "qcow2", "-c", "write -s "+src+" 0 512", disk).CombinedOutput()
	if err != nil {
		return fmt.Errorf("qemu-io write marker to %s: %v: %s", disk, err, out)
	}
	return nil
}

// TestAccVM_qemuResizeInPlace changes a real guest (QEMU, TCG here) through
// Terraform: a marker is written to its disk, then memory is raised and
// vCPUs lowered and raised. Each plan is an update, the VM keeps its id,
// the guest reports its new shape after its restart, the marker is still on
// its disk, and the host's allocation is the VM's shape. A growth past the
// host fails with the reason and leaves the guest running untouched.
func TestAccVM_qemuResizeInPlace(t *testing.T) {
	accPreCheck(t)
	f := &fleet{Control: testenv.StartControl(t, testenv.ControlOptions{}), Agents: map[string]*testenv.Agent{}}
	// 1 GiB of advertised memory: 4 GiB cannot fit.
	a := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu", VCPUs: 4, MemoryMiB: 1024})
	f.Control.RegisterHost(t, "q1", a.Address)
	f.Agents["q1"] = a

	const marker = "kvm-marker:resize-keeps-my-data"
	var id string
	sameID := statecheck.CompareValue(compare.ValuesSame())
	cfg := func(power string, vcpus, memory int) string {
		return f.providerBlock() + fmt.Sprintf(`
resource "kvm_vm" "test" {
  name        = "db"
  image       = "busybox"
  vcpus       = %d
  memory_mib  = %d
  disk_mib    = 64
  power_state = %q
}
`, vcpus, memory, power)
	}
	// boot checks the guest's n-th boot: its shape and the marker.
	boot := func(n int, cpus int64, check func(memKB int64) error) resource.TestCheckFunc {
		return func(*terraform.State) error {
			b, err := waitForBoot(a, id, n)
			if err != nil {
				return err
			}
			if b.marker != marker {
				return fmt.Errorf("boot %d: the guest reads marker %q from its disk, want %q", n, b.marker, marker)
			}
			if b.cpus != cpus {
				return fmt.Errorf("boot %d: the guest sees %d vCPUs, want %d", n, b.cpus, cpus)
			}
			t.Logf("boot %d: guest reports %d kB of memory, %d vCPUs, marker %s", n, b.memoryKB, b.cpus, b.marker)
			return check(b.memoryKB)
		}
	}
	// MemTotal is what the kernel has left of the RAM: below the size, and
	// above 256 MiB only when the VM has more.
	below256 := func(kb int64) error {
		if kb <= 0 || kb > 256*1024 {
			return fmt.Errorf("a 256 MiB guest reports %d kB", kb)
		}
		return nil
	}
	above256 := func(kb int64) error {
		if kb <= 256*1024 || kb > 512*1024 {
			return fmt.Errorf("a 512 MiB guest reports %d kB; want more than 256 MiB", kb)
		}
		return nil
	}
	alloc := func(vcpus, memory int64) resource.TestCheckFunc {
		return f.checkHostAllocated("q1", api.Resources{VCPUs: vcpus, MemoryMiB: memory, DiskMiB: 64})
	}
	update := resource.ConfigPlanChecks{
		PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionUpdate)},
		PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
	}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{
				// Created stopped, so that its disk exists and nothing writes it.
				Config: cfg("stopped", 2, 256),
				ConfigStateChecks: []statecheck.StateCheck{
					sameID.AddStateValue(vmAddr, tfjsonpath.New("id")),
				},
				Check: resource.ComposeTestCheckFunc(
					captureAttr(vmAddr, "id", &id),
					func(*terraform.State) error { return writeDiskMarker(a, id, marker) },
				),
			},
			{
				Config:            cfg("running", 2, 256),
				ConfigPlanChecks:  update,
				ConfigStateChecks: []statecheck.StateCheck{sameID.AddStateValue(vmAddr, tfjsonpath.New("id"))},
				Check:             resource.ComposeTestCheckFunc(boot(1, 2, below256), alloc(2, 256)),
			},
			{
				Config:           cfg("running", 2, 512),
				ConfigPlanChecks: update,
				ConfigStateChecks: []statecheck.StateCheck{
					sameID.AddStateValue(vmAddr, tfjsonpath.New("id")),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("memory_mib"), knownvalue.Int64Exact(512)),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("observed_state"), knownvalue.StringExact("running")),
				},
				Check: resource.ComposeTestCheckFunc(boot(2, 2, above256), alloc(2, 512)),
			},
			{
				Config:           cfg("running", 1, 512),
				ConfigPlanChecks: update,
				ConfigStateChecks: []statecheck.StateCheck{
					sameID.AddStateValue(vmAddr, tfjsonpath.New("id")),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("vcpus"), knownvalue.Int64Exact(1)),
				},
				Check: resource.ComposeTestCheckFunc(boot(3, 1, above256), alloc(1, 512)),
			},
			{
				Config:           cfg("running", 3, 512),
				ConfigPlanChecks: update,
				ConfigStateChecks: []statecheck.StateCheck{
					sameID.AddStateValue(vmAddr, tfjsonpath.New("id")),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("vcpus"), knownvalue.Int64Exact(3)),
				},
				Check: resource.ComposeTestCheckFunc(boot(4, 3, above256), alloc(3, 512)),
			},
			{
				// 4 GiB on a host that advertises 1 GiB: refused, nothing restarts.
				Config:      cfg("running", 3, 4096),
				ExpectError: regexp.MustCompile(`(?s)cannot\s+grow.*host\s+q1\s+has\s+no\s+room.*memory:\s+3584\s+MiB\s+more\s+asked,\s+512\s+MiB\s+free`),
			},
			{
				Config: cfg("running", 3, 512),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{sameID.AddStateValue(vmAddr, tfjsonpath.New("id"))},
				Check: resource.ComposeTestCheckFunc(
					f.checkAgentVMState("q1", &id, api.StateRunning),
					alloc(3, 512),
					func(*terraform.State) error {
						// Still the fourth boot: the refused growth restarted nothing.
						out, err := a.Client.Console(context.Background(), id)
						if err != nil {
							return err
						}
						if n := len(bootLine.FindAllString(out, -1)); n != 4 {
							return fmt.Errorf("after a refused growth the guest has booted %d times, want 4", n)
						}
						vm, err := a.Client.GetVM(context.Background(), id)
						if err != nil {
							return err
						}
						if vm.MemoryMiB != 512 || vm.VCPUs != 3 {
							return fmt.Errorf("after a refused growth the agent runs %d vCPUs, %d MiB", vm.VCPUs, vm.MemoryMiB)
						}
						return nil
					},
				),
			},
		},
	})
}
