package control

// The control side of the warm pool (docs/guides/architecture.md): a host's
// warm_pool targets are stored with the host and pushed to its agent with
// PUT /v1/pool/{image}; the host monitor reads the agent's ready counts
// every sync and pushes the targets again when the agent's differ (an agent
// that was replaced or lost its state). The counts live in this replica's
// host view: the scheduler prefers, among hosts whose scores are close, one
// with a matching warm VM ready (scheduler.PreferWarm).

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/scheduler"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// warmKey is one image and shape of a warm pool.
type warmKey struct {
	Image     string
	VCPUs     int64
	MemoryMiB int64
	DiskMiB   int64
}

func (k warmKey) String() string {
	return fmt.Sprintf("%s %d vcpus %d MiB memory %d MiB disk", k.Image, k.VCPUs, k.MemoryMiB, k.DiskMiB)
}

func requestWarmKey(req scheduler.Request) warmKey {
	return warmKey{req.Image, req.Resources.VCPUs, req.Resources.MemoryMiB, req.Resources.DiskMiB}
}

// validateWarmPool refuses a shape given twice: the agent keeps one target
// per image and shape.
func validateWarmPool(pool []api.WarmPoolTarget) error {
	seen := map[warmKey]int{}
	for i, p := range pool {
		k := warmKey{p.Image, p.VCPUs, p.MemoryMiB, p.DiskMiB}
		if j, dup := seen[k]; dup {
			return invalidf("warm_pool[%d] repeats warm_pool[%d] (%s); give each image and shape once", i, j, k)
		}
		seen[k] = i
	}
	return nil
}

// targetSizes maps each image and shape with a size above 0 to that size.
func targetSizes(targets []store.PoolTarget) map[warmKey]int {
	out := map[warmKey]int{}
	for _, t := range targets {
		if t.Size > 0 {
			out[warmKey{t.Image, t.VCPUs, t.MemoryMiB, t.DiskMiB}] = t.Size
		}
	}
	return out
}

// poolCounts maps each image and shape the agent reports to count of its
// status row (the target size, or the warm VMs ready), where that is above 0.
func poolCounts(pool []agentapi.PoolStatus, count func(agentapi.PoolStatus) int) map[warmKey]int {
	out := map[warmKey]int{}
	for _, p := range pool {
		if n := count(p); n > 0 {
			out[warmKey{p.Image, p.VCPUs, p.MemoryMiB, p.DiskMiB}] = n
		}
	}
	return out
}

func poolSize(p agentapi.PoolStatus) int  { return p.Size }
func poolReady(p agentapi.PoolStatus) int { return p.Ready }

// poolPuts returns the PUT /v1/pool/{image} bodies that make the agent's
// targets (current) equal the host's (want): one per image whose shapes
// differ; an image the host no longer lists gets an empty shape list.
func poolPuts(want []store.PoolTarget, current []agentapi.PoolStatus) map[string]agentapi.PoolPut {
	w, c := targetSizes(want), poolCounts(current, poolSize)
	byImage := func(m map[warmKey]int) map[string]map[warmKey]int {
		out := map[string]map[warmKey]int{}
		for k, v := range m {
			if out[k.Image] == nil {
				out[k.Image] = map[warmKey]int{}
			}
			out[k.Image][k] = v
		}
		return out
	}
	wi, ci := byImage(w), byImage(c)
	puts := map[string]agentapi.PoolPut{}
	for img, shapes := range wi {
		if maps.Equal(shapes, ci[img]) {
			continue
		}
		put := agentapi.PoolPut{Shapes: []agentapi.PoolShape{}}
		for _, t := range want {
			// The stored order, sizes 0 left out: the agent needs no target for them.
			if t.Image == img && t.Size > 0 {
				put.Shapes = append(put.Shapes, agentapi.PoolShape{VCPUs: t.VCPUs, MemoryMiB: t.MemoryMiB, DiskMiB: t.DiskMiB, Size: t.Size})
			}
		}
		puts[img] = put
	}
	for img := range ci {
		if _, ok := wi[img]; !ok {
			puts[img] = agentapi.PoolPut{Shapes: []agentapi.PoolShape{}}
		}
	}
	return puts
}

// pushWarmPool makes the agent's warm pool targets equal the host's, given
// the agent's current pool, and records the ready counts it answers. It
// returns the first error after trying every image.
func (s *Service) pushWarmPool(ctx context.Context, h store.Host, current []agentapi.PoolStatus) error {
	s.view.setWarm(h.Name, poolCounts(current, poolReady))
	puts := poolPuts(h.WarmPool, current)
	if len(puts) == 0 {
		return nil
	}
	c := s.agents.client(h.Address)
	var first error
	for _, img := range slices.Sorted(maps.Keys(puts)) {
		var status []agentapi.PoolStatus
		err := s.agents.call("set_pool", func() (err error) { status, err = c.SetPool(ctx, img, puts[img]); return err })
		if err != nil {
			s.log.Warn("push warm pool targets", "host", h.Name, "image", img, "err", err)
			if first == nil {
				first = fromAgent(err, h.Name, fmt.Sprintf("set the warm pool of image %s (PUT /v1/pool/%s)", img, img))
			}
			continue
		}
		s.view.setWarm(h.Name, poolCounts(status, poolReady))
		s.log.Info("warm pool targets pushed", "host", h.Name, "image", img, "shapes", len(puts[img].Shapes))
	}
	return first
}

// withWarmReady fills the ready counts of a host's warm pool targets from
// the last report of its agent.
func (s *Service) withWarmReady(h api.Host) api.Host {
	ready := s.view.warmOf(h.Name)
	for i, p := range h.WarmPool {
		h.WarmPool[i].Ready = ready[warmKey{p.Image, p.VCPUs, p.MemoryMiB, p.DiskMiB}]
	}
	return h
}

// setWarm replaces a host's ready counts.
func (v *hostView) setWarm(host string, ready map[warmKey]int) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.warm[host] = ready
}

// warmOf returns a copy of a host's ready counts.
func (v *hostView) warmOf(host string) map[warmKey]int {
	v.mu.Lock()
	defer v.mu.Unlock()
	return maps.Clone(v.warm[host])
}

// preferWarmLocked applies the warm preference to a ranking for req; v.mu
// is held.
func (v *hostView) preferWarmLocked(res scheduler.Result, req scheduler.Request) (scheduler.Result, bool) {
	if req.ColdOnly {
		return res, false
	}
	k := requestWarmKey(req)
	warm := map[string]int{}
	for _, r := range res.Ranked {
		if n := v.warm[r.Host][k]; n > 0 {
			warm[r.Host] = n
		}
	}
	return scheduler.PreferWarm(res, v.warmMargin, warm)
}

// takeWarmLocked counts a warm VM as taken by a placement on host, so that
// a burst of creates does not count the same warm VM twice before the next
// sync reports the truth; v.mu is held.
func (v *hostView) takeWarmLocked(host string, req scheduler.Request) {
	if req.ColdOnly {
		return
	}
	k := requestWarmKey(req)
	if n := v.warm[host][k]; n > 0 {
		v.warm[host][k] = n - 1
	}
}

// warmNote explains the warm part of a placement, or "" when no warm VM
// was involved.
func warmNote(best scheduler.Ranked, runnerUp *scheduler.Ranked, margin float64) string {
	switch {
	case best.WarmPreferred && runnerUp != nil:
		return fmt.Sprintf("warm preference decided: host %s has %d ready warm VMs of this image and shape and its score %.5f is within %s of the best score %.5f (host %s), which has none",
			best.Host, best.WarmReady, best.Score, percent(margin), runnerUp.Score, runnerUp.Host)
	case best.WarmReady > 0:
		return fmt.Sprintf("host %s has %d ready warm VMs of this image and shape", best.Host, best.WarmReady)
	}
	return ""
}

func percent(f float64) string {
	return strings.TrimSuffix(strings.TrimRight(fmt.Sprintf("%.2f", f*100), "0"), ".") + "%"
}

// bestScored returns the best-scored host of a ranking that the warm
// preference may have reordered (nil when the ranking is empty).
func bestScored(rs []scheduler.Ranked) *scheduler.Ranked {
	var best *scheduler.Ranked
	for i := range rs {
		if best == nil || rs[i].Score < best.Score || (rs[i].Score == best.Score && rs[i].Host < best.Host) {
			best = &rs[i]
		}
	}
	return best
}

// syncWarmPool is the host monitor's part: record the agent's ready counts
// and, when its targets differ from the host's, push them. The host row
// is read again first, so that a sync that started before a PUT changed
// the targets does not push the old ones back.
func (s *Service) syncWarmPool(ctx context.Context, h store.Host, current []agentapi.PoolStatus) {
	if len(poolPuts(h.WarmPool, current)) > 0 {
		fresh, err := s.store.GetHost(ctx, h.Name)
		if err != nil {
			s.view.setWarm(h.Name, poolCounts(current, poolReady))
			return
		}
		h = fresh
	}
	// Errors are logged inside; the next sync tries again.
	_ = s.pushWarmPool(ctx, h, current)
}

// clearWarmPool empties the warm pool of a deregistered host's agent, so
// that it does not keep paused VMs for a fleet it left. Best effort: the
// host is gone whatever the agent answers.
func (s *Service) clearWarmPool(ctx context.Context, h store.Host) {
	if h.Address == "" || len(h.WarmPool) == 0 {
		return
	}
	h.WarmPool = nil
	current := []agentapi.PoolStatus{}
	c := s.agents.client(h.Address)
	if err := s.agents.call("pool", func() (err error) { current, err = c.Pool(ctx); return err }); err != nil {
		s.log.Warn("clear the warm pool of a deregistered host", "host", h.Name, "err", err)
		return
	}
	if err := s.pushWarmPool(ctx, h, current); err == nil {
		s.log.Info("warm pool of deregistered host cleared", "host", h.Name)
	}
}
