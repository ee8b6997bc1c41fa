package cmd

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
	"github.com/kvmfleet/terraform-provider-kvm/internal/httpapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// controlConfig is the configuration of one control API server.
type controlConfig struct {
	Listen      string
	DataDir     string // SQLite file kvmd.db lives here when DatabaseURL is empty
	DatabaseURL string
	Token       string // bearer token of the API (the bootstrap admin)
	// MetricsToken, when set, is the bearer token /metrics requires.
	MetricsToken    string
	AgentToken      string // token the agents expect
	SyncInterval    time.Duration
	TLSCert, TLSKey string
	ShutdownTimeout time.Duration
	// AgentCAFile holds PEM certificates to trust for agents served over
	// TLS (addresses with https://) whose certificates a private CA signed.
	AgentCAFile string
	// AllowInsecureAgents accepts http:// agent addresses off loopback.
	AllowInsecureAgents bool
	// CreateGrace and OrphanGrace tune the host monitor's reconciliation
	// (control.Options; 0 = its defaults).
	CreateGrace, OrphanGrace time.Duration
	// SQLiteSync is --sqlite-sync: full (default) or normal.
	SQLiteSync string
}

// runControl is `kvmd control`.
func runControl(ctx context.Context, args []string, getenv Env, stderr io.Writer) error {
	fs := flag.NewFlagSet("kvmd control", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var cfg controlConfig
	var tokenFile, agentTokenFile, logLevel string
	fs.StringVar(&cfg.Listen, "listen", "127.0.0.1:8470", "address to listen on")
	fs.StringVar(&cfg.DataDir, "data-dir", "", "directory of the embedded SQLite database (used without --database-url)")
	fs.StringVar(&cfg.DatabaseURL, "database-url", "", "PostgreSQL URL (postgres://...); replaces SQLite")
	fs.StringVar(&cfg.Token, "token", "", "bearer token clients must send")
	fs.StringVar(&tokenFile, "token-file", "", "file holding the bearer token")
	metricsToken := metricsTokenFlags(fs)
	fs.StringVar(&cfg.AgentToken, "agent-token", "", "token of the host agents")
	fs.StringVar(&agentTokenFile, "agent-token-file", "", "file holding the agent token")
	fs.DurationVar(&cfg.SyncInterval, "sync-interval", 10*time.Second, "how often every agent is asked for its VMs")
	fs.StringVar(&cfg.TLSCert, "tls-cert", "", "TLS certificate file (serve HTTPS with --tls-key)")
	fs.StringVar(&cfg.TLSKey, "tls-key", "", "TLS key file")
	fs.StringVar(&cfg.AgentCAFile, "agent-ca-file", "", "PEM CA certificates to trust for agents at https:// addresses (besides the system's)")
	fs.BoolVar(&cfg.AllowInsecureAgents, "allow-insecure-agents", false, "accept http:// agent addresses off loopback (default: https:// only, or http:// on 127.0.0.0/8, ::1 and localhost)")
	fs.DurationVar(&cfg.ShutdownTimeout, "shutdown-timeout", 30*time.Second, "how long to wait for requests in flight at shutdown")
	fs.StringVar(&logLevel, "log-level", "info", "debug, info, warn or error")
	fs.DurationVar(&cfg.CreateGrace, "create-grace", 15*time.Minute, "how long a VM may stay creating before the host monitor settles it from its agent (must exceed a create's 10 min bound)")
	fs.StringVar(&cfg.SQLiteSync, "sqlite-sync", store.SQLiteSyncFull, "SQLite durability: full (fsync every commit; an acknowledged create survives a power loss) or normal (faster; a power loss may roll back the last commits)")
	fs.DurationVar(&cfg.OrphanGrace, "orphan-grace", 15*time.Minute, "how old a VM on an agent without a database row must be before the host monitor deletes it")
	if err := parseFlags(fs, args, getenv); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	var err error
	if cfg.Token, err = readSecret(cfg.Token, tokenFile, "token"); err != nil {
		return err
	}
	if cfg.AgentToken, err = readSecret(cfg.AgentToken, agentTokenFile, "agent token"); err != nil {
		return err
	}
	if cfg.MetricsToken, err = metricsToken(); err != nil {
		return err
	}
	return serveControl(ctx, cfg, newLogger(stderr, logLevel), nil)
}

func (cfg controlConfig) validate() error {
	var errs []error
	if cfg.Token == "" {
		errs = append(errs, errors.New("no API token: set --token, --token-file or KVMD_TOKEN"))
	}
	if cfg.AgentToken == "" {
		errs = append(errs, errors.New("no agent token: set --agent-token, --agent-token-file or KVMD_AGENT_TOKEN"))
	}
	if cfg.DatabaseURL == "" && cfg.DataDir == "" {
		errs = append(errs, errors.New("no database: set --data-dir for SQLite or --database-url for PostgreSQL"))
	}
	if (cfg.TLSCert == "") != (cfg.TLSKey == "") {
		errs = append(errs, errors.New("--tls-cert and --tls-key go together"))
	}
	if cfg.SyncInterval <= 0 {
		errs = append(errs, errors.New("--sync-interval must be positive"))
	}
	if _, err := store.ParseSQLiteSync(cfg.SQLiteSync); err != nil {
		errs = append(errs, err)
	}
	if cfg.MetricsToken != "" && (cfg.MetricsToken == cfg.Token || cfg.MetricsToken == cfg.AgentToken) {
		errs = append(errs, errors.New("the metrics token equals the API or agent token: give the scraper its own token, which can read only /metrics"))
	}
	if cfg.Token != "" && cfg.Token == cfg.AgentToken {
		errs = append(errs, errors.New("the API token and the agent token are the same: give each its own, so that an API client cannot call agents directly"))
	}
	return errors.Join(errs...)
}

// serveControl runs a control API server until ctx ends, then shuts down
// gracefully: the listener stops, requests in flight get ShutdownTimeout,
// the host monitor stops, the database closes. ready, when set, is called
// with the listening address once connections are accepted.
func serveControl(ctx context.Context, cfg controlConfig, log *slog.Logger, ready func(addr string)) error {
	if err := cfg.validate(); err != nil {
		return err
	}
	if cfg.ShutdownTimeout <= 0 {
		cfg.ShutdownTimeout = 30 * time.Second
	}
	fullSync, _ := store.ParseSQLiteSync(cfg.SQLiteSync) // checked by validate
	st, err := store.Open(ctx, store.Config{DatabaseURL: cfg.DatabaseURL, DataDir: cfg.DataDir, Logger: log, SQLiteFullSync: fullSync})
	if err != nil {
		return err
	}
	defer func() {
		if err := st.Close(); err != nil {
			log.Warn("close database", "err", err)
		}
	}()
	agentHTTP, err := httpClientTrusting(cfg.AgentCAFile, "agent")
	if err != nil {
		return err
	}
	svc, err := control.New(ctx, st, control.Options{AgentToken: cfg.AgentToken, SyncInterval: cfg.SyncInterval, Logger: log,
		CreateGrace: cfg.CreateGrace, OrphanGrace: cfg.OrphanGrace, AgentHTTPClient: agentHTTP,
		AllowInsecureAgents: cfg.AllowInsecureAgents})
	if err != nil {
		return err
	}
	handler, err := httpapi.New(svc, httpapi.Options{Token: cfg.Token, MetricsToken: cfg.MetricsToken, Logger: log})
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return fmt.Errorf("listen on %s: %w", cfg.Listen, err)
	}
	srv := &http.Server{
		Handler:           handler,
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       readTimeout,
		WriteTimeout:      controlWriteTimeout,
		MaxHeaderBytes:    maxHeaderBytes,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}

	monitorCtx, stopMonitor := context.WithCancel(context.WithoutCancel(ctx))
	var wg sync.WaitGroup
	wg.Go(func() { _ = svc.Run(monitorCtx) })
	defer func() {
		stopMonitor()
		wg.Wait()
	}()

	serveErr := make(chan error, 1)
	go func() {
		if cfg.TLSCert != "" {
			serveErr <- srv.ServeTLS(ln, cfg.TLSCert, cfg.TLSKey)
		} else {
			serveErr <- srv.Serve(ln)
		}
	}()
	syncMode, err := st.SQLiteSync(ctx)
	if err != nil {
		log.Warn("read the SQLite sync mode", "err", err)
	}
	log.Info("control API listening", "address", ln.Addr().String(), "database", st.Dialect(), "tls", cfg.TLSCert != "",
		"sqlite_sync", syncMode)
	if ready != nil {
		ready(ln.Addr().String())
	}
	select {
	case err := <-serveErr:
		return fmt.Errorf("control API server: %w", err)
	case <-ctx.Done():
	}
	log.Info("control API shutting down")
	shutdownCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cfg.ShutdownTimeout)
	defer cancel()
	if err := srv.Shutdown(shutdownCtx); err != nil {
		return fmt.Errorf("graceful shutdown: %w", err)
	}
	if err := <-serveErr; err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
