package provider_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-testing/compare"
	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/provider"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

const (
	forkAddr   = "kvm_fork.test"
	sourceAddr = "kvm_vm.source"
)

// forkConfig is a running source VM of srcVCPUs pinned to host h1 and a
// kvm_fork of it with count children and the given extra arguments.
func forkConfig(f *fleet, srcVCPUs, count int, extra string) string {
	return f.providerBlock() + fmt.Sprintf(`
resource "kvm_vm" "source" {
  name       = "fork-source"
  image      = "sim"
  vcpus      = %d
  memory_mib = 512
  disk_mib   = 1024
  host       = "h1"
}

resource "kvm_fork" "test" {
  source_vm_id = kvm_vm.source.id
  child_count  = %d
%s
}
`, srcVCPUs, count, extra)
}

// child is the check of one element of children (of a source VM made
// without a project: its children are in "default" too).
func child(host string) knownvalue.Check {
	return knownvalue.ObjectPartial(map[string]knownvalue.Check{
		"id":             knownvalue.NotNull(),
		"project":        knownvalue.StringExact(api.DefaultProject),
		"host":           knownvalue.StringExact(host),
		"observed_state": knownvalue.StringExact(api.StateRunning),
		"volume_ids":     knownvalue.ListSizeExact(0), // a source without volumes
	})
}

func childID(i int) tfjsonpath.Path {
	return tfjsonpath.New("children").AtSliceIndex(i).AtMapKey("id")
}

// forkIDs remembers the id of every fork a test made, for CheckDestroy.
type forkIDs struct {
	mu  sync.Mutex
	ids []string
}

func (k *forkIDs) capture(addr string) resource.TestCheckFunc {
	return func(s *terraform.State) error {
		var id string
		if err := captureAttr(addr, "id", &id)(s); err != nil {
			return err
		}
		k.mu.Lock()
		defer k.mu.Unlock()
		for _, seen := range k.ids {
			if seen == id {
				return nil
			}
		}
		k.ids = append(k.ids, id)
		return nil
	}
}

func (k *forkIDs) all() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	return append([]string(nil), k.ids...)
}

// checkForksDestroyed is the CheckDestroy of the fork tests: the fleet is
// empty (no VM on the control API or any agent, nothing allocated), no fork
// is left on the control API, and no agent holds any fork's snapshot.
func (f *fleet) checkForksDestroyed(forks *forkIDs) resource.TestCheckFunc {
	return func(s *terraform.State) error {
		errs := []error{f.checkFleetEmpty(s)}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		ids := forks.all()
		if len(ids) == 0 {
			errs = append(errs, errors.New("the test captured no fork id, so it cannot check that forks are gone"))
		}
		for _, id := range ids {
			if _, err := f.Control.Client.GetFork(ctx, id); !errors.Is(err, client.ErrNotFound) {
				errs = append(errs, fmt.Errorf("fork %s: GET /v1/forks/%s after destroy answered %v, want 404", id, id, err))
			}
			errs = append(errs, f.checkSnapshotOnAgents(ctx, id, nil))
		}
		return errors.Join(errs...)
	}
}

// checkSnapshotOnAgents checks which agents hold snapshot id: exactly the
// hosts in want (none when want is empty).
func (f *fleet) checkSnapshotOnAgents(ctx context.Context, id string, want map[string]bool) error {
	var errs []error
	for name, a := range f.Agents {
		_, err := a.Client.GetSnapshot(ctx, id)
		switch {
		case err == nil && !want[name]:
			errs = append(errs, fmt.Errorf("agent %s still holds snapshot %s", name, id))
		case errors.Is(err, agentapi.ErrNotFound) && want[name]:
			errs = append(errs, fmt.Errorf("agent %s does not hold snapshot %s, want it there", name, id))
		case err != nil && !errors.Is(err, agentapi.ErrNotFound):
			errs = append(errs, fmt.Errorf("reading snapshot %s on agent %s: %w", id, name, err))
		}
	}
	return errors.Join(errs...)
}

// checkForkOnFleet checks the fork in state against the fleet itself: every
// child is a VM of this fork started from its snapshot, running on its
// agent, and the snapshot is on the source's host and every child's host.
func (f *fleet) checkForkOnFleet(addr string) resource.TestCheckFunc {
	return func(s *terraform.State) error {
		var id string
		if err := captureAttr(addr, "id", &id)(s); err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		fk, err := f.Control.Client.GetFork(ctx, id)
		if err != nil {
			return fmt.Errorf("reading fork %s: %w", id, err)
		}
		if !fk.SnapshotTaken || fk.Phase != api.ForkReady {
			return fmt.Errorf("fork %s: snapshot_taken %v, phase %q; want true and ready", id, fk.SnapshotTaken, fk.Phase)
		}
		src, err := f.Control.Client.GetVM(ctx, fk.SourceVMID)
		if err != nil {
			return fmt.Errorf("reading source VM %s: %w", fk.SourceVMID, err)
		}
		holders := map[string]bool{src.Host: true}
		var errs []error
		children, err := f.Control.Client.AllVMs(ctx, client.ListOptions{ForkID: id})
		if err != nil {
			return fmt.Errorf("listing the children of fork %s: %w", id, err)
		}
		if len(children) != fk.Count {
			errs = append(errs, fmt.Errorf("the control API lists %d VMs of fork %s, want %d", len(children), id, fk.Count))
		}
		for _, c := range children {
			holders[c.Host] = true
			if c.StartedFrom != api.StartedSnapshot || c.ForkID != id {
				errs = append(errs, fmt.Errorf("child %s: started_from %q, fork_id %q; want snapshot and %s", c.Name, c.StartedFrom, c.ForkID, id))
			}
			avm, err := f.Agents[c.Host].Client.GetVM(ctx, c.ID)
			if err != nil {
				errs = append(errs, fmt.Errorf("child %s on agent %s: %w", c.Name, c.Host, err))
				continue
			}
			if avm.State != agentapi.StateRunning {
				errs = append(errs, fmt.Errorf("child %s on agent %s is %s, want running", c.Name, c.Host, avm.State))
			}
		}
		errs = append(errs, f.checkSnapshotOnAgents(ctx, fk.SnapshotID, holders))
		return errors.Join(errs...)
	}
}

// TestAccFork_basic: create a fork of a running VM, import it, scale it up
// and down in place, change pause_source in place, and replace it by
// changing placement.
func TestAccFork_basic(t *testing.T) {
	f := newFleet(t, "h1", "h2")
	forks := &forkIDs{}
	var sourceID string
	sameFork := statecheck.CompareValue(compare.ValuesSame())
	newFork := statecheck.CompareValue(compare.ValuesDiffer())
	sameSnapshot := statecheck.CompareValue(compare.ValuesSame())
	sameChild0 := statecheck.CompareValue(compare.ValuesSame())
	sameChild1 := statecheck.CompareValue(compare.ValuesSame())

	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkForksDestroyed(forks),
		Steps: []resource.TestStep{
			{
				Config: forkConfig(f, 1, 2, `
  timeouts {
    create = "3m"
  }
`),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(forkAddr, plancheck.ResourceActionCreate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(forkAddr, tfjsonpath.New("id"), knownvalue.NotNull()),
					statecheck.CompareValuePairs(forkAddr, tfjsonpath.New("source_vm_id"), sourceAddr, tfjsonpath.New("id"), compare.ValuesSame()),
					statecheck.CompareValuePairs(forkAddr, tfjsonpath.New("snapshot_id"), forkAddr, tfjsonpath.New("id"), compare.ValuesSame()),
					statecheck.ExpectKnownValue(forkAddr, tfjsonpath.New("child_count"), knownvalue.Int64Exact(2)),
					statecheck.ExpectKnownValue(forkAddr, tfjsonpath.New("pause_source"), knownvalue.Bool(false)),
					statecheck.ExpectKnownValue(forkAddr, tfjsonpath.New("placement"), knownvalue.StringExact(api.PlacementColocate)),
					statecheck.ExpectKnownValue(forkAddr, tfjsonpath.New("phase"), knownvalue.StringExact(api.ForkReady)),
					statecheck.ExpectKnownValue(forkAddr, tfjsonpath.New("created_at"),
						knownvalue.StringRegexp(regexp.MustCompile(`^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$`))),
					// colocate: both children fit on the source's host.
					statecheck.ExpectKnownValue(forkAddr, tfjsonpath.New("children"), knownvalue.ListExact([]knownvalue.Check{child("h1"), child("h1")})),
					statecheck.ExpectKnownValue(forkAddr, tfjsonpath.New("children").AtSliceIndex(1).AtMapKey("name"),
						knownvalue.StringRegexp(regexp.MustCompile(`-1$`))),
					sameFork.AddStateValue(forkAddr, tfjsonpath.New("id")),
					newFork.AddStateValue(forkAddr, tfjsonpath.New("id")),
					sameSnapshot.AddStateValue(forkAddr, tfjsonpath.New("snapshot_id")),
					sameChild0.AddStateValue(forkAddr, childID(0)),
					sameChild1.AddStateValue(forkAddr, childID(1)),
				},
				Check: resource.ComposeTestCheckFunc(
					forks.capture(forkAddr),
					captureAttr(sourceAddr, "id", &sourceID),
					f.checkForkOnFleet(forkAddr),
					f.checkAgentVMCount("h1", 3),
					f.checkAgentVMCount("h2", 0),
					// The source resumed after the snapshot.
					f.checkAgentVMState("h1", &sourceID, agentapi.StateRunning),
				),
			},
			{
				ResourceName:            forkAddr,
				ImportState:             true,
				ImportStateVerify:       true,
				ImportStateVerifyIgnore: []string{"timeouts"},
			},
			{
				// More children start from the same snapshot; the first two stay.
				Config: forkConfig(f, 1, 3, ""),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(forkAddr, plancheck.ResourceActionUpdate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(forkAddr, tfjsonpath.New("child_count"), knownvalue.Int64Exact(3)),
					statecheck.ExpectKnownValue(forkAddr, tfjsonpath.New("children"),
						knownvalue.ListExact([]knownvalue.Check{child("h1"), child("h1"), child("h1")})),
					statecheck.ExpectKnownValue(forkAddr, tfjsonpath.New("phase"), knownvalue.StringExact(api.ForkReady)),
					sameFork.AddStateValue(forkAddr, tfjsonpath.New("id")),
					sameSnapshot.AddStateValue(forkAddr, tfjsonpath.New("snapshot_id")),
					sameChild0.AddStateValue(forkAddr, childID(0)),
					sameChild1.AddStateValue(forkAddr, childID(1)),
				},
				Check: resource.ComposeTestCheckFunc(f.checkForkOnFleet(forkAddr), f.checkAgentVMCount("h1", 4)),
			},
			{
				// Fewer children remove the highest slots; slot 0 stays.
				Config: forkConfig(f, 1, 1, ""),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(forkAddr, plancheck.ResourceActionUpdate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(forkAddr, tfjsonpath.New("child_count"), knownvalue.Int64Exact(1)),
					statecheck.ExpectKnownValue(forkAddr, tfjsonpath.New("children"), knownvalue.ListExact([]knownvalue.Check{child("h1")})),
					statecheck.ExpectKnownValue(forkAddr, tfjsonpath.New("children").AtSliceIndex(0).AtMapKey("name"),
						knownvalue.StringRegexp(regexp.MustCompile(`-0$`))),
					sameFork.AddStateValue(forkAddr, tfjsonpath.New("id")),
					sameSnapshot.AddStateValue(forkAddr, tfjsonpath.New("snapshot_id")),
					sameChild0.AddStateValue(forkAddr, childID(0)),
				},
				Check: resource.ComposeTestCheckFunc(f.checkForkOnFleet(forkAddr), f.checkAgentVMCount("h1", 2),
					f.checkHostAllocated("h1", api.Resources{VCPUs: 2, MemoryMiB: 1024, DiskMiB: 2048})),
			},
			{
				// pause_source changes in place and is only recorded: the fork
				// point is taken, the source keeps running, the child stays.
				Config: forkConfig(f, 1, 1, `  pause_source = true`),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{
						plancheck.ExpectResourceAction(forkAddr, plancheck.ResourceActionUpdate),
						plancheck.ExpectKnownValue(forkAddr, tfjsonpath.New("snapshot_id"), knownvalue.NotNull()),
					},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(forkAddr, tfjsonpath.New("pause_source"), knownvalue.Bool(true)),
					sameFork.AddStateValue(forkAddr, tfjsonpath.New("id")),
					sameSnapshot.AddStateValue(forkAddr, tfjsonpath.New("snapshot_id")),
					sameChild0.AddStateValue(forkAddr, childID(0)),
				},
				Check: resource.ComposeTestCheckFunc(
					f.checkForkOnFleet(forkAddr),
					f.checkAgentVMState("h1", &sourceID, agentapi.StateRunning),
				),
			},
			{
				// placement cannot change in place: a new fork (a new snapshot,
				// new children) replaces the old one, and pause_source now acts.
				Config: forkConfig(f, 1, 1, `
  pause_source = true
  placement    = "spread"
`),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{
						plancheck.ExpectResourceAction(forkAddr, plancheck.ResourceActionDestroyBeforeCreate),
						plancheck.ExpectResourceAction(sourceAddr, plancheck.ResourceActionNoop),
					},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(forkAddr, tfjsonpath.New("placement"), knownvalue.StringExact(api.PlacementSpread)),
					statecheck.ExpectKnownValue(forkAddr, tfjsonpath.New("children"), knownvalue.ListSizeExact(1)),
					statecheck.CompareValuePairs(forkAddr, tfjsonpath.New("snapshot_id"), forkAddr, tfjsonpath.New("id"), compare.ValuesSame()),
					newFork.AddStateValue(forkAddr, tfjsonpath.New("id")),
				},
				Check: resource.ComposeTestCheckFunc(
					forks.capture(forkAddr),
					f.checkForkOnFleet(forkAddr),
					f.checkOldForksGone(forks, forkAddr),
					f.checkAgentVMState("h1", &sourceID, agentapi.StatePaused),
				),
			},
		},
	})
}

// checkOldForksGone checks that every captured fork but the one in state
// is gone from the control API and from every agent (its snapshot too).
func (f *fleet) checkOldForksGone(forks *forkIDs, addr string) resource.TestCheckFunc {
	return func(s *terraform.State) error {
		var current string
		if err := captureAttr(addr, "id", &current)(s); err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		var errs []error
		for _, id := range forks.all() {
			if id == current {
				continue
			}
			if _, err := f.Control.Client.GetFork(ctx, id); !errors.Is(err, client.ErrNotFound) {
				errs = append(errs, fmt.Errorf("replaced fork %s: GET answered %v, want 404", id, err))
			}
			vms, err := f.Control.Client.AllVMs(ctx, client.ListOptions{ForkID: id})
			if err != nil {
				return err
			}
			for _, vm := range vms {
				errs = append(errs, fmt.Errorf("child %s of replaced fork %s still exists", vm.Name, id))
			}
			errs = append(errs, f.checkSnapshotOnAgents(ctx, id, nil))
		}
		return errors.Join(errs...)
	}
}

// TestAccFork_spill: colocate fills the source's host, the rest spills to
// another host that pulls the snapshot; destroy removes it there too.
func TestAccFork_spill(t *testing.T) {
	f := newFleet(t, "h1", "h2")
	forks := &forkIDs{}
	// h1 has 8 vCPUs: the 4-vCPU source and one 4-vCPU child fill it.
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkForksDestroyed(forks),
		Steps: []resource.TestStep{
			{
				Config: forkConfig(f, 4, 2, ""),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(forkAddr, tfjsonpath.New("children"), knownvalue.ListExact([]knownvalue.Check{child("h1"), child("h2")})),
				},
				// checkForkOnFleet also wants the snapshot on h2, where it was pulled.
				Check: resource.ComposeTestCheckFunc(forks.capture(forkAddr), f.checkForkOnFleet(forkAddr),
					f.checkAgentVMCount("h1", 2), f.checkAgentVMCount("h2", 1)),
			},
		},
	})
}

func TestAccFork_disappears(t *testing.T) {
	f := newFleet(t, "h1")
	forks := &forkIDs{}
	var id string
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkForksDestroyed(forks),
		Steps: []resource.TestStep{
			{
				Config: forkConfig(f, 1, 2, ""),
				Check: resource.ComposeTestCheckFunc(
					forks.capture(forkAddr),
					captureAttr(forkAddr, "id", &id),
					func(*terraform.State) error { return f.Control.Client.DeleteFork(context.Background(), id) },
				),
				// Deleted behind Terraform's back: the refresh drops it and the
				// plan creates it again.
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectResourceAction(forkAddr, plancheck.ResourceActionCreate)},
				},
				ExpectNonEmptyPlan: true,
			},
			{
				Config: forkConfig(f, 1, 2, ""),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(forkAddr, plancheck.ResourceActionCreate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				Check: resource.ComposeTestCheckFunc(forks.capture(forkAddr), f.checkForkOnFleet(forkAddr),
					f.checkOldForksGone(forks, forkAddr), f.checkAgentVMCount("h1", 3)),
			},
		},
	})
}

// TestAccFork_sourceNotRunning: forking a stopped VM is a configuration
// mistake the diagnostic points at source_vm_id, and nothing is left behind.
func TestAccFork_sourceNotRunning(t *testing.T) {
	f := newFleet(t, "h1")
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{
				Config: f.providerBlock() + `
resource "kvm_vm" "source" {
  name        = "fork-source"
  image       = "sim"
  vcpus       = 1
  memory_mib  = 512
  disk_mib    = 1024
  power_state = "stopped"
}

resource "kvm_fork" "test" {
  source_vm_id = kvm_vm.source.id
  child_count  = 1
}
`,
				ExpectError: regexp.MustCompile(`(?s)Unable to Create Fork.*source_vm_id.*only a\s+running\s+VM\s+can\s+be\s+forked`),
			},
		},
	})
}

// TestAccFork_idempotentCreateAfterLostAnswer: the retry of a create whose
// answer was lost carries the same Idempotency-Key and yields the same fork,
// not a second snapshot and a second set of children.
func TestAccFork_idempotentCreateAfterLostAnswer(t *testing.T) {
	f := newFleet(t, "h1")
	forks := &forkIDs{}
	lossy := &loseFirstAnswer{path: "/v1/forks", next: http.DefaultTransport}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(provider.WithHTTPClient(&http.Client{Transport: lossy})),
		CheckDestroy:             f.checkForksDestroyed(forks),
		Steps: []resource.TestStep{
			{
				Config: forkConfig(f, 1, 2, ""),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				Check: resource.ComposeTestCheckFunc(
					forks.capture(forkAddr),
					f.checkForkOnFleet(forkAddr),
					// The source and two children: one set, not two.
					f.checkAgentVMCount("h1", 3),
					func(s *terraform.State) error {
						keys := lossy.createKeys()
						if len(keys) != 2 {
							return fmt.Errorf("saw %d fork creates, want 2 (the lost one and its retry): %q", len(keys), keys)
						}
						if keys[0] == "" || keys[0] != keys[1] {
							return fmt.Errorf("the retry sent Idempotency-Key %q, the first create %q: want the same key", keys[1], keys[0])
						}
						vms, err := f.Control.Client.AllVMs(context.Background(), client.ListOptions{})
						if err != nil {
							return err
						}
						var id string
						if err := captureAttr(forkAddr, "id", &id)(s); err != nil {
							return err
						}
						for _, vm := range vms {
							if vm.Name != "fork-source" && vm.ForkID != id {
								return fmt.Errorf("VM %s (%q) belongs to fork %q, not to the fork in state %s", vm.ID, vm.Name, vm.ForkID, id)
							}
						}
						return nil
					},
				),
			},
		},
	})
}

// TestAccForkDataSource reads a fork by id and finds what the resource holds.
func TestAccForkDataSource(t *testing.T) {
	f := newFleet(t, "h1")
	forks := &forkIDs{}
	const ds = "data.kvm_fork.by_id"
	same := func(attr string) statecheck.StateCheck {
		return statecheck.CompareValuePairs(ds, tfjsonpath.New(attr), forkAddr, tfjsonpath.New(attr), compare.ValuesSame())
	}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkForksDestroyed(forks),
		Steps: []resource.TestStep{
			{Config: forkConfig(f, 1, 2, ""), Check: forks.capture(forkAddr)},
			{
				Config: forkConfig(f, 1, 2, "") + `
data "kvm_fork" "by_id" {
  id = kvm_fork.test.id
}
`,
				ConfigStateChecks: []statecheck.StateCheck{
					same("id"), same("source_vm_id"), same("child_count"), same("pause_source"), same("placement"),
					same("snapshot_id"), same("phase"), same("children"), same("created_at"),
					statecheck.ExpectKnownValue(ds, tfjsonpath.New("children"), knownvalue.ListExact([]knownvalue.Check{child("h1"), child("h1")})),
				},
			},
			{
				Config: forkConfig(f, 1, 2, "") + `
data "kvm_fork" "missing" {
  id = "no-such-fork"
}
`,
				ExpectError: regexp.MustCompile(`(?s)Unable to Read Fork.*no fork no-such-fork`),
			},
		},
	})
}

// captureForksOfChildren adds the fork of every VM the control API holds to
// forks: the way to learn the id of a fork whose create failed.
func (f *fleet) captureForksOfChildren(t *testing.T, forks *forkIDs) {
	t.Helper()
	vms, err := f.Control.Client.AllVMs(ctxT(t), client.ListOptions{})
	if err != nil {
		t.Fatalf("listing VMs: %v", err)
	}
	forks.mu.Lock()
	defer forks.mu.Unlock()
	for _, vm := range vms {
		if vm.ForkID != "" && !slices.Contains(forks.ids, vm.ForkID) {
			forks.ids = append(forks.ids, vm.ForkID)
		}
	}
}

// TestAccFork_failedCreateIsReplaced: a fork whose pass fails (no host has
// room for its second child) stays in state as tainted, so nothing leaks;
// once there is room, the next apply deletes it and forks again.
func TestAccFork_failedCreateIsReplaced(t *testing.T) {
	f := newFleet(t, "h1")
	forks := &forkIDs{}
	// h1 has 8 vCPUs: the 4-vCPU source and one 4-vCPU child fill it.
	cfg := forkConfig(f, 4, 2, "")
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkForksDestroyed(forks),
		Steps: []resource.TestStep{
			{
				Config:      cfg,
				ExpectError: regexp.MustCompile(`(?s)Fork Failed to Become Ready.*stays in state as tainted`),
			},
			{
				PreConfig: func() {
					f.captureForksOfChildren(t, forks)
					if len(forks.all()) != 1 {
						t.Fatalf("after the failed create the control API holds children of forks %q, want one fork", forks.all())
					}
					f.addHost(t, "h2")
				},
				Config: cfg,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(forkAddr, plancheck.ResourceActionDestroyBeforeCreate)},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(forkAddr, tfjsonpath.New("phase"), knownvalue.StringExact(api.ForkReady)),
					statecheck.ExpectKnownValue(forkAddr, tfjsonpath.New("children"), knownvalue.ListExact([]knownvalue.Check{child("h1"), child("h2")})),
				},
				Check: resource.ComposeTestCheckFunc(forks.capture(forkAddr), f.checkForkOnFleet(forkAddr),
					f.checkOldForksGone(forks, forkAddr)),
			},
		},
	})
}

// TestAccFork_failedScaleIsResumed: a scale-up that fails leaves the fork
// failed on the control API; the next plan shows an update (phase unknown)
// and apply resumes the same fork, keeping its first child.
func TestAccFork_failedScaleIsResumed(t *testing.T) {
	f := newFleet(t, "h1")
	forks := &forkIDs{}
	sameFork := statecheck.CompareValue(compare.ValuesSame())
	sameChild0 := statecheck.CompareValue(compare.ValuesSame())
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkForksDestroyed(forks),
		Steps: []resource.TestStep{
			{
				Config: forkConfig(f, 4, 1, ""),
				ConfigStateChecks: []statecheck.StateCheck{
					sameFork.AddStateValue(forkAddr, tfjsonpath.New("id")),
					sameChild0.AddStateValue(forkAddr, childID(0)),
				},
				Check: forks.capture(forkAddr),
			},
			{
				Config:      forkConfig(f, 4, 2, ""),
				ExpectError: regexp.MustCompile(`(?s)Unable to Update Fork.*No host can take it`),
			},
			{
				PreConfig: func() { f.addHost(t, "h2") },
				Config:    forkConfig(f, 4, 2, ""),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{
						plancheck.ExpectResourceAction(forkAddr, plancheck.ResourceActionUpdate),
						plancheck.ExpectUnknownValue(forkAddr, tfjsonpath.New("phase")),
					},
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(forkAddr, tfjsonpath.New("phase"), knownvalue.StringExact(api.ForkReady)),
					statecheck.ExpectKnownValue(forkAddr, tfjsonpath.New("children"), knownvalue.ListExact([]knownvalue.Check{child("h1"), child("h2")})),
					sameFork.AddStateValue(forkAddr, tfjsonpath.New("id")),
					sameChild0.AddStateValue(forkAddr, childID(0)),
				},
				Check: f.checkForkOnFleet(forkAddr),
			},
		},
	})
}

// TestAccFork_qemuGuest forks a real guest (QEMU, TCG on this machine) into
// two children and destroys them: the snapshot, the spawns from it and the
// cleanup all run against real QEMU processes.
func TestAccFork_qemuGuest(t *testing.T) {
	accPreCheck(t)
	f := &fleet{Control: testenv.StartControl(t, testenv.ControlOptions{}), Agents: map[string]*testenv.Agent{}}
	a := testenv.StartAgent(t, testenv.AgentOptions{Driver: "qemu"})
	// Three 1-vCPU guests on a 2-core machine: overcommit the CPUs.
	ratio := 2.0
	if _, err := f.Control.Client.PutHost(ctxT(t), "q1", api.HostPut{Address: a.Address, CPUAllocationRatio: &ratio}); err != nil {
		t.Fatalf("registering host q1: %v", err)
	}
	f.Agents["q1"] = a
	forks := &forkIDs{}
	var sourceID string
	cfg := f.providerBlock() + `
resource "kvm_vm" "source" {
  name       = "fork-guest"
  image      = "busybox"
  vcpus      = 1
  memory_mib = 256
  disk_mib   = 256
}

resource "kvm_fork" "test" {
  source_vm_id = kvm_vm.source.id
  child_count  = 2
}
`
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkForksDestroyed(forks),
		Steps: []resource.TestStep{
			{
				// The source has booted before it is forked.
				Config: f.providerBlock() + `
resource "kvm_vm" "source" {
  name       = "fork-guest"
  image      = "busybox"
  vcpus      = 1
  memory_mib = 256
  disk_mib   = 256
}
`,
				Check: resource.ComposeTestCheckFunc(
					captureAttr(sourceAddr, "id", &sourceID),
					func(*terraform.State) error { return waitForConsole(a, sourceID, "kvm-guest-ready") },
				),
			},
			{
				Config: cfg,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(forkAddr, tfjsonpath.New("children"), knownvalue.ListExact([]knownvalue.Check{child("q1"), child("q1")})),
				},
				Check: resource.ComposeTestCheckFunc(forks.capture(forkAddr), f.checkForkOnFleet(forkAddr),
					f.checkAgentVMState("q1", &sourceID, agentapi.StateRunning)),
			},
			{
				Config: strings.Replace(cfg, "child_count  = 2", "child_count  = 1", 1),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(forkAddr, plancheck.ResourceActionUpdate)},
				},
				Check: resource.ComposeTestCheckFunc(f.checkForkOnFleet(forkAddr), f.checkAgentVMCount("q1", 2)),
			},
		},
	})
}
