package provider_test

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"testing"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"

	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

const (
	volumeAddr   = "kvm_volume.data"
	volumeVMAddr = "kvm_vm.db"
)

// newVolumeFleet is a fleet whose sim agents serve the volume calls.
func newVolumeFleet(t *testing.T, hostNames ...string) *fleet {
	t.Helper()
	f := newFleet(t)
	for _, name := range hostNames {
		f.addHostWith(t, name, testenv.AgentOptions{VCPUs: testHostVCPUs, MemoryMiB: testHostMemoryMiB,
			DiskMiB: testHostDiskMiB})
	}
	return f
}

// checkVolumesGone is CheckDestroy: the fleet is empty and no volume is
// left on the control API or on any agent.
func (f *fleet) checkVolumesGone(s *terraform.State) error {
	if err := f.checkFleetEmpty(s); err != nil {
		return err
	}
	list, err := f.Control.Client.ListVolumes(context.Background(), 0, "")
	if err != nil {
		return err
	}
	var errs []error
	for _, v := range list.Items {
		errs = append(errs, fmt.Errorf("volume %s (%q) still exists after destroy", v.ID, v.Name))
	}
	for name, a := range f.Agents {
		vols, err := a.Client.ListVolumes(context.Background())
		if err != nil {
			return fmt.Errorf("list volumes of agent %s: %w", name, err)
		}
		for _, v := range vols {
			errs = append(errs, fmt.Errorf("agent %s still has volume %s after destroy", name, v.ID))
		}
	}
	return errors.Join(errs...)
}

func volumeConfig(f *fleet, sizeMiB int, userData string) string {
	return f.providerBlock() + fmt.Sprintf(`
resource "kvm_volume" "data" {
  name     = "data"
  size_mib = %d
  host     = "h2"
  labels   = { app = "db" }
}

resource "kvm_vm" "db" {
  name       = "db"
  image      = "sim"
  vcpus      = 1
  memory_mib = 128
  disk_mib   = 256
  user_data  = %q

  volume_attachment {
    volume = kvm_volume.data.id
  }
}

data "kvm_volume" "by_name" {
  name       = kvm_volume.data.name
  depends_on = [kvm_vm.db]
}
`, sizeMiB, userData)
}

// TestAccVolume_keptAcrossVMReplace walks kvm_volume and a kvm_vm's
// volume_attachment through the terraform CLI on sim hosts: the VM is
// placed on the volume's host (h2, although h1 is as good); an import of
// the volume reads the same; new user_data replaces the VM and leaves the
// volume unchanged, and the new VM (a new id) has the same volume
// attached; size_mib grows in place and a smaller one is refused at plan
// time; destroy leaves nothing behind.
func TestAccVolume_keptAcrossVMReplace(t *testing.T) {
	f := newVolumeFleet(t, "h1", "h2")
	var volID, vm1, vm2 string
	attachedTo := func(vmID *string) func(*terraform.State) error {
		return func(*terraform.State) error {
			vm, err := f.Control.Client.GetVM(context.Background(), *vmID)
			if err != nil {
				return err
			}
			if vm.Host != "h2" || len(vm.Volumes) != 1 || vm.Volumes[0].VolumeID != volID {
				return fmt.Errorf("VM %s on host %s has volumes %+v; want volume %s, on h2", *vmID, vm.Host, vm.Volumes, volID)
			}
			return nil
		}
	}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkVolumesGone,
		Steps: []resource.TestStep{
			{
				Config: volumeConfig(f, 1024, "#cloud-config\n# first\n"),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(volumeAddr, tfjsonpath.New("state"), knownvalue.StringExact("ready")),
					statecheck.ExpectKnownValue(volumeAddr, tfjsonpath.New("device"), knownvalue.StringRegexp(regexp.MustCompile(`^/dev/disk/by-id/virtio-[0-9a-f]{20}$`))),
					statecheck.ExpectKnownValue(volumeVMAddr, tfjsonpath.New("host"), knownvalue.StringExact("h2")),
					statecheck.CompareValuePairs("data.kvm_volume.by_name", tfjsonpath.New("device"), volumeAddr, tfjsonpath.New("device"), compareEqual{}),
				},
				Check: resource.ComposeTestCheckFunc(captureAttr(volumeAddr, "id", &volID), captureAttr(volumeVMAddr, "id", &vm1),
					func(s *terraform.State) error { return attachedTo(&vm1)(s) }),
			},
			{
				// attached_to in state is what the volume's own create saw
				// (the VM attached it after); the import reads the VM.
				ResourceName:            volumeAddr,
				ImportState:             true,
				ImportStateVerify:       true,
				ImportStateVerifyIgnore: []string{"attached_to"},
			},
			{
				Config: volumeConfig(f, 1024, "#cloud-config\n# second\n"),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{
						plancheck.ExpectResourceAction(volumeVMAddr, plancheck.ResourceActionReplace),
						plancheck.ExpectResourceAction(volumeAddr, plancheck.ResourceActionNoop),
					},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				Check: resource.ComposeTestCheckFunc(captureAttr(volumeVMAddr, "id", &vm2),
					func(*terraform.State) error {
						if vm1 == vm2 {
							return fmt.Errorf("the VM kept id %s: new user_data must replace it", vm1)
						}
						return nil
					},
					func(s *terraform.State) error { return attachedTo(&vm2)(s) },
					resource.TestCheckResourceAttrPtr(volumeAddr, "id", &volID)),
			},
			{
				// The VM reads its volume_attachment back (by volume id).
				ResourceName:            volumeVMAddr,
				ImportState:             true,
				ImportStateVerify:       true,
				ImportStateVerifyIgnore: []string{"user_data", "timeouts"},
			},
			{
				Config: volumeConfig(f, 2048, "#cloud-config\n# second\n"),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{
						plancheck.ExpectResourceAction(volumeAddr, plancheck.ResourceActionUpdate),
						plancheck.ExpectResourceAction(volumeVMAddr, plancheck.ResourceActionNoop),
					},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(volumeAddr, tfjsonpath.New("size_mib"), knownvalue.Int64Exact(2048)),
				},
			},
			{
				Config:      volumeConfig(f, 512, "#cloud-config\n# second\n"),
				PlanOnly:    true,
				ExpectError: regexp.MustCompile(`never shrinks`),
			},
		},
	})
}

// compareEqual is a value comparer for CompareValuePairs: equal values.
type compareEqual struct{}

func (compareEqual) CompareValues(values ...any) error {
	if len(values) == 2 && fmt.Sprint(values[0]) == fmt.Sprint(values[1]) {
		return nil
	}
	return fmt.Errorf("values differ: %v", values)
}

// TestAccVolume_disappears: a volume deleted behind Terraform's back is
// planned for creation again.
func TestAccVolume_disappears(t *testing.T) {
	f := newVolumeFleet(t, "h1")
	cfg := f.providerBlock() + `
resource "kvm_volume" "data" {
  name     = "gone"
  size_mib = 64
}
`
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkVolumesGone,
		Steps: []resource.TestStep{
			{
				Config: cfg,
				Check: func(*terraform.State) error {
					return f.Control.Client.DeleteVolume(context.Background(), "gone")
				},
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectResourceAction(volumeAddr, plancheck.ResourceActionCreate)},
				},
				ExpectNonEmptyPlan: true,
			},
		},
	})
}
