package bench

import (
	"context"
	"fmt"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// BenchmarkPlacementProject is BenchmarkPlacement at 10,000 hosts on
// PostgreSQL with projects in the reservation statement:
//
//   - default: every VM in the default project (no quota: its usage row is
//     still counted in the statement).
//   - quota: every VM in one project whose quotas (vcpus, memory, disk, vms)
//     are set and never reached: the CHECKs run on every reservation.
//   - ten-projects: the clients' VMs spread over ten such projects.
//
// The comparison is with BenchmarkPlacement/postgres/hosts=10000
// of the commit before projects, run alternately in the same sitting
// (bench/README.md):
//
//	go test ./bench -run '^$' -bench PlacementProject -benchtime 3000x -count 5
func BenchmarkPlacementProject(b *testing.B) {
	defer machineState(b)()
	const n = 10000
	big := int64(1) << 50
	quotas := store.Quotas{VCPUs: &big, MemoryMiB: &big, DiskMiB: &big, VMs: &big}
	variants := []struct {
		name     string
		projects int // 0: the default project
	}{
		{"default", 0},
		{"quota", 1},
		{"ten-projects", 10},
	}
	for _, v := range variants {
		b.Run(fmt.Sprintf("%s/hosts=%d/%s", store.DialectPostgres, n, v.name), func(b *testing.B) {
			ctx := context.Background()
			st := openStore(b, store.DialectPostgres)
			addHosts(b, st, n)
			names := []string{""}
			if v.projects > 0 {
				names = names[:0]
				for i := range v.projects {
					p, err := st.InsertProject(ctx, store.Project{Name: fmt.Sprintf("team-%d", i), Quotas: quotas})
					if err != nil {
						b.Fatal(err)
					}
					names = append(names, p.Name)
				}
			}
			svc, err := control.New(ctx, st, control.Options{AgentToken: "unused"})
			if err != nil {
				b.Fatal(err)
			}
			runPlacements(b, svc, names)
		})
	}
}
