package faulttest

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// SoakDurationEnv turns the soak on and says how long its chaos runs
// (a Go duration: 30m for the full soak, `make soak`; 2m to try it).
const SoakDurationEnv = "KVM_SOAK_DURATION"

// Soak sizes: 3 sim agents of 8 vCPUs and 16 GiB, VMs of 1 vCPU and 1 GiB,
// so the fleet holds 24 VMs and the workers keep it near full, where an
// oversubscription would show.
const (
	soakHosts      = 3
	soakReplicas   = 2
	soakWorkers    = 4
	soakHostVCPUs  = 8
	soakHostMemory = 16384
)

// TestSoak runs mixed creates, deletes, forks and fork deletes from
// soakWorkers workers against 2 replicas of kvmd control (default settings
// but soakFlags, one PostgreSQL database) and 3 sim agents, while a chaos loop restarts
// agents and kills -9 and restarts replicas. Throughout it samples every
// host's allocation against its capacity (as the control plane and as the
// agents see it); at the end, with the chaos stopped, it waits until
// control plane and agents agree and checks: zero oversubscription, zero
// leaked capacity (each host's allocation equals the sum of its rows that
// hold capacity, read in the database), zero orphan VMs (every agent runs
// exactly the VMs whose rows hold capacity on its host), no row creating.
// It logs its figures. Off unless KVM_SOAK_DURATION is set (make soak).
func TestSoak(t *testing.T) {
	d, err := time.ParseDuration(os.Getenv(SoakDurationEnv))
	if err != nil || d <= 0 {
		t.Skipf("set %s (e.g. 30m, or 2m to try it; make soak) to run the soak", SoakDurationEnv)
	}
	bin := buildKVMD(t)
	dbURL := testenv.PostgresURL(t)
	ctx := ctxT(t, d+15*time.Minute)
	logDir := os.Getenv(LogDirEnv)
	if logDir == "" {
		if logDir, err = os.MkdirTemp("", "kvmd-soak-logs-"); err != nil {
			t.Fatal(err)
		}
		t.Setenv(LogDirEnv, logDir)
	}
	t.Logf("kvmd control logs (warnings and errors) are kept in %s", logDir)
	s := &soak{t: t, bin: bin, dbURL: dbURL, rng: rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 14))}
	for range soakReplicas {
		s.replicas = append(s.replicas, startKVMDFlags(t, bin, dbURL, "", soakFlags))
	}
	agents := map[string]agentLister{}
	for i := range soakHosts {
		a := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: soakHostVCPUs, MemoryMiB: soakHostMemory, DiskMiB: 200000})
		name := fmt.Sprintf("soak-%d", i)
		if _, err := s.client().PutHost(ctx, name, api.HostPut{Address: a.Address}); err != nil {
			t.Fatal(err)
		}
		s.agents = append(s.agents, a)
		agents[name] = realAgent(a)
	}
	eventually(t, "the hosts are synced", func() error {
		hs, err := s.client().AllHosts(ctx)
		if err != nil {
			return err
		}
		for _, h := range hs {
			if !h.Alive || h.Capacity.VCPUs == 0 {
				return fmt.Errorf("host %s not synced yet", h.Name)
			}
		}
		return nil
	})

	start := time.Now()
	runCtx, stop := context.WithTimeout(ctx, d)
	var wg sync.WaitGroup
	for w := range soakWorkers {
		wg.Go(func() { s.work(runCtx, w) })
	}
	wg.Go(func() { s.chaos(runCtx) })
	wg.Go(func() { s.watch(runCtx) })
	wg.Wait()
	stop()
	ran := time.Since(start)

	// Every agent and replica up, then agreement.
	s.mu.Lock()
	for i, a := range s.agents {
		if s.agentDown[i] {
			a.Restart(t)
			s.agentDown[i] = false
		}
	}
	s.mu.Unlock()
	settleStart := time.Now()
	var lastErr error
	for deadline := time.Now().Add(5 * time.Minute); ; {
		if lastErr = ledger(ctx, s.client(), agents); lastErr == nil {
			break
		}
		if time.Now().After(deadline) {
			s.explain(ctx, agents)
			t.Fatalf("control plane and agents never agreed after the soak: %v (kvmd logs in %s)", lastErr, logDir)
		}
		time.Sleep(200 * time.Millisecond)
	}
	settled := time.Since(settleStart)
	leaks := s.leakedCapacity(ctx)
	s.watchOnce(ctx) // one last sample, settled

	vms, err := s.client().AllVMs(ctx, client.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	states := map[string]int{}
	for _, vm := range vms {
		states[vm.ObservedState]++
	}
	var b strings.Builder
	fmt.Fprintf(&b, "soak: %v of chaos on %d sim agents and %d replicas (PostgreSQL, default settings but --orphan-grace 1m), %d workers\n", ran.Round(time.Second), soakHosts, soakReplicas, soakWorkers)
	for _, op := range slices.Sorted(maps.Keys(s.ops)) {
		fmt.Fprintf(&b, "  %-12s %s\n", op, s.ops[op].String())
	}
	fmt.Fprintf(&b, "  chaos: %d agent restarts, %d replica kill -9 + restarts\n", s.agentRestarts.Load(), s.replicaKills.Load())
	fmt.Fprintf(&b, "  samples: %d of every host's allocation (control plane and agents); oversubscribed: %d; peak use of a host (vCPUs or memory) %.0f%%\n",
		s.samples.Load(), len(s.oversub), 100*s.peak())
	fmt.Fprintf(&b, "  end: agreement %v after the chaos stopped; %d rows by state %v; leaked capacity on %d hosts; orphan VMs 0 (ledger)\n",
		settled.Round(time.Millisecond), len(vms), states, len(leaks))
	fmt.Fprintf(&b, "  settled by the replicas (their logs): %s\n", logCounts(t, logDir))
	t.Log(b.String())
	fmt.Print(b.String())
	for _, o := range s.oversub {
		t.Error("oversubscribed: " + o)
	}
	for _, l := range leaks {
		t.Error("leaked capacity: " + l)
	}
}

// soakFlags are kvmd control's defaults but for the orphan sweep's grace:
// a VM that an agent makes after its create was given up (the PUT of a
// killed replica that the agent serves after the create's row was
// dropped) is deleted once it is this old; the default 15 minutes would
// outlast the soak's end.
var soakFlags = []string{"--orphan-grace", "1m"}

// soakLogMessages are the kvmd log messages the soak counts: what the host
// monitors settled.
var soakLogMessages = map[string]string{
	"orphans deleted":            "deleted a VM that its agent ran without a row in the database",
	"orphans kept":               "runs on its host without a database row and the database never deleted it",
	"unfinished creates dropped": "vm create never reached its agent",
	"marked missing":             "vm missing on its host; capacity released",
	"reclaimed":                  "vm marked missing runs on its host again",
	"failed-create cleanups":     "finished the cleanup of a failed create",
}

// logCounts counts soakLogMessages in the kvmd logs of dir.
func logCounts(t *testing.T, dir string) string {
	files, _ := filepath.Glob(filepath.Join(dir, "kvmd-control-*.log"))
	counts := map[string]int{}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Errorf("read kvmd log: %v", err)
			continue
		}
		for what, msg := range soakLogMessages {
			counts[what] += strings.Count(string(b), msg)
		}
	}
	var out []string
	for _, what := range slices.Sorted(maps.Keys(soakLogMessages)) {
		out = append(out, fmt.Sprintf("%s %d", what, counts[what]))
	}
	return strings.Join(out, ", ")
}

// explain logs, for every VM an agent runs without a row that holds
// capacity, what the database has of it.
func (s *soak) explain(ctx context.Context, agents map[string]agentLister) {
	conn, err := pgx.Connect(ctx, s.dbURL)
	if err != nil {
		s.t.Log(err)
		return
	}
	defer func() { _ = conn.Close(context.Background()) }()
	for host, list := range agents {
		ids, err := list(ctx)
		if err != nil {
			continue
		}
		for _, id := range ids {
			var state, reason string
			var holds bool
			var owner *string
			err := conn.QueryRow(ctx, "SELECT observed_state, reason, holds_capacity, owner_replica FROM vms WHERE id = $1", id).
				Scan(&state, &reason, &holds, &owner)
			var tomb *time.Time
			_ = conn.QueryRow(ctx, "SELECT deleted_at FROM deleted_vms WHERE vm_id = $1", id).Scan(&tomb)
			switch {
			case errors.Is(err, pgx.ErrNoRows):
				s.t.Logf("host %s runs vm %s: no row; tombstone %v", host, id, tomb)
			case err != nil:
				s.t.Logf("host %s runs vm %s: read row: %v", host, id, err)
			case !holds:
				s.t.Logf("host %s runs vm %s: row %s holding nothing (%s), owner %v", host, id, state, reason, owner)
			}
		}
	}
}

type soak struct {
	t     *testing.T
	bin   string
	dbURL string

	mu        sync.Mutex
	rng       *rand.Rand
	replicas  []*kvmdControl
	agents    []*testenv.Agent
	agentDown map[int]bool
	oversub   []string
	peakUse   float64
	ops       map[string]*opCount
	seq       int

	agentRestarts, replicaKills, samples atomic.Int64
}

// opCount counts one kind of operation by outcome: ok, refused (an answer
// the operation may get in a full or changing fleet: no_capacity, conflict,
// not_found), cut (no answer: a killed replica, a restarting agent).
type opCount struct {
	ok, refused, cut int
	codes            map[string]int // refusals by error code
}

func (c *opCount) String() string {
	var codes []string
	for _, k := range slices.Sorted(maps.Keys(c.codes)) {
		codes = append(codes, fmt.Sprintf("%s %d", k, c.codes[k]))
	}
	return fmt.Sprintf("%6d ok %6d refused %6d cut off  (refused: %s)", c.ok, c.refused, c.cut, strings.Join(codes, ", "))
}

func (s *soak) intn(n int) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.rng.IntN(n)
}

// client talks to one live replica, picked at random.
func (s *soak) client() *client.Client {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.replicas[s.rng.IntN(len(s.replicas))].client(true)
}

func (s *soak) count(op string, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ops == nil {
		s.ops = map[string]*opCount{}
	}
	c := s.ops[op]
	if c == nil {
		c = &opCount{}
		s.ops[op] = c
	}
	var ce *client.Error
	switch {
	case err == nil:
		c.ok++
	case errors.As(err, &ce) && ce.Status < 500:
		c.refused++
		if c.codes == nil {
			c.codes = map[string]int{}
		}
		c.codes[ce.Code]++
	default:
		c.cut++
	}
}

func (s *soak) name(prefix string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.seq++
	return fmt.Sprintf("%s-%06d", prefix, s.seq)
}

// work runs random operations until ctx ends.
func (s *soak) work(ctx context.Context, w int) {
	for ctx.Err() == nil {
		c := s.client()
		octx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		switch r := s.intn(100); {
		case r < 40:
			_, err := c.CreateVM(octx, smallVM(s.name(fmt.Sprintf("w%d", w))), "")
			s.count("create", err)
		case r < 70:
			if vm, ok := s.pick(octx, c, func(vm api.VM) bool { return vm.ForkID == "" }); ok {
				s.count("delete", c.DeleteVM(octx, vm.ID))
			}
		case r < 85:
			if vm, ok := s.pick(octx, c, func(vm api.VM) bool { return vm.ObservedState == api.StateRunning }); ok {
				placement := api.PlacementColocate
				if s.intn(2) == 1 {
					placement = api.PlacementSpread
				}
				_, err := c.CreateFork(octx, api.ForkCreate{SourceVMID: vm.ID, Count: 1 + s.intn(3), Placement: placement}, "")
				s.count("fork", err)
			}
		default:
			if vm, ok := s.pick(octx, c, func(vm api.VM) bool { return vm.ForkID != "" }); ok {
				s.count("fork-delete", c.DeleteFork(octx, vm.ForkID))
			}
		}
		cancel()
		time.Sleep(time.Duration(20+s.intn(80)) * time.Millisecond)
	}
}

// pick returns a random VM that keep accepts.
func (s *soak) pick(ctx context.Context, c *client.Client, keep func(api.VM) bool) (api.VM, bool) {
	vms, err := c.AllVMs(ctx, client.ListOptions{})
	if err != nil {
		s.count("list", err)
		return api.VM{}, false
	}
	vms = slices.DeleteFunc(vms, func(vm api.VM) bool { return !keep(vm) })
	if len(vms) == 0 {
		return api.VM{}, false
	}
	return vms[s.intn(len(vms))], true
}

// chaos restarts an agent or kills -9 and restarts a replica every 10 to
// 30 seconds until ctx ends.
func (s *soak) chaos(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Duration(10+s.intn(20)) * time.Second):
		}
		if s.intn(2) == 0 {
			i := s.intn(len(s.agents))
			s.mu.Lock()
			if s.agentDown == nil {
				s.agentDown = map[int]bool{}
			}
			s.agentDown[i] = true
			s.mu.Unlock()
			s.agents[i].Stop()
			time.Sleep(time.Duration(500+s.intn(3000)) * time.Millisecond)
			s.agents[i].Restart(s.t)
			s.mu.Lock()
			s.agentDown[i] = false
			s.mu.Unlock()
			s.agentRestarts.Add(1)
			continue
		}
		s.mu.Lock()
		i := s.rng.IntN(len(s.replicas))
		victim := s.replicas[i]
		// The other replica serves meanwhile.
		s.replicas = slices.Delete(s.replicas, i, i+1)
		s.mu.Unlock()
		victim.kill()
		time.Sleep(time.Duration(s.intn(3000)) * time.Millisecond)
		next := startKVMDFlags(s.t, s.bin, s.dbURL, "", soakFlags)
		s.mu.Lock()
		s.replicas = append(s.replicas, next)
		s.mu.Unlock()
		s.replicaKills.Add(1)
	}
}

// watch samples allocations every 2 seconds until ctx ends.
func (s *soak) watch(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(2 * time.Second):
		}
		s.watchOnce(ctx)
	}
}

// watchOnce records any host whose allocation exceeds its capacity, as
// the control plane sees it and as each agent sees its own VMs.
func (s *soak) watchOnce(ctx context.Context) {
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	hosts, err := s.client().AllHosts(sctx)
	if err != nil {
		return // a replica being killed; the next sample reads another
	}
	s.samples.Add(1)
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, h := range hosts {
		a, c := h.Allocated, h.Capacity
		if a.VCPUs > c.VCPUs || a.MemoryMiB > c.MemoryMiB || a.DiskMiB > c.DiskMiB {
			s.oversub = append(s.oversub, fmt.Sprintf("control plane: host %s allocated %+v over capacity %+v", h.Name, a, c))
		}
		if c.MemoryMiB > 0 && c.VCPUs > 0 {
			s.peakUse = max(s.peakUse, float64(a.MemoryMiB)/float64(c.MemoryMiB), float64(a.VCPUs)/float64(c.VCPUs))
		}
	}
	for i, ag := range s.agents {
		if s.agentDown[i] {
			continue
		}
		info, err := ag.Client.Info(sctx)
		if err != nil {
			continue
		}
		if info.Allocated.MemoryMiB+info.Warm.MemoryMiB > info.Capacity.MemoryMiB || info.Allocated.VCPUs > info.Capacity.VCPUs {
			s.oversub = append(s.oversub, fmt.Sprintf("agent %d runs %+v (warm %+v) over its capacity %+v", i, info.Allocated, info.Warm, info.Capacity))
		}
	}
}

func (s *soak) peak() float64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.peakUse
}

// leakedCapacity compares, in the database, each host's allocation with
// the sum of its VM rows that hold capacity.
func (s *soak) leakedCapacity(ctx context.Context) []string {
	conn, err := pgx.Connect(ctx, s.dbURL)
	if err != nil {
		s.t.Fatal(err)
	}
	defer func() { _ = conn.Close(context.Background()) }()
	rows, err := conn.Query(ctx, `SELECT h.name, h.alloc_vcpus, h.alloc_memory_mib, h.alloc_disk_mib,
		COALESCE(SUM(v.vcpus), 0), COALESCE(SUM(v.memory_mib), 0), COALESCE(SUM(v.disk_mib), 0)
		FROM hosts h LEFT JOIN vms v ON v.host_name = h.name AND v.holds_capacity
		GROUP BY h.name, h.alloc_vcpus, h.alloc_memory_mib, h.alloc_disk_mib`)
	if err != nil {
		s.t.Fatal(err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var name string
		var a, r [3]int64
		if err := rows.Scan(&name, &a[0], &a[1], &a[2], &r[0], &r[1], &r[2]); err != nil {
			s.t.Fatal(err)
		}
		if a != r {
			out = append(out, fmt.Sprintf("host %s allocated %v (vcpus, memory, disk), its rows hold %v", name, a, r))
		}
	}
	if err := rows.Err(); err != nil {
		s.t.Fatal(err)
	}
	sort.Strings(out)
	return out
}
