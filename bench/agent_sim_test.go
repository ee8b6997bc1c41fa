package bench

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// BenchmarkAgentSimCreates: concurrent PUT /v1/vms/{id} on 20 sim agents,
// 500 creates per round (the control API's scale test shape), with the
// metadata written and fsynced as for real VMs:
//
//	go test ./bench -run '^$' -bench AgentSimCreates -benchtime 3x
func BenchmarkAgentSimCreates(b *testing.B) {
	defer machineState(b)()
	const agents, creates = 20, 500
	as := make([]*testenv.Agent, agents)
	for i := range as {
		as[i] = testenv.StartAgent(b, testenv.AgentOptions{})
	}
	spec := agentapi.VMSpec{Image: "sim", VCPUs: 1, MemoryMiB: 256, DiskMiB: 1024}
	var lat []time.Duration
	var mu sync.Mutex
	var failed atomic.Int64
	round := 0
	for b.Loop() {
		round++
		var wg sync.WaitGroup
		for i := 0; i < creates; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				t0 := time.Now()
				_, err := as[i%agents].Client.CreateVM(context.Background(), fmt.Sprintf("r%d-vm%d", round, i), spec)
				d := time.Since(t0)
				if err != nil {
					failed.Add(1)
					return
				}
				mu.Lock()
				lat = append(lat, d)
				mu.Unlock()
			}()
		}
		wg.Wait()
	}
	if n := failed.Load(); n > 0 {
		b.Fatalf("%d creates failed", n)
	}
	b.ReportMetric(p50(lat), "create-p50-ms")
	b.ReportMetric(pct(lat, 99), "create-p99-ms")
}

func pct(ds []time.Duration, p int) float64 {
	s := append([]time.Duration(nil), ds...)
	for i := 1; i < len(s); i++ {
		for j := i; j > 0 && s[j] < s[j-1]; j-- {
			s[j], s[j-1] = s[j-1], s[j]
		}
	}
	return float64(s[(len(s)-1)*p/100].Microseconds()) / 1000
}
