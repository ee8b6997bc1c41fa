package control

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/scheduler"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

type metrics struct {
	placements       *prometheus.CounterVec
	placementSeconds prometheus.Histogram
	conflicts        prometheus.Counter
	agentSeconds     *prometheus.HistogramVec
	agentErrors      *prometheus.CounterVec
	rejections       *prometheus.CounterVec
	vmStates         *vmStateCounts
	projects         *projectCounts
	// unaccounted counts, per host, the VMs an agent runs that have no
	// row and that the database never deleted (orphans.go).
	unaccounted *prometheus.GaugeVec
	// Volumes an agent has without a row (volume_reconcile.go): kept
	// for an operator (a gauge per host), deleted (a counter per host).
	volumesWithoutRow    *prometheus.GaugeVec
	orphanVolumesDeleted *prometheus.CounterVec
	volumesLost          *prometheus.CounterVec
	// overlayPushes and overlayFailures count the overlay networks' pushes
	// to agents (overlay.go), by operation (put, delete, list).
	overlayPushes   *prometheus.CounterVec
	overlayFailures *prometheus.CounterVec
}

// Operations of overlay pushes (the label of kvmd_overlay_pushes_total).
const (
	overlayOpPut    = "put"
	overlayOpDelete = "delete"
	overlayOpList   = "list"
)

// Placement results (the label of kvmd_placements_total).
const (
	resultPlaced     = "placed"
	resultNoCapacity = "no_capacity"
	resultError      = "error"
)

func newMetrics(reg *prometheus.Registry) *metrics {
	m := &metrics{
		placements: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmd_placements_total", Help: "Placements with reservation, by result (placed, no_capacity, error).",
		}, []string{"result"}),
		placementSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "kvmd_placement_duration_seconds", Help: "Time to choose a host and reserve capacity in the database.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 16),
		}),
		conflicts: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvmd_reservation_conflicts_total", Help: "Reservations the database refused because the host had filled up meanwhile (lost races).",
		}),
		agentSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvmd_agent_call_duration_seconds", Help: "Duration of calls to host agents, by operation.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 16),
		}, []string{"op"}),
		agentErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmd_agent_call_errors_total", Help: "Failed calls to host agents, by operation.",
		}, []string{"op"}),
		rejections: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvm_placement_rejections_total",
			Help: "Hosts rejected by placements with reservation, by reason (the first filter the host failed), as listed in each placement's explanation.",
		}, []string{"reason"}),
		vmStates: &vmStateCounts{},
		projects: &projectCounts{},
		unaccounted: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvmd_vms_without_row",
			Help: "VMs an agent runs without a database row that the control plane never deleted (kept for an operator), by host.",
		}, []string{"host"}),
		volumesWithoutRow: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvmd_volumes_without_row",
			Help: "Volumes an agent has without a database row that the control plane never deleted (kept for an operator), by host.",
		}, []string{"host"}),
		orphanVolumesDeleted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmd_orphan_volumes_deleted_total",
			Help: "Volumes the host monitor deleted on an agent because their row had been deleted on purpose (a delete or an undone create), by host.",
		}, []string{"host"}),
		volumesLost: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmd_volumes_lost_total",
			Help: "Ready volumes whose agent no longer had them (marked state error), by host.",
		}, []string{"host"}),
		overlayPushes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmd_overlay_pushes_total",
			Help: "Overlay network states the agents accepted (put: a network's entries and peers on a host; delete: a network removed from a host).",
		}, []string{"op"}),
		overlayFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmd_overlay_push_failures_total",
			Help: "Overlay network pushes to agents that failed (put, delete, list), retried by the next host monitor round.",
		}, []string{"op"}),
	}
	for _, r := range scheduler.Reasons() {
		m.rejections.WithLabelValues(r)
	}
	// Zero series up front, so that dashboards and alerts see them before
	// the first event.
	for _, r := range []string{resultPlaced, resultNoCapacity, resultError} {
		m.placements.WithLabelValues(r)
	}
	for _, op := range []string{"info", "list_vms", "create_vm", "delete_vm", "start", "stop"} {
		m.agentErrors.WithLabelValues(op)
	}
	for _, op := range []string{overlayOpPut, overlayOpDelete, overlayOpList} {
		m.overlayPushes.WithLabelValues(op)
		m.overlayFailures.WithLabelValues(op)
	}
	reg.MustRegister(m.placements, m.placementSeconds, m.conflicts, m.agentSeconds, m.agentErrors, m.rejections, m.vmStates, m.projects, m.unaccounted,
		m.volumesWithoutRow, m.orphanVolumesDeleted, m.volumesLost, m.overlayPushes, m.overlayFailures)
	return m
}

// countRejections counts the hosts a placement's explanation rejected.
func (m *metrics) countRejections(rs []api.Rejection) {
	for _, r := range rs {
		m.rejections.WithLabelValues(r.Reason).Inc()
	}
}

func (m *metrics) observeAgent(op string, start time.Time, err error) {
	m.agentSeconds.WithLabelValues(op).Observe(time.Since(start).Seconds())
	if err != nil {
		m.agentErrors.WithLabelValues(op).Inc()
	}
}

// vmStateCounts holds the number of VMs per observed state on each host,
// as the host monitor last read them: every round reads each host's rows
// anyway (to reconcile them with its agent), so it counts them on the way
// at no extra query. A scrape sums these in memory, so it costs O(hosts x
// states) and issues no SQL whatever the number of VMs or scrapers. Every
// replica runs the monitor, so every replica reports the same numbers
// within one sync interval.
type vmStateCounts struct {
	mu     sync.Mutex
	byHost map[string]hostStateCounts
}

type hostStateCounts struct {
	readAt time.Time // when the rows were read; an older read never overwrites a newer one
	counts map[string]int64
}

// vmStates are the series of kvmd_vms, zero when no VM is in them.
var vmStates = []string{api.StateCreating, api.StateRunning, api.StatePaused, api.StateStopped, api.StateError, api.StateMissing, api.StateLost}

// setHost records the states of one host's VM rows, read at readAt.
func (c *vmStateCounts) setHost(host string, readAt time.Time, rows []store.VM) {
	counts := make(map[string]int64, len(vmStates))
	for _, r := range rows {
		counts[r.ObservedState]++
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.byHost == nil {
		c.byHost = map[string]hostStateCounts{}
	}
	if readAt.Before(c.byHost[host].readAt) {
		return // a concurrent round (SyncNow) read this host later
	}
	c.byHost[host] = hostStateCounts{readAt: readAt, counts: counts}
}

// keepHosts forgets the hosts that are no longer registered.
func (c *vmStateCounts) keepHosts(hosts []store.Host) {
	keep := make(map[string]bool, len(hosts))
	for _, h := range hosts {
		keep[h.Name] = true
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for name := range c.byHost {
		if !keep[name] {
			delete(c.byHost, name)
		}
	}
}

func (c *vmStateCounts) totals() map[string]int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[string]int64, len(vmStates))
	for _, h := range c.byHost {
		for state, n := range h.counts {
			out[state] += n
		}
	}
	return out
}

var vmStatesDesc = prometheus.NewDesc("kvmd_vms",
	"VMs by observed state, as stored when the host monitor last read each host (every sync interval; VMs on dead hosts keep their last state here).",
	[]string{"state"}, nil)

func (c *vmStateCounts) Describe(ch chan<- *prometheus.Desc) { ch <- vmStatesDesc }

func (c *vmStateCounts) Collect(ch chan<- prometheus.Metric) {
	counts := c.totals()
	for _, state := range vmStates {
		ch <- prometheus.MustNewConstMetric(vmStatesDesc, prometheus.GaugeValue, float64(counts[state]), state)
	}
}

// projectCounts holds every project's usage and quotas as the host
// monitor last read them: one read of the projects table per round (and
// after each project write on this replica), never at scrape time, so a
// scrape stays SQL-free like kvmd_vms. A project's usage is a row that
// the reservation statement keeps (store/projects.go), so the read is one
// small row per project. The numbers lag the database by at most one sync
// interval; every replica reads the same rows.
type projectCounts struct {
	mu       sync.Mutex
	readAt   time.Time
	projects []api.Project
}

// set records the projects read at readAt; an older read never
// overwrites a newer one.
func (c *projectCounts) set(readAt time.Time, projects []api.Project) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if readAt.Before(c.readAt) {
		return
	}
	c.readAt, c.projects = readAt, projects
}

var (
	projectUsageDesc = prometheus.NewDesc("kvm_project_usage",
		"What a project's VMs hold, by resource (vcpus, memory_mib, disk_mib, vms), as the host monitor last read it (every sync interval).",
		[]string{"project", "resource"}, nil)
	projectQuotaDesc = prometheus.NewDesc("kvm_project_quota",
		"A project's quota, by resource; a resource without a quota (unlimited) has no series.",
		[]string{"project", "resource"}, nil)
)

func (c *projectCounts) Describe(ch chan<- *prometheus.Desc) {
	ch <- projectUsageDesc
	ch <- projectQuotaDesc
}

func (c *projectCounts) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	projects := c.projects
	c.mu.Unlock()
	for _, p := range projects {
		for _, r := range []struct {
			name  string
			used  int64
			quota *int64
		}{
			{api.ResourceVCPUs, p.Usage.VCPUs, p.Quotas.VCPUs},
			{api.ResourceMemoryMiB, p.Usage.MemoryMiB, p.Quotas.MemoryMiB},
			{api.ResourceDiskMiB, p.Usage.DiskMiB, p.Quotas.DiskMiB},
			{api.ResourceVMs, p.Usage.VMs, p.Quotas.VMs},
		} {
			ch <- prometheus.MustNewConstMetric(projectUsageDesc, prometheus.GaugeValue, float64(r.used), p.Name, r.name)
			if r.quota != nil {
				ch <- prometheus.MustNewConstMetric(projectQuotaDesc, prometheus.GaugeValue, float64(*r.quota), p.Name, r.name)
			}
		}
	}
}
