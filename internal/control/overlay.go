package control

// Overlay networks: the agents program static VXLAN forwarding and
// neighbour entries (no learning, no flooding), so the control plane tells
// each host, for each overlay network it has a VM NIC of, where every NIC
// of that network on the other hosts is (agentapi.Overlay).
//
// Two paths push that desired state: the host monitor's round (GET
// /v1/overlays, DELETE what the host no longer has, PUT every network it
// has: idempotent, so it also repairs an agent that restarted or lost
// entries), and a kick after each create, delete, fork child and migration
// switch, served by one goroutine per replica, which pushes only what
// changed since this replica's last push. Pushes to one host are
// serialised, and a push from an older reading of the database never
// follows one from a newer reading.

import (
	"cmp"
	"context"
	"errors"
	"maps"
	"reflect"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// overlayPushes is a replica's state of the pushes: the kick and, per
// host, the lock that serialises its pushes and what it last accepted.
type overlayPushes struct {
	kick chan struct{}
	// reading numbers the database readings of the desired state, so that
	// a host never gets an older reading after a newer one.
	reading atomic.Uint64
	mu      sync.Mutex
	hosts   map[string]*overlayHost
}

type overlayHost struct {
	mu sync.Mutex
	// reading is the reading last pushed to the host; pushed is what its
	// agent accepted then, by network.
	reading uint64
	pushed  map[string]agentapi.Overlay
}

func newOverlayPushes() *overlayPushes {
	return &overlayPushes{kick: make(chan struct{}, 1), hosts: map[string]*overlayHost{}}
}

func (o *overlayPushes) host(name string) *overlayHost {
	o.mu.Lock()
	defer o.mu.Unlock()
	h, ok := o.hosts[name]
	if !ok {
		h = &overlayHost{pushed: map[string]agentapi.Overlay{}}
		o.hosts[name] = h
	}
	return h
}

// kickOverlays asks for a push of what changed now, without waiting for
// the round; it never blocks (a pending kick covers this one: its push
// reads the database after this call).
func (s *Service) kickOverlays() {
	select {
	case s.overlays.kick <- struct{}{}:
	default:
	}
}

// onOverlay says whether any of the NICs is on an overlay network (a
// change of such a VM is worth a kick); a network it cannot read counts,
// so that no change is missed.
func (s *Service) onOverlay(ctx context.Context, nics []store.NIC) bool {
	for _, nic := range nics {
		n, err := s.networks.get(ctx, s.store, nic.Network)
		if err != nil || n.Mode == api.NetworkOverlay {
			return true
		}
	}
	return false
}

// serveOverlayKicks pushes after each kick until ctx ends (Run owns it).
func (s *Service) serveOverlayKicks(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.overlays.kick:
			s.pushOverlays(ctx, false)
		}
	}
}

// desiredOverlays is, per host and overlay network, the state the host's
// agent must have: the network's NICs on the other hosts (with their
// host's underlay address) and the other hosts that have the network. A
// host has a network when a NIC of it is placed there (a VM that holds
// capacity or is being created; a migrating VM on its row's host). Hosts
// without an underlay address, and retired ones, have none: no overlay NIC
// is placed there, and no tunnel can reach them.
func desiredOverlays(nets []store.Network, nics []store.OverlayNIC, hosts []store.Host) map[string]map[string]agentapi.Overlay {
	underlay := map[string]string{}
	for _, h := range hosts {
		if h.UnderlayAddress != "" && h.RetiredAt == nil {
			underlay[h.Name] = h.UnderlayAddress
		}
	}
	byNetwork := map[string]map[string][]store.OverlayNIC{}
	for _, n := range nics {
		if underlay[n.Host] == "" || n.Address == 0 {
			continue
		}
		if byNetwork[n.Network] == nil {
			byNetwork[n.Network] = map[string][]store.OverlayNIC{}
		}
		byNetwork[n.Network][n.Host] = append(byNetwork[n.Network][n.Host], n)
	}
	out := map[string]map[string]agentapi.Overlay{}
	for _, n := range nets {
		on := byNetwork[n.Name]
		if n.Mode != api.NetworkOverlay || n.VNI == nil || len(on) == 0 {
			continue
		}
		for host := range on {
			o := agentapi.Overlay{Network: n.Name, VNI: int(*n.VNI), CIDR: n.CIDR, Gateway: n.Gateway, MTU: int(n.MTU),
				Allow: n.Allow, Peers: []agentapi.OverlayPeer{}, Entries: []agentapi.OverlayEntry{}}
			for other, list := range on {
				if other == host {
					continue
				}
				o.Peers = append(o.Peers, agentapi.OverlayPeer{Host: other, Underlay: underlay[other]})
				for _, nic := range list {
					o.Entries = append(o.Entries, agentapi.OverlayEntry{MAC: nic.MACAddress, IPv4: numAddr(nic.Address).String(), Underlay: underlay[other]})
				}
			}
			slices.SortFunc(o.Peers, func(a, b agentapi.OverlayPeer) int { return cmp.Compare(a.Host, b.Host) })
			slices.SortFunc(o.Entries, func(a, b agentapi.OverlayEntry) int { return cmp.Compare(a.MAC, b.MAC) })
			if out[host] == nil {
				out[host] = map[string]agentapi.Overlay{}
			}
			out[host][n.Name] = o
		}
	}
	return out
}

// readOverlays reads the desired state of every host from the database.
func (s *Service) readOverlays(ctx context.Context) (map[string]map[string]agentapi.Overlay, []store.Host, error) {
	nets, err := s.store.ListNetworks(ctx)
	if err != nil {
		return nil, nil, err
	}
	nics, err := s.store.OverlayNICs(ctx)
	if err != nil {
		return nil, nil, err
	}
	hosts, err := s.store.AllHosts(ctx)
	if err != nil {
		return nil, nil, err
	}
	return desiredOverlays(nets, nics, hosts), hosts, nil
}

// pushOverlays pushes the desired state to every live host with an
// underlay address. full (the host monitor's round) lists each agent's
// overlays, deletes those the host no longer has and puts every one it
// has; otherwise (a kick) only what differs from this replica's last push
// goes out.
func (s *Service) pushOverlays(ctx context.Context, full bool) {
	reading := s.overlays.reading.Add(1)
	desired, hosts, err := s.readOverlays(ctx)
	if err != nil {
		if ctx.Err() == nil {
			s.log.Error("overlay networks: read the desired state", "err", err)
		}
		return
	}
	sem := make(chan struct{}, maxConcurrentSyncs)
	var wg sync.WaitGroup
	for _, h := range hosts {
		if h.RetiredAt != nil || !h.Alive || h.UnderlayAddress == "" {
			continue
		}
		want := desired[h.Name]
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			s.pushHostOverlays(ctx, h, want, reading, full)
		})
	}
	wg.Wait()
}

// pushHostOverlays brings one host's overlays to want.
func (s *Service) pushHostOverlays(ctx context.Context, h store.Host, want map[string]agentapi.Overlay, reading uint64, full bool) {
	oh := s.overlays.host(h.Name)
	oh.mu.Lock()
	defer oh.mu.Unlock()
	if reading < oh.reading {
		return // a newer reading was pushed already
	}
	oh.reading = reading
	log := s.log.With("host", h.Name, "address", h.Address)
	c := s.agents.syncClient(h.Address)
	stale := map[string]bool{}
	if full {
		var have []agentapi.OverlayState
		err := s.agents.call("list_overlays", func() (err error) { have, err = c.ListOverlays(ctx); return err })
		if err != nil {
			s.metrics.overlayFailures.WithLabelValues(overlayOpList).Inc()
			if ctx.Err() == nil {
				log.Warn("overlay networks: list the agent's overlays; the next round tries again", "err", err)
			}
			return
		}
		for _, o := range have {
			stale[o.Network] = true
		}
	}
	for name := range oh.pushed {
		stale[name] = true
	}
	for name := range want {
		delete(stale, name)
	}
	for _, name := range slices.Sorted(maps.Keys(stale)) {
		err := s.agents.call("delete_overlay", func() error { return c.DeleteOverlay(ctx, name) })
		if err != nil && !errors.Is(err, agentapi.ErrNotFound) {
			s.metrics.overlayFailures.WithLabelValues(overlayOpDelete).Inc()
			log.Warn("overlay networks: remove a network the host no longer has; the next round tries again", "network", name, "err", err)
			continue
		}
		s.metrics.overlayPushes.WithLabelValues(overlayOpDelete).Inc()
		delete(oh.pushed, name)
		log.Info("overlay network removed from host: no VM of it is left there", "network", name)
	}
	for _, name := range slices.Sorted(maps.Keys(want)) {
		o := want[name]
		if last, ok := oh.pushed[name]; ok && !full && reflect.DeepEqual(last, o) {
			continue
		}
		_, err := s.agents.putOverlay(ctx, c, o)
		if err != nil {
			s.metrics.overlayFailures.WithLabelValues(overlayOpPut).Inc()
			delete(oh.pushed, name)
			log.Warn("overlay networks: push the network's entries; the next round tries again", "network", name, "vni", o.VNI,
				"entries", len(o.Entries), "peers", len(o.Peers), "err", err)
			continue
		}
		s.metrics.overlayPushes.WithLabelValues(overlayOpPut).Inc()
		oh.pushed[name] = o
		log.Debug("overlay network pushed", "network", name, "vni", o.VNI, "entries", len(o.Entries), "peers", len(o.Peers))
	}
}

func (p *agentPool) putOverlay(ctx context.Context, c *agentapi.Client, o agentapi.Overlay) (agentapi.OverlayState, error) {
	var out agentapi.OverlayState
	err := p.call("put_overlay", func() (err error) { out, err = c.PutOverlay(ctx, o.Network, o); return err })
	return out, err
}
