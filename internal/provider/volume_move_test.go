package provider_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"testing"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

type agentVolume = agentapi.Volume

func volumeMoveConfig(f *fleet, host string, attached bool) string {
	cfg := f.providerBlock() + fmt.Sprintf(`
resource "kvm_volume" "data" {
  name     = "data"
  size_mib = 8
  host     = %q
}
`, host)
	if attached {
		cfg += `
resource "kvm_vm" "db" {
  name       = "db"
  image      = "sim"
  vcpus      = 1
  memory_mib = 128
  disk_mib   = 256

  volume_attachment {
    volume = kvm_volume.data.id
  }
}
`
	}
	return cfg
}

// TestAccVolume_moveInPlace: a new host moves a volume in place through
// the terraform CLI on sim hosts: the plan is an update (not a replace),
// the id and the content stay, the old host has nothing left. An attached
// volume is refused with a warning at plan time and an error that says to
// detach first; a VM created after the move lands on the new host.
func TestAccVolume_moveInPlace(t *testing.T) {
	f := newVolumeFleet(t, "h1", "h2")
	var volID string
	marker := []byte("kvm-marker:provider-move")
	file := func(host string) string {
		return filepath.Join(f.Agents[host].StateDir, "volumes", volID, "disk.qcow2")
	}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkVolumesGone,
		Steps: []resource.TestStep{
			{
				Config: volumeMoveConfig(f, "h1", true),
				Check:  captureAttr(volumeAddr, "id", &volID),
			},
			{
				Config:      volumeMoveConfig(f, "h2", true),
				ExpectError: regexp.MustCompile(`(?s)Attached Volume Cannot Move.*only a detached\s+volume\s+moves.*Remove\s+the\s+volume_attachment`),
			},
			{
				Config: volumeMoveConfig(f, "h1", false),
				Check: func(*terraform.State) error {
					fh, err := os.OpenFile(file("h1"), os.O_WRONLY, 0)
					if err != nil {
						return err
					}
					defer func() { _ = fh.Close() }()
					_, err = fh.WriteAt(marker, 0)
					return err
				},
			},
			{
				Config: volumeMoveConfig(f, "h2", false),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(volumeAddr, plancheck.ResourceActionUpdate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(volumeAddr, tfjsonpath.New("host"), knownvalue.StringExact("h2")),
					statecheck.ExpectKnownValue(volumeAddr, tfjsonpath.New("state"), knownvalue.StringExact("ready")),
				},
				Check: resource.ComposeTestCheckFunc(resource.TestCheckResourceAttrPtr(volumeAddr, "id", &volID),
					func(*terraform.State) error {
						b, err := os.ReadFile(file("h2"))
						if err != nil || !bytes.HasPrefix(b, marker) {
							return fmt.Errorf("the moved volume on h2 does not hold its content (%v)", err)
						}
						if _, err := os.Stat(filepath.Dir(file("h1"))); !os.IsNotExist(err) {
							return fmt.Errorf("h1 still has the volume's directory (%v)", err)
						}
						vols, err := f.Agents["h1"].Client.ListVolumes(context.Background())
						if err != nil {
							return err
						}
						if slices.ContainsFunc(vols, func(v agentVolume) bool { return v.ID == volID }) {
							return fmt.Errorf("h1's agent still lists volume %s", volID)
						}
						return nil
					}),
			},
			{
				Config: volumeMoveConfig(f, "h2", true),
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(volumeVMAddr, tfjsonpath.New("host"), knownvalue.StringExact("h2")),
				},
			},
		},
	})
}
