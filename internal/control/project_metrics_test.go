package control_test

import (
	"net/http"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// /metrics, scraped over HTTP, reports each project's usage per resource
// and its quota only for the resources that have one, as the host monitor
// last read them (a scrape issues no SQL): a round after a delete and a
// quota change, the scrape shows them.
func TestProjectMetrics(t *testing.T) {
	eachDatabase(t, func(t *testing.T, url string) {
		ctx := ctxT(t)
		c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: url})
		a := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 8, MemoryMiB: 4096, DiskMiB: 8192})
		c.RegisterHost(t, "h1", a.Address)
		createProject(t, c, api.ProjectCreate{Name: "team-a", Quotas: api.Quotas{VCPUs: quotaOf(4), VMs: quotaOf(3)}})
		vm, err := c.Client.CreateVM(ctx, api.VMCreate{Name: "web", Project: "team-a", Image: "sim",
			VCPUs: 2, MemoryMiB: 128, DiskMiB: 256}, "")
		if err != nil {
			t.Fatal(err)
		}

		c.Service.SyncNow(ctx)
		series := func(metric, project, resource string) string {
			return metric + `{project="` + project + `",resource="` + resource + `"}`
		}
		expect := func(when string, want map[string]string) {
			t.Helper()
			for s, v := range want {
				if got := metricValue(t, c, s); got != v {
					t.Errorf("%s: %s = %q, want %q", when, s, got, v)
				}
			}
		}
		expect("a VM of 2 vCPU, 128 MiB, 256 MiB disk in team-a", map[string]string{
			series("kvm_project_usage", "team-a", api.ResourceVCPUs):     "2",
			series("kvm_project_usage", "team-a", api.ResourceMemoryMiB): "128",
			series("kvm_project_usage", "team-a", api.ResourceDiskMiB):   "256",
			series("kvm_project_usage", "team-a", api.ResourceVMs):       "1",
			series("kvm_project_quota", "team-a", api.ResourceVCPUs):     "4",
			series("kvm_project_quota", "team-a", api.ResourceVMs):       "3",
			// Unlimited: no quota series at all.
			series("kvm_project_quota", "team-a", api.ResourceMemoryMiB): "",
			series("kvm_project_quota", "team-a", api.ResourceDiskMiB):   "",
			// The default project is there, empty and unlimited.
			series("kvm_project_usage", api.DefaultProject, api.ResourceVMs): "0",
			series("kvm_project_quota", api.DefaultProject, api.ResourceVMs): "",
		})

		if err := c.Client.DeleteVM(ctx, vm.ID); err != nil {
			t.Fatal(err)
		}
		var p api.Project
		if status, e := projectCall(t, c, c.Token, http.MethodPatch, "/v1/projects/team-a",
			api.ProjectPatch{Quotas: &api.Quotas{MemoryMiB: quotaOf(1024)}}, &p); status != http.StatusOK {
			t.Fatalf("patch team-a's quotas: %d %+v", status, e)
		}
		c.Service.SyncNow(ctx)
		expect("after the delete and a quota of memory only", map[string]string{
			series("kvm_project_usage", "team-a", api.ResourceVCPUs):     "0",
			series("kvm_project_usage", "team-a", api.ResourceVMs):       "0",
			series("kvm_project_quota", "team-a", api.ResourceMemoryMiB): "1024",
			series("kvm_project_quota", "team-a", api.ResourceVCPUs):     "",
			series("kvm_project_quota", "team-a", api.ResourceVMs):       "",
		})
	})
}
