package provider_test

import (
	"context"
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"

	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// waitConsoleMatch waits until re matches the console of VM id at least n
// times and returns the last match's groups.
func waitConsoleMatch(a *testenv.Agent, id string, re *regexp.Regexp, n int) ([]string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	var (
		last    string
		lastErr error
	)
	for {
		out, err := a.Client.Console(ctx, id)
		lastErr = err
		if err == nil {
			last = out
			if all := re.FindAllStringSubmatch(out, -1); len(all) >= n {
				return all[len(all)-1], nil
			}
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("guest %s: %s never appeared %d times (last console read: %v); its console, ticks left out:\n%s", id, re, n, lastErr, tail(withoutTicks(last), 6000))
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// withoutTicks is a busybox console without its once-a-second tick lines.
func withoutTicks(console string) string {
	var keep []string
	for _, l := range strings.Split(console, "\n") {
		if !strings.HasPrefix(l, "tick ") {
			keep = append(keep, l)
		}
	}
	return strings.Join(keep, "\n")
}

func hotAttachConfig(f *fleet, attached bool) string {
	att := ""
	if attached {
		att = "\n  volume_attachment {\n    volume = kvm_volume.hot.id\n  }\n"
	}
	return f.providerBlock() + `
resource "kvm_volume" "hot" {
  name     = "hot"
  size_mib = 24
  host     = "q1"
}

resource "kvm_vm" "test" {
  name       = "bb-hot"
  image      = "busybox"
  vcpus      = 1
  memory_mib = 128
  disk_mib   = 64
` + att + `}
`
}

// TestAccVM_qemuVolumeHotAttach: on a real busybox guest (QEMU, TCG), a
// volume_attachment block added to a running VM is an in-place update and
// the guest sees the disk by its serial without a reboot; removing the
// block detaches it and the guest sees it go.
func TestAccVM_qemuVolumeHotAttach(t *testing.T) {
	f, a := qemuFleet(t, testenv.AgentOptions{})
	var vmID, serial string
	ready := regexp.MustCompile(`(?m)^kvm-guest-ready\r?$`)
	inPlace := resource.ConfigPlanChecks{
		PreApply: []plancheck.PlanCheck{
			plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionUpdate),
			plancheck.ExpectResourceAction("kvm_volume.hot", plancheck.ResourceActionNoop),
		},
		PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
	}
	guestSays := func(line func() string) resource.TestCheckFunc {
		return func(s *terraform.State) error {
			if id := s.RootModule().Resources[vmAddr].Primary.ID; id != vmID {
				return fmt.Errorf("the VM was replaced (%s, was %s)", id, vmID)
			}
			if _, err := waitConsoleMatch(a, vmID, regexp.MustCompile(`(?m)^`+regexp.QuoteMeta(line())+`\r?$`), 1); err != nil {
				return err
			}
			con, err := a.Client.Console(context.Background(), vmID)
			if err != nil {
				return err
			}
			if n := len(ready.FindAllString(con, -1)); n != 1 {
				return fmt.Errorf("the guest booted %d times; a hot attach or detach must not restart it", n)
			}
			return nil
		}
	}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkVolumesGone,
		Steps: []resource.TestStep{
			{
				Config: hotAttachConfig(f, false),
				Check: resource.ComposeTestCheckFunc(captureAttr(vmAddr, "id", &vmID), captureAttr("kvm_volume.hot", "serial", &serial),
					func(*terraform.State) error { _, err := waitConsoleMatch(a, vmID, ready, 1); return err }),
			},
			{
				Config:           hotAttachConfig(f, true),
				ConfigPlanChecks: inPlace,
				Check:            guestSays(func() string { return fmt.Sprintf("kvm-guest-disk %s %d", serial, 24<<20) }),
			},
			{
				Config:           hotAttachConfig(f, false),
				ConfigPlanChecks: inPlace,
				Check:            guestSays(func() string { return "kvm-guest-disk-gone " + serial }),
			},
		},
	})
}

// markerScript is user data for the busybox guest: it finds the volume by
// its serial in /sys/block/vd*/serial and, unless the disk already starts
// with kvm-marker:, writes kvm-marker:<a random id> to its first bytes.
// generation is a comment: changing it changes user_data, which replaces
// the VM. (No ${...} of the shell: Terraform would interpolate it.)
func markerScript(generation string) string {
	return `#!/bin/busybox sh
# generation: ` + generation + `
want=${kvm_volume.data.serial}
for d in /sys/block/vd*; do
  [ "$(cat $d/serial 2>/dev/null)" = "$want" ] || continue
  name=$(basename $d)
  m=$(head -c 64 /dev/$name | tr -dc 'A-Za-z0-9:._-')
  case "$m" in
  kvm-marker:*) echo "kvm-script-found $name $m" ;;
  *)
    id=$(tr -dc '0-9a-f' </proc/sys/kernel/random/uuid)
    printf 'kvm-marker:%s' "$id" | dd of=/dev/$name bs=512 count=1 conv=sync 2>/dev/null
    sync
    echo "kvm-script-wrote $name kvm-marker:$id"
    ;;
  esac
done
`
}

func markerConfig(f *fleet, generation string) string {
	return f.providerBlock() + fmt.Sprintf(`
resource "kvm_volume" "data" {
  name     = "data"
  size_mib = 16
  host     = "q1"
}

resource "kvm_vm" "test" {
  name       = "bb-db"
  image      = "busybox"
  vcpus      = 1
  memory_mib = 128
  disk_mib   = 64
  user_data  = %q
  wait_for   = "cloud_init"

  volume_attachment {
    volume = kvm_volume.data.id
  }

  timeouts {
    create = "5m"
  }
}
`, markerScript(generation))
}

// TestAccVolume_qemuMarkerSurvivesReplace is the replace a database fears,
// on real busybox guests (QEMU, TCG): the first VM's user data writes a
// marker with a random id to its volume; new user data replaces the VM
// (the plan: replace the VM, no change of the volume), and the new VM, a
// new id, reads the same marker from the same volume at boot.
func TestAccVolume_qemuMarkerSurvivesReplace(t *testing.T) {
	f, a := qemuFleet(t, testenv.AgentOptions{})
	var vm1, vm2, volID, marker string
	wrote := regexp.MustCompile(`(?m)^kvm-script-wrote (vd[a-z]+) (kvm-marker:[0-9a-f]+)\r?$`)
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkVolumesGone,
		Steps: []resource.TestStep{
			{
				Config: markerConfig(f, "one"),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				Check: resource.ComposeTestCheckFunc(captureAttr(vmAddr, "id", &vm1), captureAttr("kvm_volume.data", "id", &volID),
					func(*terraform.State) error {
						m, err := waitConsoleMatch(a, vm1, wrote, 1)
						if err != nil {
							return err
						}
						marker = m[2]
						t.Logf("first VM %s wrote %s to volume %s (%s in the guest)", vm1, marker, volID, m[1])
						return nil
					}),
			},
			{
				Config: markerConfig(f, "two"),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{
						plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionDestroyBeforeCreate),
						plancheck.ExpectResourceAction("kvm_volume.data", plancheck.ResourceActionNoop),
					},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				Check: resource.ComposeTestCheckFunc(captureAttr(vmAddr, "id", &vm2), resource.TestCheckResourceAttrPtr("kvm_volume.data", "id", &volID),
					func(*terraform.State) error {
						if vm2 == vm1 {
							return fmt.Errorf("the VM kept id %s: new user_data must replace it", vm1)
						}
						seen := regexp.MustCompile(`(?m)^kvm-guest-disk-marker (vd[a-z]+) ` + regexp.QuoteMeta(marker) + `\r?$`)
						m, err := waitConsoleMatch(a, vm2, seen, 1)
						if err != nil {
							return err
						}
						con, err := a.Client.Console(context.Background(), vm2)
						if err != nil {
							return err
						}
						if strings.Contains(con, "kvm-script-wrote") {
							return fmt.Errorf("the new VM %s wrote a new marker: it did not find %s on the volume", vm2, marker)
						}
						t.Logf("new VM %s reads %s from the volume at boot (%s)", vm2, marker, m[1])
						return nil
					}),
			},
		},
	})
}
