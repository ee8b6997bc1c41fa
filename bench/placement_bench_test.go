// Package bench measures the control plane. Benchmarks report numbers and
// never pass or fail on speed.
//
// Placement + reservation per second, in process, no agent calls, at
// 100 to 100,000 hosts:
//
//	KVM_TEST_DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//	  go test ./bench -run '^$' -bench 'Placement$' -benchtime 3s
//
// With and without a group constraint at 10,000 hosts:
//
//	go test ./bench -run '^$' -bench 'PlacementGroup' -benchtime 3s
package bench

import (
	"context"
	"fmt"
	"runtime"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
	"github.com/kvmfleet/terraform-provider-kvm/internal/scheduler"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// Hosts are large enough that no benchmark run fills them, so every
// iteration is one placement and one committed reservation.
var benchHostTotal = store.Resources{VCPUs: 1 << 20, MemoryMiB: 1 << 40, DiskMiB: 1 << 50}

var hostCounts = []int{100, 1000, 10000, 100000}

// parallelism is the number of clients per GOMAXPROCS (RunParallel).
const parallelism = 4

// sqliteFullSync is SQLite with an fsync per commit (kvmd control's
// default, --sqlite-sync full); plain "sqlite" is --sqlite-sync normal.
const sqliteFullSync = "sqlite-fullsync"

func openStore(b *testing.B, dialect string) *store.Store {
	b.Helper()
	cfg := store.Config{DataDir: b.TempDir()}
	switch dialect {
	case store.DialectPostgres:
		cfg = store.Config{DatabaseURL: testenv.PostgresURL(b)}
	case sqliteFullSync:
		cfg.SQLiteFullSync = true
	}
	st, err := store.Open(context.Background(), cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = st.Close() })
	return st
}

// benchRacks is how many racks the hosts are spread over (label rack).
const benchRacks = 100

func addHosts(b *testing.B, st *store.Store, n int) {
	b.Helper()
	hosts := make([]store.Host, n)
	for i := range hosts {
		hosts[i] = store.Host{Name: fmt.Sprintf("host-%05d", i), Address: "127.0.0.1:1", Schedulable: true,
			CPUAllocationRatio: 1, Images: []string{"sim"}, Total: benchHostTotal, Capacity: benchHostTotal,
			Labels: map[string]string{"rack": fmt.Sprintf("r%02d", i%benchRacks)}}
	}
	if err := st.UpsertHosts(context.Background(), hosts); err != nil {
		b.Fatal(err)
	}
}

var vmSeq atomic.Int64

// BenchmarkPlacement: control.Service.Reserve, i.e. choose a host from the
// indexed host view, then one transaction with the conditional UPDATE of
// the host and the INSERT of the VM row.
//
// Besides placements/s it reports what the host view costs at that size:
// seed-s (registering the hosts, batched inserts, once per case),
// view-B/host (the heap the control plane holds after loading the hosts,
// after GC, per host), and after the timed run refresh-ms (one refresh of
// the host view as the host monitor does it each interval, with the rows
// the run's reservations changed) and reload-ms (a full reload of every
// host, the safety net).
func BenchmarkPlacement(b *testing.B) {
	defer machineState(b)()
	for _, dialect := range []string{store.DialectSQLite, sqliteFullSync, store.DialectPostgres} {
		for _, n := range hostCounts {
			// One fleet per case: the benchmark body runs again for each
			// b.N it tries, and 100,000 hosts take a while to register.
			// The store belongs to the parent (a sub-benchmark's cleanups
			// run after each b.N).
			var svc *control.Service
			var seed time.Duration
			var perHost float64
			parent := b
			b.Run(fmt.Sprintf("%s/hosts=%d", dialect, n), func(b *testing.B) {
				// The parent's metrics are not printed: each case reports
				// the machine's state itself.
				defer machineState(b)()
				ctx := context.Background()
				if svc == nil {
					st := openStore(parent, dialect)
					start := time.Now()
					addHosts(b, st, n)
					seed = time.Since(start)
					before := heapAfterGC()
					var err error
					if svc, err = control.New(ctx, st, control.Options{AgentToken: "unused"}); err != nil {
						b.Fatal(err)
					}
					perHost = float64(heapAfterGC()-before) / float64(n)
				}
				runPlacements(b, svc, []string{""})
				b.StopTimer()
				b.ReportMetric(seed.Seconds(), "seed-s")
				b.ReportMetric(perHost, "view-B/host")
				start := time.Now()
				if err := svc.RefreshHostView(ctx); err != nil {
					b.Fatal(err)
				}
				b.ReportMetric(float64(time.Since(start).Microseconds())/1000, "refresh-ms")
				start = time.Now()
				if err := svc.ReloadHostView(ctx); err != nil {
					b.Fatal(err)
				}
				b.ReportMetric(float64(time.Since(start).Microseconds())/1000, "reload-ms")
				runtime.KeepAlive(svc)
			})
		}
	}
}

// heapAfterGC is the live heap after a full collection.
func heapAfterGC() int64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapAlloc)
}

// runPlacements is the timed part of the placement benchmarks: parallel
// clients reserve 1-vCPU VMs through svc, each client in one of projects
// ("" for the default project), and the throughput and the control
// plane's CPU per placement are reported.
func runPlacements(b *testing.B, svc *control.Service, projects []string) {
	ctx := context.Background()
	var seq atomic.Int64
	b.SetParallelism(parallelism)
	b.ReportAllocs()
	cpu := startCPU()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		// Each client stays in one project, as a team's apply would.
		project := projects[int(seq.Add(1))%len(projects)]
		for pb.Next() {
			_, err := svc.Reserve(ctx, control.ReserveRequest{ID: uuid.Must(uuid.NewV7()).String(),
				Name: fmt.Sprintf("bench-%d", vmSeq.Add(1)), Image: "sim", Project: project,
				Resources: api.Resources{VCPUs: 1, MemoryMiB: 1024, DiskMiB: 10240}})
			if err != nil {
				b.Error(err)
				return
			}
		}
	})
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "placements/s")
	cpu.report(b, "control-cpu-µs/op")
}

// cpuClock reads the CPU time of this process (user and system), the
// control plane's own work per placement: on a machine shared with the
// database and other load, it moves less than placements/s.
type cpuClock struct{ start time.Duration }

func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func startCPU() cpuClock { return cpuClock{start: processCPU()} }

// report adds the process's CPU time per iteration since start, in µs.
func (c cpuClock) report(b *testing.B, unit string) {
	b.ReportMetric(float64((processCPU()-c.start).Microseconds())/float64(b.N), unit)
}

// BenchmarkPlacementGroup compares placement at 10,000 hosts (100 racks)
// without constraints against placement with a group constraint: every
// grouped placement reads its group's counts per domain and takes a slot
// (a conditional upsert) in the reservation's transaction.
//
//   - none: no constraints (the same as BenchmarkPlacement/hosts=10000).
//   - rack-spread: every VM in one group spread by label:rack, no cap: the
//     worst case for the group rows, which all placements update.
//   - anti-affinity: services of 10 replicas (a group per 10 VMs), spread by
//     host with max_per_domain = 1.
func BenchmarkPlacementGroup(b *testing.B) {
	defer machineState(b)()
	const n = 10000
	variants := []struct {
		name        string
		constraints func(i int64) *api.Constraints
	}{
		{"none", func(int64) *api.Constraints { return nil }},
		{"rack-spread", func(int64) *api.Constraints {
			return &api.Constraints{Group: "web", SpreadBy: "label:rack"}
		}},
		{"anti-affinity", func(i int64) *api.Constraints {
			return &api.Constraints{Group: fmt.Sprintf("svc-%d", i/10), SpreadBy: "host", MaxPerDomain: 1}
		}},
	}
	for _, dialect := range []string{store.DialectSQLite, store.DialectPostgres} {
		for _, v := range variants {
			b.Run(fmt.Sprintf("%s/hosts=%d/%s", dialect, n, v.name), func(b *testing.B) {
				ctx := context.Background()
				st := openStore(b, dialect)
				addHosts(b, st, n)
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
						i := seq.Add(1)
						_, err := svc.Reserve(ctx, control.ReserveRequest{ID: uuid.Must(uuid.NewV7()).String(),
							Name: fmt.Sprintf("group-%d", vmSeq.Add(1)), Image: "sim", Constraints: v.constraints(i),
							Resources: api.Resources{VCPUs: 1, MemoryMiB: 1024, DiskMiB: 10240}})
						if err != nil {
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

// BenchmarkReservationOnly is the floor: the same transaction on a host
// chosen round robin, with no scoring at all.
func BenchmarkReservationOnly(b *testing.B) {
	defer machineState(b)()
	for _, dialect := range []string{store.DialectSQLite, sqliteFullSync, store.DialectPostgres} {
		b.Run(dialect, func(b *testing.B) {
			ctx := context.Background()
			st := openStore(b, dialect)
			const n = 1000
			addHosts(b, st, n)
			b.SetParallelism(parallelism)
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					i := vmSeq.Add(1)
					err := st.ReserveAndInsertVM(ctx, store.VM{ID: uuid.Must(uuid.NewV7()).String(), Name: fmt.Sprintf("bare-%d", i),
						HostName: fmt.Sprintf("host-%05d", i%n), Image: "sim", PowerState: "running", ObservedState: "creating",
						Resources: store.Resources{VCPUs: 1, MemoryMiB: 1024, DiskMiB: 10240}})
					if err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "reservations/s")
		})
	}
}

// BenchmarkChooseHost isolates the in-memory choice: the index's bounded
// candidate walk against a full scan of every host.
func BenchmarkChooseHost(b *testing.B) {
	defer machineState(b)()
	req := scheduler.Request{Image: "sim", Resources: scheduler.Resources{VCPUs: 1, MemoryMiB: 1024, DiskMiB: 10240}}
	for _, n := range hostCounts {
		hosts := make([]scheduler.Host, n)
		ix := scheduler.NewIndex(scheduler.DefaultWeights())
		for i := range hosts {
			hosts[i] = scheduler.Host{Name: fmt.Sprintf("host-%06d", i), Alive: true, Schedulable: true, Images: []string{"sim"},
				Total:     scheduler.Resources{VCPUs: 64, MemoryMiB: 262144, DiskMiB: 4 << 20},
				Allocated: scheduler.Resources{VCPUs: int64(i % 48), MemoryMiB: int64(i%200) * 1024, DiskMiB: int64(i%100) * 10240}}
			ix.Upsert(hosts[i])
		}
		b.Run(fmt.Sprintf("index/hosts=%d", n), func(b *testing.B) {
			for b.Loop() {
				best, ok := ix.Candidates(req, 32).Best()
				if !ok {
					b.Fatal("no candidate")
				}
				ix.Adjust(best.Host, req.Resources)
				ix.Adjust(best.Host, scheduler.Resources{}.Sub(req.Resources))
			}
		})
		b.Run(fmt.Sprintf("fullscan/hosts=%d", n), func(b *testing.B) {
			for b.Loop() {
				if _, ok := scheduler.Rank(scheduler.DefaultWeights(), hosts, req).Best(); !ok {
					b.Fatal("no candidate")
				}
			}
		})
	}
}

// BenchmarkPlacementIPAM is BenchmarkPlacement on 1,000 hosts with the
// VM's NICs in the reservation: none (no NIC rows at all, the cost before
// networks), one user-mode NIC (a MAC row under its unique index, what a VM
// without network_interface blocks gets), and one NIC on a nat /16 (a MAC
// and an IPAM address under both unique indexes, probed from a hint).
//
//	KVM_TEST_DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//	  go test ./bench -run '^$' -bench 'PlacementIPAM' -benchtime 3s
func BenchmarkPlacementIPAM(b *testing.B) {
	defer machineState(b)()
	variants := []struct {
		name string
		nics []api.NetworkInterface
	}{
		{"nics=none", []api.NetworkInterface{}},
		{"nics=user", nil},
		{"nics=nat", []api.NetworkInterface{{Network: "lan"}}},
	}
	for _, dialect := range []string{store.DialectSQLite, store.DialectPostgres} {
		for _, v := range variants {
			b.Run(fmt.Sprintf("%s/%s", dialect, v.name), func(b *testing.B) {
				ctx := context.Background()
				st := openStore(b, dialect)
				addHosts(b, st, 1000)
				svc, err := control.New(ctx, st, control.Options{AgentToken: "unused"})
				if err != nil {
					b.Fatal(err)
				}
				if _, err := svc.CreateNetwork(ctx, api.NetworkCreate{Name: "lan", Mode: api.NetworkNAT, CIDR: "10.64.0.0/16"}); err != nil {
					b.Fatal(err)
				}
				b.SetParallelism(parallelism)
				b.ReportAllocs()
				b.ResetTimer()
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						i := vmSeq.Add(1)
						_, err := svc.Reserve(ctx, control.ReserveRequest{ID: uuid.Must(uuid.NewV7()).String(),
							Name: fmt.Sprintf("bench-%d", i), Image: "sim", NetworkInterfaces: v.nics,
							Resources: api.Resources{VCPUs: 1, MemoryMiB: 1024, DiskMiB: 10240}})
						if err != nil {
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
