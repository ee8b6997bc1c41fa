package provider_test

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/hashicorp/terraform-plugin-testing/helper/resource"

	"github.com/kvmfleet/terraform-provider-kvm/internal/provider"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// TestAccProviderNeverLogsToken runs create, refresh, update and destroy
// with TF_LOG=TRACE into one file (terraform's own log and the in-process
// provider's, SDK traces included) and looks for the token in it. It also
// makes the control API refuse one request, so that an error path is logged.
func TestAccProviderNeverLogsToken(t *testing.T) {
	accPreCheck(t)
	token := "tok-" + uuid.NewString()
	f := &fleet{Control: testenv.StartControl(t, testenv.ControlOptions{Token: token}), Agents: map[string]*testenv.Agent{}}
	f.addHost(t, "h1")
	logPath := filepath.Join(t.TempDir(), "terraform.log")
	t.Setenv("TF_LOG", "TRACE")
	t.Setenv("TF_ACC_LOG_PATH", logPath)
	// The token comes from the environment: the test harness logs each
	// step's configuration, which is not the provider's doing.
	t.Setenv(provider.EnvToken, token)
	config := func(label string) string {
		return `
provider "kvm" {
  endpoint = "` + f.Control.URL + `"
}

resource "kvm_vm" "logged" {
  name       = "logged"
  image      = "sim"
  vcpus      = 1
  memory_mib = 64
  disk_mib   = 64
  labels     = { step = "` + label + `" }
}
`
	}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{Config: config("one")},
			{Config: config("two")},
			{Config: config("two"), ResourceName: "kvm_vm.logged", ImportState: true, ImportStateVerify: true},
			{Config: config("two") + `
resource "kvm_vm" "refused" {
  name       = "refused"
  image      = "no-such-image"
  vcpus      = 1
  memory_mib = 64
  disk_mib   = 64
}
`, ExpectError: regexp.MustCompile(`no-such-image`)},
		},
	})
	b, err := os.ReadFile(logPath)
	if err != nil {
		t.Fatalf("read the trace log: %v", err)
	}
	log := string(b)
	// The log must hold the provider's own lines and the SDK's traces, or
	// the absence of the token proves nothing.
	for _, want := range []string{"configured the KVM control API client", "created VM", f.Control.URL, "tf_rpc"} {
		if !strings.Contains(log, want) {
			t.Errorf("the trace log (%d bytes) lacks %q: the test does not see the provider's logs", len(b), want)
		}
	}
	if strings.Contains(log, token) {
		i := strings.Index(log, token)
		t.Errorf("the token appears in the trace log: ...%s...", log[max(0, i-300):min(len(log), i+100)])
	}
}
