package provider_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

// attachConfig is a VM on h1 and a volume there, with the volume attached
// when block is not "" (read_only = block == "ro").
func attachConfig(f *fleet, block string) string {
	att := ""
	if block != "" {
		att = fmt.Sprintf("\n  volume_attachment {\n    volume    = kvm_volume.data.id\n    read_only = %t\n  }\n", block == "ro")
	}
	return f.providerBlock() + `
resource "kvm_volume" "data" {
  name     = "data"
  size_mib = 64
  host     = "h1"
}

resource "kvm_vm" "db" {
  name       = "db"
  image      = "sim"
  vcpus      = 1
  memory_mib = 128
  disk_mib   = 256
  host       = "h1"
` + att + `}
`
}

// TestAccVM_volumeAttachInPlace: adding, changing and removing a
// volume_attachment block are in-place updates of kvm_vm (the VM keeps its
// id) that attach and detach through the control API and its agent; a
// volume detached behind Terraform's back shows in the plan, and apply
// attaches it again.
func TestAccVM_volumeAttachInPlace(t *testing.T) {
	f := newVolumeFleet(t, "h1")
	var vmID, volID string
	// onVM checks the VM's volumes in the control API and on its agent.
	onVM := func(want string) resource.TestCheckFunc {
		return func(*terraform.State) error {
			ctx := context.Background()
			vm, err := f.Control.Client.GetVM(ctx, vmID)
			if err != nil {
				return err
			}
			onAgent, err := f.Agents["h1"].Client.GetVM(ctx, vmID)
			if err != nil {
				return err
			}
			got, agent := "", ""
			for _, v := range vm.Volumes {
				got += fmt.Sprintf("%s/%t/%s", v.VolumeID, v.ReadOnly, v.State)
			}
			for _, v := range onAgent.Volumes {
				agent += fmt.Sprintf("%s/%t/%s", v.ID, v.ReadOnly, api.AttachmentAttached)
			}
			w := ""
			if want != "" {
				w = fmt.Sprintf("%s/%t/%s", volID, want == "ro", api.AttachmentAttached)
			}
			if got != w || agent != w {
				return fmt.Errorf("VM %s has volumes %q in the control API and %q on its agent; want %q", vmID, got, agent, w)
			}
			return nil
		}
	}
	sameVM := func(s *terraform.State) error {
		if id := s.RootModule().Resources[volumeVMAddr].Primary.ID; id != vmID {
			return fmt.Errorf("the VM was replaced (%s, was %s): a volume_attachment change must be in place", id, vmID)
		}
		return nil
	}
	inPlace := resource.ConfigPlanChecks{
		PreApply: []plancheck.PlanCheck{
			plancheck.ExpectResourceAction(volumeVMAddr, plancheck.ResourceActionUpdate),
			plancheck.ExpectResourceAction(volumeAddr, plancheck.ResourceActionNoop),
		},
		PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
	}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkVolumesGone,
		Steps: []resource.TestStep{
			{
				Config: attachConfig(f, ""),
				Check:  resource.ComposeTestCheckFunc(captureAttr(volumeVMAddr, "id", &vmID), captureAttr(volumeAddr, "id", &volID), onVM("")),
			},
			{
				Config:           attachConfig(f, "rw"),
				ConfigPlanChecks: inPlace,
				Check:            resource.ComposeTestCheckFunc(sameVM, onVM("rw")),
			},
			{
				// Detached behind Terraform's back: the plan shows it, apply
				// attaches it again.
				PreConfig: func() {
					if err := f.Control.Client.DetachVolume(context.Background(), vmID, volID); err != nil {
						t.Fatalf("detach out of band: %v", err)
					}
				},
				Config:           attachConfig(f, "rw"),
				ConfigPlanChecks: inPlace,
				Check:            resource.ComposeTestCheckFunc(sameVM, onVM("rw")),
			},
			{
				Config:           attachConfig(f, "ro"),
				ConfigPlanChecks: inPlace,
				Check:            resource.ComposeTestCheckFunc(sameVM, onVM("ro")),
			},
			{
				ResourceName:            volumeVMAddr,
				ImportState:             true,
				ImportStateVerify:       true,
				ImportStateVerifyIgnore: []string{"timeouts"},
			},
			{
				Config:           attachConfig(f, ""),
				ConfigPlanChecks: inPlace,
				Check:            resource.ComposeTestCheckFunc(sameVM, onVM("")),
			},
		},
	})
}
