package bench

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"testing"

	"github.com/google/uuid"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// BenchmarkPlacementVolume compares placement at 10,000 hosts without and
// with a volume filter, side by side, on SQLite and PostgreSQL:
//
//   - none: no volumes (the same as BenchmarkPlacement/hosts=10000).
//
//   - volume: every VM attaches one ready volume read-write (each its own,
//     made before the timer on a host drawn at random): placement goes to
//     the volume's host alone (no candidate walk) and the reservation's
//     transaction attaches the volume by a conditional UPDATE of its row.
//
//     go test ./bench -run '^$' -bench PlacementVolume -benchtime 3000x -count 3
func BenchmarkPlacementVolume(b *testing.B) {
	defer machineState(b)()
	const n = 10000
	for _, dialect := range []string{store.DialectSQLite, store.DialectPostgres} {
		for _, withVolume := range []bool{false, true} {
			name := "none"
			if withVolume {
				name = "volume"
			}
			b.Run(fmt.Sprintf("%s/hosts=%d/%s", dialect, n, name), func(b *testing.B) {
				ctx := context.Background()
				st := openStore(b, dialect)
				addHosts(b, st, n)
				var vols []string
				if withVolume {
					r := rand.New(rand.NewPCG(1, 2))
					for i := range b.N {
						v := store.Volume{ID: uuid.NewString(), Name: fmt.Sprintf("vol-%d-%d", i, vmSeq.Add(1)),
							HostName: fmt.Sprintf("host-%05d", r.IntN(n)), SizeMiB: 1024}
						if err := st.ReserveAndInsertVolume(ctx, v); err != nil {
							b.Fatal(err)
						}
						if err := st.MarkVolumeReady(ctx, v.ID); err != nil {
							b.Fatal(err)
						}
						vols = append(vols, v.ID)
					}
				}
				svc, err := control.New(ctx, st, control.Options{AgentToken: "unused"})
				if err != nil {
					b.Fatal(err)
				}
				var seq atomic.Int64
				b.SetParallelism(parallelism)
				b.ReportAllocs()
				b.ResetTimer()
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						i := seq.Add(1) - 1
						r := control.ReserveRequest{ID: uuid.Must(uuid.NewV7()).String(), Name: fmt.Sprintf("vol-vm-%d", vmSeq.Add(1)),
							Image: "sim", Resources: api.Resources{VCPUs: 1, MemoryMiB: 1024, DiskMiB: 10240}}
						if withVolume {
							r.Volumes = []api.VMVolume{{Volume: vols[i]}}
						}
						if _, err := svc.Reserve(ctx, r); err != nil {
							b.Error(err)
							return
						}
					}
				})
				b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "placements/s")
			})
		}
	}
}
