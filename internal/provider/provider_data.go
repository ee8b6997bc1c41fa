package provider

import (
	"context"
	"sync"
	"time"

	"github.com/hashicorp/terraform-plugin-log/tflog"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
)

// listCacheTTL bounds how stale a cached list may be. Terraform starts new
// provider processes for every command and the provider drops the cache on
// each of its writes, so in practice one list serves one refresh walk; the
// TTL only bounds very long walks (1,000 VMs take about 10 s on a busy
// 2-core machine).
const listCacheTTL = 30 * time.Second

// providerData is what Configure hands to every resource and data source: the
// client and the short-lived caches that let a refresh of N resources cost
// one list call per page instead of N GETs.
type providerData struct {
	client *client.Client
	// project is the provider's project setting: sent with the creates of
	// VMs and networks; "" lets the control API use the token's project.
	project string
	vms     *listCache[api.VM]
	hosts   *listCache[api.Host]
}

func newProviderData(c *client.Client) *providerData {
	return &providerData{
		client: c,
		vms: newListCache(listCacheTTL,
			func(ctx context.Context) ([]api.VM, error) { return c.AllVMs(ctx, client.ListOptions{}) },
			func(vm api.VM) string { return vm.ID }),
		hosts: newListCache(listCacheTTL, c.AllHosts, func(h api.Host) string { return h.Name }),
	}
}

// getVM returns a VM from the cache, loading every VM on the first call; a
// VM the cache does not hold is asked for directly, so a miss never reads as
// "gone".
func (d *providerData) getVM(ctx context.Context, id string) (api.VM, error) {
	if vm, ok := d.vms.get(ctx, id); ok {
		return vm, nil
	}
	return d.client.GetVM(ctx, id)
}

// getHost is getVM for hosts.
func (d *providerData) getHost(ctx context.Context, name string) (api.Host, error) {
	if h, ok := d.hosts.get(ctx, name); ok {
		return h, nil
	}
	return d.client.GetHost(ctx, name)
}

// wrote drops both caches: any write of this provider may change VMs and
// the allocation of hosts.
func (d *providerData) wrote() {
	d.vms.invalidate()
	d.hosts.invalidate()
}

// listCache holds the result of one full list for a short time. Concurrent
// callers wait for a single load rather than each listing.
type listCache[T any] struct {
	ttl  time.Duration
	load func(context.Context) ([]T, error)
	key  func(T) string

	mu       sync.Mutex
	loadedAt time.Time // of items, or of the last failed load
	items    map[string]T
	failed   bool
}

func newListCache[T any](ttl time.Duration, load func(context.Context) ([]T, error), key func(T) string) *listCache[T] {
	return &listCache[T]{ttl: ttl, load: load, key: key}
}

// get returns the cached item, loading the list when the cache is empty or
// expired. After a failed load the callers fall back to GETs (which report
// their own errors) until the TTL passes, rather than each retrying the list.
func (c *listCache[T]) get(ctx context.Context, key string) (T, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	var zero T
	fresh := !c.loadedAt.IsZero() && time.Since(c.loadedAt) <= c.ttl
	if !fresh {
		items, err := c.load(ctx)
		c.loadedAt = time.Now()
		if err != nil {
			tflog.Debug(ctx, "listing for the refresh cache failed; reading one by one", map[string]any{"error": err.Error()})
			c.items, c.failed = nil, true
			return zero, false
		}
		c.items, c.failed = make(map[string]T, len(items)), false
		for _, it := range items {
			c.items[c.key(it)] = it
		}
	}
	if c.failed {
		return zero, false
	}
	it, ok := c.items[key]
	return it, ok
}

func (c *listCache[T]) invalidate() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.items, c.failed, c.loadedAt = nil, false, time.Time{}
}
