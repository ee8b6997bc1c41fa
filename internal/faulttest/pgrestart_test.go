package faulttest

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

// PostgreSQL is stopped (fast mode) and started again while creates run:
// /readyz reports not ready while it is down and ready again after, the
// same control API process serves creates again, and nothing is
// oversubscribed or leaked.
func TestPostgresRestartUnderLoad(t *testing.T) {
	ctx := ctxT(t, 3*time.Minute)
	pg := testenv.StartPostgresServer(t)
	// A create cut by the outage can leave its row in creating (its cleanup
	// could not reach the database); the host monitor settles it after the
	// grace period, short here.
	c := testenv.StartControl(t, testenv.ControlOptions{DatabaseURL: pg.URL, SyncInterval: 200 * time.Millisecond,
		CreateGrace: 2 * time.Second})
	agents := map[string]agentLister{}
	for i := range 4 {
		// 4 hosts x 40 VMs: the load fills them, so a wrong reservation
		// would show as oversubscription.
		a := testenv.StartAgent(t, testenv.AgentOptions{VCPUs: 40, MemoryMiB: 40 * 1024, DiskMiB: 40 * 1024})
		name := fmt.Sprintf("host-%d", i)
		c.RegisterHost(t, name, a.Address)
		agents[name] = realAgent(a)
	}
	cl := client.New(c.URL, c.Token, client.WithRetries(0, 0))

	var ok, failed atomic.Int64
	var seq atomic.Int64
	loadCtx, stopLoad := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for loadCtx.Err() == nil {
				_, err := cl.CreateVM(ctx, smallVM(fmt.Sprintf("vm-%04d", seq.Add(1))), "")
				if err != nil {
					failed.Add(1)
					if code := apiCode(err); code != api.CodeUnavailable && code != api.CodeNoCapacity {
						t.Errorf("create during the outage: %v; want unavailable (retry) or no_capacity", err)
					}
					time.Sleep(20 * time.Millisecond)
					continue
				}
				ok.Add(1)
			}
		})
	}
	eventually(t, "creates under way", func() error {
		if ok.Load() < 20 {
			return fmt.Errorf("%d created", ok.Load())
		}
		return nil
	})

	pg.Stop(t)
	eventually(t, "/readyz reports not ready while PostgreSQL is down", func() error {
		if err := ready(ctx, c.URL); err == nil {
			return fmt.Errorf("/readyz still 200")
		}
		return nil
	})
	failedBefore := failed.Load()
	eventually(t, "creates fail while PostgreSQL is down", func() error {
		if failed.Load() == failedBefore {
			return fmt.Errorf("no create failed yet")
		}
		return nil
	})
	pg.Start(t)
	eventually(t, "/readyz ready again without a restart of the control API", func() error { return ready(ctx, c.URL) })
	okUp := ok.Load()
	eventually(t, "creates succeed again", func() error {
		if ok.Load() < okUp+20 {
			return fmt.Errorf("%d created since PostgreSQL is back", ok.Load()-okUp)
		}
		return nil
	})
	stopLoad()
	wg.Wait()
	t.Logf("%d creates succeeded (%d after PostgreSQL came back), %d failed", ok.Load(), ok.Load()-okUp, failed.Load())
	eventually(t, "ledger consistent after the restart", func() error { return ledger(ctx, cl, agents) })
}
