package provider_test

import (
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/hashicorp/terraform-plugin-testing/config"
	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"
	"golang.org/x/crypto/ssh"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
)

func sha256Hex(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

// newSSHKey makes an ed25519 key pair: the signer and the authorized-keys
// line (with the newline a .pub file ends with).
func newSSHKey(t *testing.T) (ssh.Signer, string) {
	t.Helper()
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	signer, err := ssh.NewSignerFromKey(priv)
	if err != nil {
		t.Fatal(err)
	}
	sshPub, err := ssh.NewPublicKey(pub)
	if err != nil {
		t.Fatal(err)
	}
	return signer, string(ssh.MarshalAuthorizedKey(sshPub))
}

// stateFiles makes terraform-plugin-testing keep its working directories
// under a folder of the test's, and returns a function that reads every
// state file (and backup) in it.
func stateFiles(t *testing.T) func() (map[string][]byte, error) {
	t.Helper()
	dir := t.TempDir()
	t.Setenv("TF_ACC_TEMP_DIR", dir)
	return func() (map[string][]byte, error) {
		files := map[string][]byte{}
		err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.Contains(d.Name(), ".tfstate") {
				return err
			}
			b, err := os.ReadFile(p)
			files[p] = b
			return err
		})
		if err == nil && len(files) == 0 {
			err = fmt.Errorf("no terraform state file under %s", dir)
		}
		return files, err
	}
}

// guestVMConfig is a kvm_vm on the sim image with the given extra lines.
func guestVMConfig(f *fleet, extra string) string {
	return f.providerBlock() + fmt.Sprintf(`
variable "key" {
  type    = string
  default = ""
}

variable "secret" {
  type      = string
  default   = ""
  sensitive = true
}

resource "kvm_vm" "test" {
  name       = "guest-cfg"
  image      = "sim"
  vcpus      = 1
  memory_mib = 128
  disk_mib   = 256
%s
}
`, extra)
}

// TestAccVM_guestConfig walks kvm_vm's guest configuration through the
// terraform CLI on a sim host: a create with user data, a key (with its .pub
// file's newline) and meta-data boots cold and records the digest and
// hostname; a plan right after is empty and an import reads the same; a
// change of the user data is a replace; the write-only form keeps the user
// data out of every state file while the control API holds its digest; a
// new write-only version replaces again.
func TestAccVM_guestConfig(t *testing.T) {
	f := newFleet(t, "h1")
	readStates := stateFiles(t)
	_, key := newSSHKey(t)
	userA := "#cloud-config\nruncmd:\n  - echo first\n"
	userB := "#cloud-config\nruncmd:\n  - echo second\n"
	secret := "#cloud-config\nchpasswd:\n  list: root:kvm-wo-secret-7f3a9\n"
	vars := config.Variables{"key": config.StringVariable(key), "secret": config.StringVariable(secret)}
	withUserData := func(userData string) string {
		return guestVMConfig(f, fmt.Sprintf(`  user_data           = %q
  ssh_authorized_keys = [var.key]
  meta_data = {
    "local-hostname" = "web-a"
    "role"           = "web"
  }`, userData))
	}
	withSecret := func(version int) string {
		return guestVMConfig(f, fmt.Sprintf(`  user_data_wo         = var.secret
  user_data_wo_version = %d
  ssh_authorized_keys  = [var.key]
  meta_data = {
    "local-hostname" = "web-a"
    "role"           = "web"
  }`, version))
	}
	var id1, id2, id3, id4 string
	serverDigest := func(id *string, want string) func(*terraform.State) error {
		return func(*terraform.State) error {
			vm, err := f.Control.Client.GetVM(ctxT(t), *id)
			if err != nil {
				return err
			}
			if vm.UserDataSHA256 != want || vm.StartedFrom != "cold" || vm.Hostname != "web-a" {
				return fmt.Errorf("VM %s on the control API: digest %q (want %q), started_from %q, hostname %q",
					*id, vm.UserDataSHA256, want, vm.StartedFrom, vm.Hostname)
			}
			return nil
		}
	}
	differ := func(a, b *string) func(*terraform.State) error {
		return func(*terraform.State) error {
			if *a == *b {
				return fmt.Errorf("the VM kept id %s: a change of user data must replace it", *a)
			}
			return nil
		}
	}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{
				Config:          withUserData(userA),
				ConfigVariables: vars,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{
						plancheck.ExpectKnownValue(vmAddr, tfjsonpath.New("user_data_sha256"), knownvalue.StringExact(sha256Hex(userA))),
					},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("user_data_sha256"), knownvalue.StringExact(sha256Hex(userA))),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("hostname"), knownvalue.StringExact("web-a")),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("started_from"), knownvalue.StringExact("cold")),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("wait_for"), knownvalue.StringExact("running")),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("ssh_authorized_keys"),
						knownvalue.ListExact([]knownvalue.Check{knownvalue.StringExact(key)})),
				},
				Check: resource.ComposeTestCheckFunc(captureAttr(vmAddr, "id", &id1), serverDigest(&id1, sha256Hex(userA))),
			},
			{
				// The control API never returns user data; the key comes
				// back without the .pub file's newline.
				ResourceName:            vmAddr,
				ImportState:             true,
				ImportStateVerify:       true,
				ConfigVariables:         vars,
				ImportStateVerifyIgnore: []string{"user_data", "ssh_authorized_keys.0", "timeouts"},
			},
			{
				Config:          withUserData(userB),
				ConfigVariables: vars,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{
						plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionReplace),
						plancheck.ExpectKnownValue(vmAddr, tfjsonpath.New("user_data_sha256"), knownvalue.StringExact(sha256Hex(userB))),
					},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				Check: resource.ComposeTestCheckFunc(captureAttr(vmAddr, "id", &id2), differ(&id1, &id2),
					serverDigest(&id2, sha256Hex(userB))),
			},
			{
				Config:          withSecret(1),
				ConfigVariables: vars,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionReplace)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("user_data"), knownvalue.Null()),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("user_data_wo"), knownvalue.Null()),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("user_data_sha256"), knownvalue.StringExact(sha256Hex(secret))),
				},
				Check: resource.ComposeTestCheckFunc(captureAttr(vmAddr, "id", &id3), differ(&id2, &id3),
					serverDigest(&id3, sha256Hex(secret)),
					func(*terraform.State) error {
						files, err := readStates()
						if err != nil {
							return err
						}
						for p, b := range files {
							if strings.Contains(string(b), "kvm-wo-secret-7f3a9") || strings.Contains(string(b), "chpasswd") {
								return fmt.Errorf("the write-only user data is in the state file %s", p)
							}
						}
						return nil
					}),
			},
			{
				// The same secret under a new version: a replace.
				Config:          withSecret(2),
				ConfigVariables: vars,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionReplace)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				Check: resource.ComposeTestCheckFunc(captureAttr(vmAddr, "id", &id4), differ(&id3, &id4),
					serverDigest(&id4, sha256Hex(secret))),
			},
			{
				// A new secret under the same version still shows as a
				// replace: its digest differs from the one in state.
				Config: withSecret(2),
				ConfigVariables: config.Variables{"key": config.StringVariable(key),
					"secret": config.StringVariable(secret + "# rotated\n")},
				PlanOnly:           true,
				ExpectNonEmptyPlan: true,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionReplace)},
				},
			},
		},
	})
}

// TestAccVM_guestConfigBadInput: mistakes in guest configuration fail at plan
// time where the provider can tell (size, key, reserved meta-data, a wait a
// stopped VM cannot satisfy), and with the control API's 400 otherwise; no
// VM is made.
func TestAccVM_guestConfigBadInput(t *testing.T) {
	f := newFleet(t, "h1")
	big := strings.Repeat("x", api.MaxUserDataBytes+1)
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{
				Config:          guestVMConfig(f, `  user_data = var.secret`),
				ConfigVariables: config.Variables{"secret": config.StringVariable(big)},
				ExpectError:     regexp.MustCompile(`(?s)Guest Configuration Too Large.*65537 bytes; the limit is\s+65536 bytes \(64 KiB\)`),
			},
			{
				Config:      guestVMConfig(f, `  ssh_authorized_keys = ["ssh-ed25519 not-base64 me@host"]`),
				ExpectError: regexp.MustCompile(`(?s)Invalid SSH Public Key.*ssh_authorized_keys\[0\] is not an OpenSSH public\s+key`),
			},
			{
				Config:      guestVMConfig(f, `  meta_data = { "instance-id" = "mine" }`),
				ExpectError: regexp.MustCompile(`(?s)Reserved Meta-Data Key.*may not set "instance-id"`),
			},
			{
				Config: guestVMConfig(f, `  user_data    = "#cloud-config\n"
  user_data_wo = "#cloud-config\n"`),
				ExpectError: regexp.MustCompile(`(?s)Invalid Attribute Combination.*user_data_wo`),
			},
			{
				Config: guestVMConfig(f, `  power_state = "stopped"
  wait_for    = "cloud_init"`),
				ExpectError: regexp.MustCompile(`(?s)Invalid Wait.*needs a running guest`),
			},
			{
				// Only the control API checks hostnames: its 400, named.
				Config:      guestVMConfig(f, `  meta_data = { "local-hostname" = "bad_host!" }`),
				ExpectError: regexp.MustCompile(`(?s)Unable to Create VM.*local-hostname.*not valid`),
			},
			{
				Config:      guestVMConfig(f, `  network_config = "just text"`),
				ExpectError: regexp.MustCompile(`(?s)Unable to Create VM.*network_config is not a cloud-init network\s+configuration`),
			},
		},
	})
}

// tfState is the part of a state file the tests read.
type tfState struct {
	Resources []struct {
		Type      string `json:"type"`
		Name      string `json:"name"`
		Instances []struct {
			Status     string         `json:"status"`
			Attributes map[string]any `json:"attributes"`
		} `json:"instances"`
	} `json:"resources"`
}

// vmInState reads the kvm_vm.test instance of the newest state file: its
// status ("tainted" or "") and id.
func vmInState(readStates func() (map[string][]byte, error)) (status, id string, err error) {
	files, err := readStates()
	if err != nil {
		return "", "", err
	}
	var newest string
	var newestTime int64
	for p := range files {
		if !strings.HasSuffix(p, "terraform.tfstate") {
			continue
		}
		if fi, serr := os.Stat(p); serr == nil && fi.ModTime().UnixNano() >= newestTime {
			newest, newestTime = p, fi.ModTime().UnixNano()
		}
	}
	if newest == "" {
		return "", "", errors.New("no terraform.tfstate")
	}
	var st tfState
	if err := json.Unmarshal(files[newest], &st); err != nil {
		return "", "", fmt.Errorf("%s: %w", newest, err)
	}
	for _, r := range st.Resources {
		if r.Type == "kvm_vm" && r.Name == "test" && len(r.Instances) == 1 {
			in := r.Instances[0]
			id, _ := in.Attributes["id"].(string)
			return in.Status, id, nil
		}
	}
	return "", "", fmt.Errorf("no kvm_vm.test in %s", newest)
}
