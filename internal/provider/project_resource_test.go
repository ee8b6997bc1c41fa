package provider_test

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"testing"

	"github.com/hashicorp/terraform-plugin-framework/providerserver"
	"github.com/hashicorp/terraform-plugin-go/tfprotov6"
	"github.com/hashicorp/terraform-plugin-testing/compare"
	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/provider"
)

const projectAddr = "kvm_project.test"

func projectConfig(f *fleet, body string) string {
	return f.providerBlock() + fmt.Sprintf(`
resource "kvm_project" "test" {
%s
}
`, body)
}

// providerBlockAs configures the provider of local name name ("kvm", or
// "kvmpeer" of peerFactories) with a token and, unless "", a project.
func (f *fleet) providerBlockAs(name, token, project string) string {
	var extra string
	if project != "" {
		extra = fmt.Sprintf("  project     = %q\n", project)
	}
	return fmt.Sprintf(`
provider %q {
  endpoint    = %q
  token       = %q
%s  max_retries = 3
}
`, name, f.Control.URL, token, extra)
}

// peerFactories serves the provider twice: as "kvm" and as "kvmpeer", a
// second instance for a configuration with a second token. (Aliases of one
// provider do not do: the test framework serves every configuration of a
// provider from one instance, so the last one configured wins.)
func peerFactories() map[string]func() (tfprotov6.ProviderServer, error) {
	return map[string]func() (tfprotov6.ProviderServer, error){
		"kvm":     providerserver.NewProtocol6WithError(provider.New("test")()),
		"kvmpeer": providerserver.NewProtocol6WithError(provider.New("test")()),
	}
}

// createProject makes a project with the admin token, behind Terraform.
func (f *fleet) createProject(t *testing.T, name string) {
	t.Helper()
	if _, err := f.Control.Client.CreateProject(ctxT(t), api.ProjectCreate{Name: name}); err != nil {
		t.Fatalf("creating project %s: %v", name, err)
	}
}

// projectToken makes a user token of one project and returns its secret.
func (f *fleet) projectToken(t *testing.T, project string) string {
	t.Helper()
	tok, err := f.Control.Client.CreateToken(ctxT(t), api.TokenCreate{Name: "tf-" + project,
		Scopes: []string{api.ScopeUser}, Project: project})
	if err != nil {
		t.Fatalf("creating a token of project %s: %v", project, err)
	}
	return tok.Secret
}

// checkProjectsGone is the CheckDestroy of kvm_project tests.
func (f *fleet) checkProjectsGone(names ...string) resource.TestCheckFunc {
	return func(s *terraform.State) error {
		for _, name := range names {
			_, err := f.Control.Client.GetProject(context.Background(), name)
			if err == nil {
				return fmt.Errorf("project %s still exists after destroy", name)
			}
			if !errors.Is(err, client.ErrNotFound) {
				return fmt.Errorf("reading project %s after destroy: %w", name, err)
			}
		}
		return f.checkFleetEmpty(s)
	}
}

func quotasCheck(vcpus, memory, disk, vms knownvalue.Check) knownvalue.Check {
	return knownvalue.ObjectExact(map[string]knownvalue.Check{
		"vcpus": vcpus, "memory_mib": memory, "disk_mib": disk, "vms": vms,
	})
}

func usageCheck(vcpus, memory, disk, vms int64) knownvalue.Check {
	return quotasCheck(knownvalue.Int64Exact(vcpus), knownvalue.Int64Exact(memory), knownvalue.Int64Exact(disk),
		knownvalue.Int64Exact(vms))
}

var unlimited = knownvalue.Null()

func TestAccProject_basic(t *testing.T) {
	f := newFleet(t, "h1")
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkProjectsGone("team-a", "team-b"),
		Steps: []resource.TestStep{
			{
				// Names are DNS labels, refused at plan.
				Config:      projectConfig(f, `  name = "Team_A"`),
				ExpectError: regexp.MustCompile(`(?s)name.*DNS\s+label`),
			},
			{
				// A project with every argument, and one with none: neither
				// plans a change after apply (no perpetual diff of defaults).
				Config: projectConfig(f, `
  name        = "team-a"
  description = "Team A"
  quotas = {
    vcpus      = 4
    memory_mib = 8192
  }
  host_labels = { tier = "gold" }
`) + `
resource "kvm_project" "bare" {
  name = "team-b"
}
`,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{
						plancheck.ExpectResourceAction(projectAddr, plancheck.ResourceActionCreate),
						plancheck.ExpectResourceAction("kvm_project.bare", plancheck.ResourceActionCreate),
					},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(projectAddr, tfjsonpath.New("id"), knownvalue.StringExact("team-a")),
					statecheck.ExpectKnownValue(projectAddr, tfjsonpath.New("description"), knownvalue.StringExact("Team A")),
					statecheck.ExpectKnownValue(projectAddr, tfjsonpath.New("quotas"),
						quotasCheck(knownvalue.Int64Exact(4), knownvalue.Int64Exact(8192), unlimited, unlimited)),
					statecheck.ExpectKnownValue(projectAddr, tfjsonpath.New("host_labels"),
						knownvalue.MapExact(map[string]knownvalue.Check{"tier": knownvalue.StringExact("gold")})),
					statecheck.ExpectKnownValue(projectAddr, tfjsonpath.New("usage"), usageCheck(0, 0, 0, 0)),
					statecheck.ExpectKnownValue(projectAddr, tfjsonpath.New("created_at"),
						knownvalue.StringRegexp(regexp.MustCompile(`^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$`))),
					statecheck.ExpectKnownValue("kvm_project.bare", tfjsonpath.New("description"), knownvalue.StringExact("")),
					statecheck.ExpectKnownValue("kvm_project.bare", tfjsonpath.New("quotas"),
						quotasCheck(unlimited, unlimited, unlimited, unlimited)),
					statecheck.ExpectKnownValue("kvm_project.bare", tfjsonpath.New("host_labels"), knownvalue.MapSizeExact(0)),
				},
			},
		},
	})
}

func TestAccProject_updateQuotas(t *testing.T) {
	f := newFleet(t, "h1")
	sameCreatedAt := statecheck.CompareValue(compare.ValuesSame())
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkProjectsGone("team-a", "team-c"),
		Steps: []resource.TestStep{
			{
				Config: projectConfig(f, `
  name        = "team-a"
  description = "one"
  quotas = {
    vcpus      = 4
    memory_mib = 8192
  }
`),
				ConfigStateChecks: []statecheck.StateCheck{
					sameCreatedAt.AddStateValue(projectAddr, tfjsonpath.New("created_at")),
				},
			},
			{
				// Quotas are replaced whole and in place: a limit left out is
				// unlimited again.
				Config: projectConfig(f, `
  name        = "team-a"
  description = "two"
  quotas = {
    vcpus = 8
    vms   = 3
  }
  host_labels = { tier = "gold" }
`),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(projectAddr, plancheck.ResourceActionUpdate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(projectAddr, tfjsonpath.New("description"), knownvalue.StringExact("two")),
					statecheck.ExpectKnownValue(projectAddr, tfjsonpath.New("quotas"),
						quotasCheck(knownvalue.Int64Exact(8), unlimited, unlimited, knownvalue.Int64Exact(3))),
					statecheck.ExpectKnownValue(projectAddr, tfjsonpath.New("host_labels"),
						knownvalue.MapExact(map[string]knownvalue.Check{"tier": knownvalue.StringExact("gold")})),
					sameCreatedAt.AddStateValue(projectAddr, tfjsonpath.New("created_at")),
				},
				Check: f.checkProjectQuotas("team-a", api.Quotas{VCPUs: ptr(int64(8)), VMs: ptr(int64(3))}),
			},
			{
				// No quotas at all: unlimited, still in place.
				Config: projectConfig(f, `
  name        = "team-a"
  description = "two"
`),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(projectAddr, plancheck.ResourceActionUpdate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(projectAddr, tfjsonpath.New("quotas"),
						quotasCheck(unlimited, unlimited, unlimited, unlimited)),
					statecheck.ExpectKnownValue(projectAddr, tfjsonpath.New("host_labels"), knownvalue.MapSizeExact(0)),
					sameCreatedAt.AddStateValue(projectAddr, tfjsonpath.New("created_at")),
				},
				Check: f.checkProjectQuotas("team-a", api.Quotas{}),
			},
			{
				// A new name is a new project.
				Config: projectConfig(f, `
  name        = "team-c"
  description = "two"
`),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(projectAddr, plancheck.ResourceActionDestroyBeforeCreate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(projectAddr, tfjsonpath.New("id"), knownvalue.StringExact("team-c")),
				},
			},
		},
	})
}

func ptr[T any](v T) *T { return &v }

// checkProjectQuotas checks the quotas the control API holds for a project.
func (f *fleet) checkProjectQuotas(name string, want api.Quotas) resource.TestCheckFunc {
	show := func(v *int64) string {
		if v == nil {
			return "unlimited"
		}
		return fmt.Sprint(*v)
	}
	str := func(q api.Quotas) string {
		return fmt.Sprintf("vcpus %s, memory_mib %s, disk_mib %s, vms %s", show(q.VCPUs), show(q.MemoryMiB), show(q.DiskMiB), show(q.VMs))
	}
	return func(*terraform.State) error {
		p, err := f.Control.Client.GetProject(context.Background(), name)
		if err != nil {
			return fmt.Errorf("reading project %s: %w", name, err)
		}
		if got := str(p.Quotas); got != str(want) {
			return fmt.Errorf("project %s has quotas %s on the control API; want %s", name, got, str(want))
		}
		return nil
	}
}

func TestAccProject_import(t *testing.T) {
	f := newFleet(t, "h1")
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkProjectsGone("team-a"),
		Steps: []resource.TestStep{
			{
				Config: projectConfig(f, `
  name        = "team-a"
  description = "Team A"
  quotas = {
    vcpus    = 4
    disk_mib = 100000
  }
  host_labels = { tier = "gold" }
`),
			},
			{
				ResourceName:      projectAddr,
				ImportState:       true,
				ImportStateId:     "team-a",
				ImportStateVerify: true,
			},
			{
				ResourceName:  projectAddr,
				ImportState:   true,
				ImportStateId: "no-such-project",
				ExpectError:   regexp.MustCompile(`Cannot\s+import\s+non-existent\s+remote\s+object`),
			},
		},
	})
}

func TestAccProject_disappears(t *testing.T) {
	f := newFleet(t, "h1")
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkProjectsGone("team-a"),
		Steps: []resource.TestStep{
			{
				Config: projectConfig(f, `  name = "team-a"`),
				Check: func(*terraform.State) error {
					return f.Control.Client.DeleteProject(context.Background(), "team-a")
				},
				ExpectNonEmptyPlan: true,
			},
		},
	})
}

// TestAccProjectDataSource_usage: a project token's configuration creates a
// VM without naming a project; the VM lands in the token's project, and
// the project's usage (read with the same token) shows it.
func TestAccProjectDataSource_usage(t *testing.T) {
	f := newFleet(t, "h1")
	f.createProject(t, "team-a")
	config := f.providerBlockAs("kvm", f.projectToken(t, "team-a"), "") + `
resource "kvm_vm" "test" {
  name       = "a-1"
  image      = "sim"
  vcpus      = 2
  memory_mib = 512
  disk_mib   = 2048
}

data "kvm_project" "a" {
  name       = "team-a"
  depends_on = [kvm_vm.test]
}
`
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{
				Config: config,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("project"), knownvalue.StringExact("team-a")),
					statecheck.ExpectKnownValue("data.kvm_project.a", tfjsonpath.New("usage"), usageCheck(2, 512, 2048, 1)),
					statecheck.ExpectKnownValue("data.kvm_project.a", tfjsonpath.New("quotas"),
						quotasCheck(unlimited, unlimited, unlimited, unlimited)),
				},
			},
			{
				ResourceName:            vmAddr,
				ImportState:             true,
				ImportStateVerify:       true,
				ImportStateVerifyIgnore: []string{"timeouts"},
			},
			{
				// The project's own token reads no other project.
				Config: config + `
data "kvm_project" "default" {
  name = "default"
}
`,
				ExpectError: regexp.MustCompile(`(?s)No\s+such\s+project.*"default"`),
			},
			{
				// Nor manages projects: that needs an admin token.
				Config: config + `
resource "kvm_project" "mine" {
  name = "team-a2"
}
`,
				ExpectError: regexp.MustCompile(`(?s)Unable\s+to\s+Create\s+Project.*projects\s+and\s+tokens\s+need\s+scope\s+"admin"`),
			},
		},
	})
}

// TestAccProject_usageRefreshes: a kvm_project's usage follows VMs made in
// it (here in the same configuration, through the provider's project from
// KVM_PROJECT, which networks follow too): the refresh after apply reads
// it, and no change is planned.
func TestAccProject_usageRefreshes(t *testing.T) {
	f := newFleet(t, "h1")
	members := `
resource "kvm_vm" "test" {
  name       = "a-1"
  image      = "sim"
  vcpus      = 2
  memory_mib = 512
  disk_mib   = 2048
  depends_on = [kvm_project.test]
}

resource "kvm_network" "lan" {
  name       = "lan-a"
  mode       = "nat"
  cidr       = "10.40.0.0/24"
  depends_on = [kvm_project.test]
}
`
	withMembers := projectConfig(f, `  name = "team-a"`) + members
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(env(map[string]string{provider.EnvProject: "team-a"})),
		CheckDestroy: func(s *terraform.State) error {
			return errors.Join(f.checkNetworksGone("lan-a")(s), f.checkProjectsGone("team-a")(s))
		},
		Steps: []resource.TestStep{
			{
				Config: projectConfig(f, `  name = "team-a"`),
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(projectAddr, tfjsonpath.New("usage"), usageCheck(0, 0, 0, 0)),
				},
			},
			{
				// project comes from KVM_PROJECT.
				Config: withMembers,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(projectAddr, plancheck.ResourceActionNoop)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("project"), knownvalue.StringExact("team-a")),
					statecheck.ExpectKnownValue("kvm_network.lan", tfjsonpath.New("project"), knownvalue.StringExact("team-a")),
				},
			},
			{
				// The state after that apply predates the VM; the refresh
				// of the next one reads the usage.
				Config: withMembers,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(projectAddr, tfjsonpath.New("usage"), usageCheck(2, 512, 2048, 1)),
				},
			},
			{
				// A project that still holds a VM and a network is kept, with
				// an error that says what to delete first.
				Config:      f.providerBlock() + strings.ReplaceAll(members, "depends_on = [kvm_project.test]", ""),
				ExpectError: regexp.MustCompile(`(?s)Unable\s+to\s+Delete\s+Project.*"team-a"\s+still\s+holds\s+VMs`),
			},
			{Config: withMembers},
		},
	})
}

// TestAccProjectToken_cannotReadOtherProjectsVM: a VM of project B is
// not found with project A's token, exactly like an unknown id, and found
// with B's.
func TestAccProjectToken_cannotReadOtherProjectsVM(t *testing.T) {
	f := newFleet(t, "h1")
	f.createProject(t, "team-a")
	f.createProject(t, "team-b")
	tokenA, tokenB := f.projectToken(t, "team-a"), f.projectToken(t, "team-b")
	vmInB := f.providerBlockAs("kvm", f.Control.Token, "team-b") + `
resource "kvm_vm" "test" {
  name       = "b-1"
  image      = "sim"
  vcpus      = 1
  memory_mib = 512
  disk_mib   = 2048
}
`
	peek := func(token string) string {
		return vmInB + f.providerBlockAs("kvmpeer", token, "") + `
data "kvm_vm" "peek" {
  provider = kvmpeer
  id       = kvm_vm.test.id
}
`
	}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: peerFactories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{
				Config: vmInB,
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("project"), knownvalue.StringExact("team-b")),
				},
			},
			{
				Config:      peek(tokenA),
				ExpectError: regexp.MustCompile(`(?s)Unable to Read VM.*No\s+such\s+VM`),
			},
			{
				Config: peek(tokenB),
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue("data.kvm_vm.peek", tfjsonpath.New("name"), knownvalue.StringExact("b-1")),
					statecheck.ExpectKnownValue("data.kvm_vm.peek", tfjsonpath.New("project"), knownvalue.StringExact("team-b")),
				},
			},
			{
				// A project token naming another project cannot create in it.
				Config: vmInB + f.providerBlockAs("kvmpeer", tokenA, "team-b") + `
resource "kvm_vm" "intruder" {
  provider   = kvmpeer
  name       = "a-in-b"
  image      = "sim"
  vcpus      = 1
  memory_mib = 512
  disk_mib   = 2048
}
`,
				ExpectError: regexp.MustCompile(`(?s)Unable to Create VM.*project\s+"team-b"\s+that\s+this\s+token\s+may\s+use`),
			},
		},
	})
}

// TestAccProject_quotaExceeded: a VM larger than its project's quota fails
// to create with an error naming the project and the quota; raising the
// quota in place lets the same VM in.
func TestAccProject_quotaExceeded(t *testing.T) {
	f := newFleet(t, "h1")
	project := func(vcpus int) string {
		return f.providerBlockAs("kvm", f.Control.Token, "tiny") + fmt.Sprintf(`
resource "kvm_project" "test" {
  name   = "tiny"
  quotas = { vcpus = %d }
}
`, vcpus)
	}
	vm := `
resource "kvm_vm" "test" {
  name       = "big"
  image      = "sim"
  vcpus      = 2
  memory_mib = 512
  disk_mib   = 2048
  depends_on = [kvm_project.test]
}
`
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkProjectsGone("tiny"),
		Steps: []resource.TestStep{
			{Config: project(1)},
			{
				Config:      project(1) + vm,
				ExpectError: regexp.MustCompile(`(?s)Unable to Create VM.*vcpus\s+quota\s+of\s+project\s+"tiny".*limit\s+is\s+1,.*holds\s+0\s.*asks\s+for\s+2\s+more`),
			},
			{
				Config: project(2) + vm,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{
						plancheck.ExpectResourceAction(projectAddr, plancheck.ResourceActionUpdate),
						plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionCreate),
					},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("project"), knownvalue.StringExact("tiny")),
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("observed_state"), knownvalue.StringExact("running")),
				},
			},
		},
	})
}

// TestAccProject_providerSettingErrors: a provider project that is no
// project name is refused before any request, from the block or from
// KVM_PROJECT.
func TestAccProject_providerSettingErrors(t *testing.T) {
	f := newFleet(t)
	hosts := `
data "kvm_hosts" "all" {}
`
	resource.Test(t, resource.TestCase{
		Steps: []resource.TestStep{
			{
				ProtoV6ProviderFactories: factories(),
				Config:                   f.providerBlockAs("kvm", f.Control.Token, "Team_A") + hosts,
				ExpectError:              regexp.MustCompile(`(?s)project.*DNS\s+label`),
			},
			{
				ProtoV6ProviderFactories: factories(env(map[string]string{provider.EnvEndpoint: f.Control.URL,
					provider.EnvToken: f.Control.Token, provider.EnvProject: "Team_A"})),
				Config:      `provider "kvm" {}` + hosts,
				ExpectError: regexp.MustCompile(`(?s)Invalid\s+KVM\s+Project.*"Team_A".*KVM_PROJECT`),
			},
		},
	})
}
