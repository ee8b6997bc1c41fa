// Package control holds the use cases of the control plane: hosts, VMs,
// placement with atomic reservation, idempotency keys and the host monitor.
// The database is the only thing replicas share; the in-memory host view
// here is a cache that the database's conditional UPDATE arbitrates.
package control

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmfleet/terraform-provider-kvm/internal/scheduler"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// Options configure a Service. Zero values take the defaults noted.
type Options struct {
	// AgentToken authenticates the control plane to host agents.
	AgentToken string
	// AgentHTTPClient is used for agent calls (TLS settings); default plain HTTP.
	AgentHTTPClient *http.Client
	// AllowInsecureAgents accepts host addresses with http:// off loopback
	// (--allow-insecure-agents); otherwise only https:// and loopback http://.
	AllowInsecureAgents bool
	// AgentTimeout bounds one attempt of an agent call (default 10 s; creates get 6x).
	AgentTimeout time.Duration
	// SyncInterval is how often the host monitor asks every agent (default 10 s).
	SyncInterval time.Duration
	// DeadAfter is the number of missed syncs in a row that mark a host dead (default 3).
	DeadAfter int
	// Weights of the score (default scheduler.DefaultWeights).
	Weights *scheduler.Weights
	// CandidateLimit is how many feasible hosts a placement scores (default 32).
	CandidateLimit int
	// WarmMargin is how close (relative) a host's score must be to the best
	// for a matching ready warm VM to make it win (default
	// scheduler.DefaultWarmMargin, 10%; a negative value turns it off).
	WarmMargin *float64
	// IdempotencyTTL is how long Idempotency-Keys are kept (default and minimum 24 h).
	IdempotencyTTL time.Duration
	// Registry receives the metrics; default a new registry per Service, so
	// that several replicas can run in one process.
	Registry *prometheus.Registry
	Logger   *slog.Logger
	// Hooks are seams for tests that inject failures; nil in production.
	Hooks *Hooks
	// CreateGrace is how long a VM may stay "creating" before the host
	// monitor settles it from what its agent reports (default 15 min). It
	// must exceed a create's own bound, or the monitor races live creates.
	CreateGrace time.Duration
	// OrphanGrace is how old a VM on an agent that has no row must be before
	// the host monitor deletes it there (default 15 min).
	OrphanGrace time.Duration
	// LeaseInterval is how often this replica renews its lease (default
	// 2 s); LeaseLapse how old a replica's last renewal must be for the
	// others to settle its unfinished creates, resizes and forks (default
	// 10 s; at least 3 intervals). See leases.go.
	LeaseInterval time.Duration
	LeaseLapse    time.Duration
	// ForkRetryBackoff is how long after a fork's first failed pass the
	// host monitor runs it again; each later retry waits twice as long, up
	// to api.MaxForkAttempts passes (default 30 s).
	ForkRetryBackoff time.Duration
}

// Hooks let tests inject failures at points that are otherwise hard to reach.
type Hooks struct {
	// AfterAgentCreate runs after the agent created a VM and before the VM
	// is marked created in the database. An error is handled exactly like a
	// failed database write at that point.
	AfterAgentCreate func(ctx context.Context, vmID string) error
	// ForkStep runs at each step of a fork pass (the Fork* step names;
	// slot is -1 for fork-wide steps). An error fails the step like a
	// database write failing there; an error wrapping ErrSimulatedCrash
	// stops the pass on the spot with no cleanup, like a process dying.
	ForkStep func(ctx context.Context, forkID, step string, slot int) error
	// AfterResizeReserve runs after a resize reserved its growth and
	// recorded the pending shape, before the agent is asked; AfterAgentResize
	// after the agent applied it, before the row is settled. An error stops
	// the resize on the spot with no cleanup, like a process dying there.
	AfterResizeReserve func(ctx context.Context, vmID string) error
	AfterAgentResize   func(ctx context.Context, vmID string) error
	// VolumeMoveStep runs after each step of a volume move (the MoveStep*
	// names, volume_move.go). An error stops the move on the spot with no
	// cleanup, like a process dying there.
	VolumeMoveStep func(ctx context.Context, volumeID, step string) error
	// MigrationStep runs at each step of a migration (MigrationStep*
	// constants); an error stops the migration there, as a crash of the
	// process would, and the host monitor finishes or undoes it.
	MigrationStep func(ctx context.Context, vmID, step string) error
}

// Service runs the control plane's use cases.
type Service struct {
	store  *store.Store
	opts   Options
	log    *slog.Logger
	view   *hostView
	agents *agentPool
	// migrations are the agents' migration calls.
	migrations migrationCalls
	drains     drains
	metrics    *metrics
	hooks      Hooks
	// tokens caches API token digests (tokens.go).
	tokens tokenCache
	// forkLocks serialises the passes of each fork (zero value ready).
	forkLocks keyedLocks
	// forkResumes are the forks whose pass the host monitor runs now.
	forkResumes inflight
	// volumeMoves are the volume moves this replica runs now (volume_move.go).
	volumeMoves inflight
	// networks caches networks for creates; ipam holds the address hints.
	networks networkCache
	ipam     ipamHints
	// projects caches the projects VMs are placed in (projects.go).
	projects projectCache
	// replicaID names this replica's lease; startedAt is when it began.
	replicaID string
	startedAt time.Time

	// reloadMu and lastReload coalesce the refreshes of placements that
	// fall to the slow path at the same time (a burst of no_capacity).
	reloadMu   sync.Mutex
	lastReload time.Time
	// viewCursor is where the next refresh of the view reads changes from,
	// and lastFullReload when it last read every host (refreshView).
	viewCursor     store.HostCursor
	lastFullReload time.Time

	// prefetchCache holds the images with prefetch set for the host
	// monitor (images.go).
	prefetchCache prefetchList
	// overlays are the pushes of overlay networks' entries (overlay.go).
	overlays *overlayPushes
}

const (
	defaultSyncInterval   = 10 * time.Second
	defaultAgentTimeout   = 10 * time.Second
	defaultDeadAfter      = 3
	defaultCandidateLimit = 32
	// defaultForkRetryBackoff: a failed fork pass runs again after 30 s, then 60 s.
	defaultForkRetryBackoff = 30 * time.Second
	minIdempotencyTTL       = 24 * time.Hour
	// idempotencyLease is how long a request may hold its key in flight
	// before another replica may assume it was abandoned (its replica died).
	idempotencyLease = 15 * time.Minute
	// createGrace is how long a VM may stay "creating" before the host
	// monitor treats it like any other VM its agent does not have.
	createGrace = 15 * time.Minute
)

// New returns a Service on st and loads the host view from the database.
// Call Run to start the host monitor.
func New(ctx context.Context, st *store.Store, opts Options) (*Service, error) {
	if st == nil {
		return nil, errors.New("control: no store")
	}
	if opts.SyncInterval <= 0 {
		opts.SyncInterval = defaultSyncInterval
	}
	if opts.AgentTimeout <= 0 {
		opts.AgentTimeout = defaultAgentTimeout
	}
	if opts.DeadAfter <= 0 {
		opts.DeadAfter = defaultDeadAfter
	}
	if opts.CandidateLimit <= 0 {
		opts.CandidateLimit = defaultCandidateLimit
	}
	if opts.CreateGrace <= 0 {
		opts.CreateGrace = createGrace
	}
	if opts.OrphanGrace <= 0 {
		opts.OrphanGrace = createGrace
	}
	if opts.LeaseInterval <= 0 {
		opts.LeaseInterval = defaultLeaseInterval
	}
	if opts.LeaseLapse < 3*opts.LeaseInterval {
		opts.LeaseLapse = max(defaultLeaseLapse, 3*opts.LeaseInterval)
	}
	if opts.ForkRetryBackoff <= 0 {
		opts.ForkRetryBackoff = defaultForkRetryBackoff
	}
	if opts.IdempotencyTTL < minIdempotencyTTL {
		opts.IdempotencyTTL = minIdempotencyTTL
	}
	w := scheduler.DefaultWeights()
	if opts.Weights != nil {
		w = *opts.Weights
	}
	if w.Saturation <= 1 {
		return nil, fmt.Errorf("control: score saturation constant must exceed 1, got %v", w.Saturation)
	}
	if opts.Registry == nil {
		opts.Registry = prometheus.NewRegistry()
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	s := &Service{
		store: st,
		opts:  opts,
		log:   opts.Logger,
		view:  newHostView(w, opts.CandidateLimit),
		// A new lease per process: a restarted replica does not inherit
		// what its previous process left; it settles it like any other.
		replicaID: "r-" + newID(),
		startedAt: time.Now().UTC(),
		overlays:  newOverlayPushes(),
	}
	if opts.WarmMargin != nil {
		s.view.warmMargin = *opts.WarmMargin
	}
	if opts.Hooks != nil {
		s.hooks = *opts.Hooks
	}
	s.metrics = newMetrics(opts.Registry)
	s.drains = newDrains()
	s.agents = newAgentPool(opts.AgentToken, opts.AgentHTTPClient, opts.AgentTimeout, syncTimeout(opts.SyncInterval), s.metrics)
	s.migrations = agentMigrations{pool: s.agents}
	if err := s.startLease(ctx); err != nil {
		return nil, err
	}
	if err := s.reloadView(ctx); err != nil {
		return nil, err
	}
	return s, nil
}

// Registry is where the Service's metrics are registered.
func (s *Service) Registry() *prometheus.Registry { return s.opts.Registry }

// Ready reports whether the database answers.
func (s *Service) Ready(ctx context.Context) error { return s.store.Ping(ctx) }

// reloadView replaces the host view with every host of the database: at
// start and, as a safety net, every fullReloadEvery (refreshView).
func (s *Service) reloadView(ctx context.Context) error {
	s.reloadMu.Lock()
	defer s.reloadMu.Unlock()
	return s.refreshViewLocked(ctx, true)
}

// refreshView brings the host view up to date with the hosts written and
// deleted since its last read (store.HostChanges), so that its cost follows
// what changed, not the size of the fleet. Every fullReloadEvery it reloads
// every host instead: that also catches what the change read cannot see
// (a host deleted by a replica of the release before, without tombstone).
// On SQLite every refresh is a full reload.
func (s *Service) refreshView(ctx context.Context) error {
	s.reloadMu.Lock()
	defer s.reloadMu.Unlock()
	return s.refreshViewLocked(ctx, false)
}

// fullReloadEvery is how often refreshView reloads every host.
const fullReloadEvery = 5 * time.Minute

func (s *Service) refreshViewLocked(ctx context.Context, full bool) error {
	start := time.Now()
	cur := s.viewCursor
	if full || start.Sub(s.lastFullReload) >= fullReloadEvery {
		cur = store.HostCursor{}
	}
	ch, err := s.store.HostChanges(ctx, cur)
	if err != nil {
		return fmt.Errorf("load hosts: %w", err)
	}
	if ch.Full {
		s.view.load(ch.Hosts)
		s.lastFullReload = start
	} else {
		s.view.apply(ch.Hosts, ch.Deleted)
	}
	s.viewCursor, s.lastReload = ch.Next, start
	return nil
}

// reloadViewSince refreshes the host view unless another caller refreshed
// it after `since`: then that refresh already shows what this caller needs.
func (s *Service) reloadViewSince(ctx context.Context, since time.Time) error {
	s.reloadMu.Lock()
	defer s.reloadMu.Unlock()
	if s.lastReload.After(since) {
		return nil
	}
	return s.refreshViewLocked(ctx, false)
}

// refreshHost re-reads one host into the view, after a lost reservation
// race or any release of capacity.
func (s *Service) refreshHost(ctx context.Context, name string) {
	h, err := s.store.GetHost(ctx, name)
	switch {
	case errors.Is(err, store.ErrNotFound):
		s.view.remove(name)
	case err != nil:
		s.log.Warn("refresh host view", "host", name, "err", err)
	default:
		s.view.upsert(h)
	}
}

// detached returns a context that outlives the request (a client that
// hangs up must not leave a create or delete half done) with a bound.
func detached(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), d)
}
