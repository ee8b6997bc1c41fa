package control

import (
	"context"
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
}

// Placement results (the label of kvmd_placements_total).
const (
	resultPlaced     = "placed"
	resultNoCapacity = "no_capacity"
	resultError      = "error"
)

func newMetrics(reg *prometheus.Registry, st *store.Store) *metrics {
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
	reg.MustRegister(m.placements, m.placementSeconds, m.conflicts, m.agentSeconds, m.agentErrors, m.rejections, &vmStateCollector{st: st})
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

// vmStateCollector counts VMs by observed state from the database at
// scrape time, so every replica reports the same numbers.
type vmStateCollector struct{ st *store.Store }

var vmStatesDesc = prometheus.NewDesc("kvmd_vms", "VMs by observed state (as stored; VMs on dead hosts keep their last state here).", []string{"state"}, nil)

func (c *vmStateCollector) Describe(ch chan<- *prometheus.Desc) { ch <- vmStatesDesc }

func (c *vmStateCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	counts, err := c.st.CountVMsByState(ctx)
	if err != nil {
		ch <- prometheus.NewInvalidMetric(vmStatesDesc, err)
		return
	}
	for _, state := range []string{api.StateCreating, api.StateRunning, api.StatePaused, api.StateStopped, api.StateError, api.StateMissing} {
		ch <- prometheus.MustNewConstMetric(vmStatesDesc, prometheus.GaugeValue, float64(counts[state]), state)
	}
}
