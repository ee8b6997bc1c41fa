package provider_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

const imageAddr = "kvm_image.test"

// testImages serves two small real qcow2 files on 127.0.0.1.
type testImages struct {
	srv          *testenv.ImageServer
	sha1, sha2   string
	url1, url2   string
	fileURL1     string
	virtualMiB1  int64
	virtualMiB2  int64
	servedFolder string
}

func newTestImages(t *testing.T) *testImages {
	t.Helper()
	dir := t.TempDir()
	p1 := testenv.WriteQCOW2(t, dir, "one.qcow2", 64)
	p2 := testenv.WriteQCOW2(t, dir, "two.qcow2", 128)
	srv := testenv.StartImageServer(t, dir)
	return &testImages{srv: srv, sha1: testenv.FileSHA256(t, p1), sha2: testenv.FileSHA256(t, p2),
		url1: srv.FileURL("one.qcow2"), url2: srv.FileURL("two.qcow2"), fileURL1: "file://" + p1,
		virtualMiB1: 64, virtualMiB2: 128, servedFolder: dir}
}

func imageConfig(f *fleet, name, url, sha, extra string) string {
	return f.providerBlock() + fmt.Sprintf(`
resource "kvm_image" "test" {
  name       = %q
  source_url = %q
  sha256     = %q
  format     = "qcow2"
%s
}
`, name, url, sha, extra)
}

func (f *fleet) checkImagesGone(names ...string) resource.TestCheckFunc {
	return func(s *terraform.State) error {
		for _, name := range names {
			_, err := f.Control.Client.GetImage(context.Background(), name)
			if err == nil {
				return fmt.Errorf("image %s is still registered after destroy", name)
			}
			if !errors.Is(err, client.ErrNotFound) {
				return fmt.Errorf("reading image %s after destroy: %w", name, err)
			}
		}
		return f.checkFleetEmpty(s)
	}
}

// basic, update in place (min_disk_mib, prefetch), replace (sha256), import.
func TestAccImage_basic(t *testing.T) {
	f := newFleet(t, "h1")
	imgs := newTestImages(t)
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkImagesGone("tiny"),
		Steps: []resource.TestStep{
			{
				Config: imageConfig(f, "tiny", imgs.url1, imgs.sha1, ""),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(imageAddr, plancheck.ResourceActionCreate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(imageAddr, tfjsonpath.New("sha256"), knownvalue.StringExact(imgs.sha1)),
					statecheck.ExpectKnownValue(imageAddr, tfjsonpath.New("format"), knownvalue.StringExact("qcow2")),
					statecheck.ExpectKnownValue(imageAddr, tfjsonpath.New("min_disk_mib"), knownvalue.Int64Exact(0)),
					statecheck.ExpectKnownValue(imageAddr, tfjsonpath.New("prefetch"), knownvalue.Bool(false)),
					statecheck.ExpectKnownValue(imageAddr, tfjsonpath.New("firmware"), knownvalue.StringExact("bios")),
					statecheck.ExpectKnownValue(imageAddr, tfjsonpath.New("hosts"), knownvalue.ListSizeExact(0)),
				},
			},
			{
				// In place: min_disk_mib and prefetch (which fetches on h1 now).
				Config: imageConfig(f, "tiny", imgs.url1, imgs.sha1, "  min_disk_mib = 128\n  prefetch = true\n"),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(imageAddr, plancheck.ResourceActionUpdate)},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(imageAddr, tfjsonpath.New("min_disk_mib"), knownvalue.Int64Exact(128)),
					statecheck.ExpectKnownValue(imageAddr, tfjsonpath.New("prefetch"), knownvalue.Bool(true)),
				},
			},
			{
				// A new digest (another file) replaces the image.
				Config: imageConfig(f, "tiny", imgs.url2, imgs.sha2, "  min_disk_mib = 128\n  prefetch = true\n"),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(imageAddr, plancheck.ResourceActionDestroyBeforeCreate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(imageAddr, tfjsonpath.New("sha256"), knownvalue.StringExact(imgs.sha2)),
				},
			},
			{
				// The firmware is part of what VMs of the image are: a new one
				// replaces the image.
				Config: imageConfig(f, "tiny", imgs.url2, imgs.sha2, "  min_disk_mib = 128\n  prefetch = true\n  firmware = \"uefi\"\n"),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(imageAddr, plancheck.ResourceActionDestroyBeforeCreate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(imageAddr, tfjsonpath.New("firmware"), knownvalue.StringExact("uefi")),
				},
			},
			{
				ResourceName:                         imageAddr,
				ImportState:                          true,
				ImportStateId:                        "tiny",
				ImportStateVerify:                    true,
				ImportStateVerifyIdentifierAttribute: "name",
				// Reported by the hosts, so they may move between reads.
				ImportStateVerifyIgnore: []string{"hosts", "size_bytes", "virtual_size_mib"},
			},
		},
	})
}

// Deleted behind Terraform's back: the plan creates it again.
func TestAccImage_disappears(t *testing.T) {
	f := newFleet(t, "h1")
	imgs := newTestImages(t)
	cfg := imageConfig(f, "gone", imgs.url1, imgs.sha1, "")
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkImagesGone("gone"),
		Steps: []resource.TestStep{
			{
				Config: cfg,
				Check: func(*terraform.State) error {
					return f.Control.Client.DeleteImage(context.Background(), "gone")
				},
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectResourceAction(imageAddr, plancheck.ResourceActionCreate)},
				},
				ExpectNonEmptyPlan: true,
			},
			{
				Config: cfg,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(imageAddr, plancheck.ResourceActionCreate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
			},
		},
	})
}

// A VM of the image: the host fetches it from the URL; the data source
// reads it; deleting the image while the VM exists is refused, naming it.
func TestAccImage_inUse(t *testing.T) {
	f := newFleet(t, "h1")
	imgs := newTestImages(t)
	base := imageConfig(f, "used", imgs.fileURL1, imgs.sha1, "") + `
resource "kvm_vm" "test" {
  name       = "image-user"
  image      = kvm_image.test.name
  vcpus      = 1
  memory_mib = 256
  disk_mib   = 1024
}
`
	withData := base + `
data "kvm_image" "test" {
  name       = kvm_image.test.name
  depends_on = [kvm_vm.test]
}
`
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkImagesGone("used"),
		Steps: []resource.TestStep{
			{
				Config: withData,
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("image"), knownvalue.StringExact("used")),
					statecheck.ExpectKnownValue("data.kvm_image.test", tfjsonpath.New("sha256"), knownvalue.StringExact(imgs.sha1)),
					statecheck.ExpectKnownValue("data.kvm_image.test", tfjsonpath.New("hosts").AtSliceIndex(0).AtMapKey("status"), knownvalue.StringExact("ready")),
					statecheck.ExpectKnownValue("data.kvm_image.test", tfjsonpath.New("virtual_size_mib"), knownvalue.Int64Exact(imgs.virtualMiB1)),
				},
			},
			{
				// Remove only the image from the configuration: the control
				// API refuses while the VM uses it.
				Config: f.providerBlock() + `
resource "kvm_vm" "test" {
  name       = "image-user"
  image      = "used"
  vcpus      = 1
  memory_mib = 256
  disk_mib   = 1024
}
`,
				ExpectError: regexp.MustCompile(`(?s)Image "used" is used by VMs.*image-user`),
			},
			{
				// The VM goes first, then the image.
				Config: base,
				Check: func(*terraform.State) error {
					if _, err := os.Stat(filepath.Join(f.Agents["h1"].CacheDir(), "sha256", imgs.sha1)); err != nil {
						return fmt.Errorf("h1 does not cache the image: %w", err)
					}
					return nil
				},
			},
		},
	})
	if n := imgs.srv.Requests(); n != 0 {
		t.Fatalf("the file:// image went through the HTTP server %d times", n)
	}
}

// kvm_placement over two equal hosts, one of which holds a registered
// image: that host ranks first and the note says why.
func TestAccImage_placementPrefersHolder(t *testing.T) {
	f := newFleet(t, "h1", "h2")
	imgs := newTestImages(t)
	ctx := context.Background()
	if _, err := f.Control.Client.CreateImage(ctx, api.ImageCreate{Name: "near", SourceURL: imgs.url1, SHA256: imgs.sha1, Format: "qcow2"}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Control.Client.DeleteImage(context.Background(), "near") })
	// h2 fetches it (a prefetch on that agent alone); the control API learns
	// it at the next sync.
	if _, err := f.Agents["h2"].Client.PrefetchImage(ctx, agentapi.ImageSource{Name: "near", SHA256: imgs.sha1, SourceURL: imgs.url1, Format: "qcow2"}); err != nil {
		t.Fatal(err)
	}
	for i := 0; ; i++ {
		img, err := f.Control.Client.GetImage(ctx, "near")
		if err == nil && len(img.Hosts) == 1 && img.Hosts[0].Status == "ready" {
			break
		}
		if i == 300 {
			t.Fatalf("h2 never reported the image: %+v %v", img, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		Steps: []resource.TestStep{{
			Config: f.providerBlock() + `
data "kvm_placement" "near" {
  image      = "near"
  vcpus      = 1
  memory_mib = 512
  disk_mib   = 1024
}
`,
			ConfigStateChecks: []statecheck.StateCheck{
				statecheck.ExpectKnownValue("data.kvm_placement.near", tfjsonpath.New("chosen_host"), knownvalue.StringExact("h2")),
				statecheck.ExpectKnownValue("data.kvm_placement.near", tfjsonpath.New("note"),
					knownvalue.StringRegexp(regexp.MustCompile(`^image locality decided: host h2 already holds image near`))),
				statecheck.ExpectKnownValue("data.kvm_placement.near", tfjsonpath.New("ranked").AtSliceIndex(0).AtMapKey("terms").AtMapKey("image_local"),
					knownvalue.Float64Exact(1)),
			},
		}},
	})
}
