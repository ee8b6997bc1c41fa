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
	"net/netip"
	"strings"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/image"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/qemu"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/sim"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// agentConfig is the configuration of one host agent server.
type agentConfig struct {
	Listen   string
	StateDir string
	ImageDir string
	Driver   string // qemu or sim
	Accel    string // auto, kvm or tcg
	Token    string
	// MetricsToken, when set, is the bearer token /metrics requires.
	MetricsToken    string
	Capacity        agentapi.Resources // zero fields: the host's own
	StopTimeout     time.Duration
	DiskChainDepth  int
	TLSCert, TLSKey string
	Pool            agent.PoolOptions
	// PeerCAFile holds PEM certificates to trust for other agents served
	// over TLS, from which this one pulls snapshots.
	PeerCAFile string
	// ImageMaxBytes caps the size of a registered image this agent fetches.
	ImageMaxBytes int64
	// AdvertiseURLs are addresses the agent proves its identity for beside
	// the IP and port a challenge arrives on (DNS names, proxies).
	AdvertiseURLs []string
	// UserNetUser is the user passt runs as for user-mode NICs (root only).
	UserNetUser string
	// UserNetAllow are private or link-local ranges user-mode guests may reach.
	UserNetAllow []netip.Prefix
	// ConsoleLogKiB caps each VM's console log; QEMUUIDBase and
	// QEMUUIDCount are the uids QEMU runs as (qemu.Options).
	ConsoleLogKiB             int64
	QEMUUIDBase, QEMUUIDCount uint
	// OVMFDir holds the UEFI firmware of uefi VMs (qemu.Options).
	OVMFDir string
	// VMNice is the nice value of VMs' QEMUs (qemu.Options.Nice).
	VMNice int
	// UnderlayAddress is the host's IPv4 address the VXLAN tunnels of
	// overlay networks start from (one of its interfaces').
	UnderlayAddress string
}

// runAgent runs the host agent (kvmd agent) until ctx ends. Its VMs keep
// running when it stops; the next agent on the same --state-dir re-adopts them.
func runAgent(ctx context.Context, args []string, getenv Env, stderr io.Writer) error {
	fs := flag.NewFlagSet("kvmd agent", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var cfg agentConfig
	var tokenFile, logLevel, advertise, userNetAllow string
	fs.StringVar(&cfg.Listen, "listen", "127.0.0.1:8471", "address to serve the agent API on")
	fs.StringVar(&cfg.StateDir, "state-dir", "", "directory of the VMs' disks, consoles and metadata (required)")
	fs.StringVar(&cfg.ImageDir, "image-dir", "", "directory of images, one folder with an image.json each (make image); registered images are cached in its sha256/ folder")
	fs.StringVar(&cfg.Driver, "driver", "qemu", "VMM driver: qemu (real guests) or sim (simulated, for scale tests)")
	fs.StringVar(&cfg.Accel, "accel", "auto", "qemu accelerator: auto (kvm when it really runs guests, else tcg), kvm or tcg")
	fs.StringVar(&cfg.Token, "token", "", "bearer token of the agent API")
	fs.StringVar(&tokenFile, "token-file", "", "file holding the bearer token (instead of --token)")
	metricsToken := metricsTokenFlags(fs)
	fs.Int64Var(&cfg.Capacity.VCPUs, "vcpus", 0, "vCPUs to advertise (default: the host's; the sim driver needs it)")
	fs.Int64Var(&cfg.Capacity.MemoryMiB, "memory-mib", 0, "memory to advertise in MiB (default: the host's)")
	fs.Int64Var(&cfg.Capacity.DiskMiB, "disk-mib", 0, "disk to advertise in MiB (default: the state directory's filesystem)")
	fs.Int64Var(&cfg.ConsoleLogKiB, "console-log-kib", qemu.DefaultConsoleLogBytes>>10,
		"qemu: cap of each VM's serial console log in KiB (at least 64): the agent keeps the boot's first sixteenth (at most 64 KiB) and the latest output, "+
			"trimming every second; the cap and 64 KiB of QEMU's own log, rounded up to MiB, count in each VM's host disk (allocated and free disk in /v1/info, the warm pool's room) beside its disk_mib")
	fs.UintVar(&cfg.QEMUUIDBase, "qemu-uid-base", qemu.DefaultUIDBase,
		"qemu: first uid (and gid) of the range the agent, when root, runs each VM's QEMU as, one per VM; no user or group of the host may have one")
	fs.UintVar(&cfg.QEMUUIDCount, "qemu-uid-count", qemu.DefaultUIDCount, "qemu: how many uids from --qemu-uid-base the agent may give VMs")
	fs.StringVar(&cfg.OVMFDir, "ovmf-dir", qemu.DefaultOVMFDir, "qemu: folder of the UEFI firmware of uefi VMs (Debian's ovmf package): "+
		"OVMF_CODE_4M.fd and OVMF_VARS_4M.fd, and OVMF_CODE_4M.secboot.fd and OVMF_VARS_4M.ms.fd for Secure Boot")
	fs.IntVar(&cfg.VMNice, "vm-nice", qemu.DefaultNice, "qemu: nice value every VM's QEMU starts at, and the cpu.weight.nice of the VMs' cgroups, "+
		"so that busy guests never slow the agent's answers (0: the default; negative: the agent's own priority)")
	fs.DurationVar(&cfg.StopTimeout, "stop-timeout", 10*time.Second, "how long a stop waits for the guest's ACPI power-off before ending QEMU")
	fs.IntVar(&cfg.DiskChainDepth, "disk-chain-depth", agent.DefaultDiskChainDepth,
		"the most files of a vm's own disk chain (at least 2): snapshots past it flatten the chain in the background, and a pulled snapshot may list no more")
	fs.IntVar(&cfg.Pool.Concurrency, "pool-concurrency", 1, "warm pool: how many warm VMs boot at once")
	fs.IntVar(&cfg.Pool.Nice, "pool-nice", 10, "warm pool: nice value warm VMs boot at, below user VMs (--vm-nice) until handed out (0: the default 10; negative: the user VMs' own)")
	fs.IntVar(&cfg.Pool.MaxSize, "pool-max-size", 32, "warm pool: the most warm VMs all targets together may ask for")
	fs.DurationVar(&cfg.Pool.BootTimeout, "pool-boot-timeout", 3*time.Minute, "warm pool: how long a warm boot may take until the guest's ready line")
	fs.StringVar(&logLevel, "log-level", "info", "log level: debug, info, warn or error")
	fs.StringVar(&cfg.TLSCert, "tls-cert", "", "TLS certificate file (with --tls-key): serve HTTPS")
	fs.StringVar(&cfg.TLSKey, "tls-key", "", "TLS key file")
	fs.StringVar(&advertise, "advertise-url", "", "comma-separated https://name:port addresses the control plane registers this agent by, "+
		"when not the IP and port it listens on (a DNS name, a proxy): the agent proves its identity only for these and its own IP:port")
	fs.Int64Var(&cfg.ImageMaxBytes, "image-max-bytes", image.DefaultMaxBytes, "the largest registered image this agent fetches, in bytes: "+
		"a source that announces more is refused before a byte is read, one that sends more is cut there and the image fails")
	fs.StringVar(&cfg.PeerCAFile, "peer-ca-file", "", "PEM CA certificates to trust for other agents at https:// addresses (snapshot pulls)")
	fs.StringVar(&cfg.UserNetUser, "user-net-user", qemu.DefaultUserNetUser, "user-mode networks: the system user passt runs as when the agent is root "+
		"(its new connections to the host and to private ranges are refused by the agent's nftables chain); nobody, with a warning, when it does not exist")
	fs.StringVar(&userNetAllow, "user-net-allow", "", "user-mode networks: comma-separated CIDRs of private, shared or link-local ranges that guests may reach "+
		"through NAT (by default they reach only public addresses; never the host's own addresses)")
	fs.StringVar(&cfg.UnderlayAddress, "underlay-address", "", "overlay networks: this host's IPv4 address on the network between the hosts, "+
		"which the VXLAN tunnels (UDP 4789) start from; it must be on one of the host's interfaces. Without it the agent takes no overlay network")
	if err := parseFlags(fs, args, getenv); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	secret, err := readSecret(cfg.Token, tokenFile, "token")
	if err != nil {
		return err
	}
	cfg.Token = secret
	if cfg.MetricsToken, err = metricsToken(); err != nil {
		return err
	}
	for _, c := range strings.Split(userNetAllow, ",") {
		if c = strings.TrimSpace(c); c == "" {
			continue
		}
		p, err := netip.ParsePrefix(c)
		if err != nil || !p.Addr().Is4() {
			return fmt.Errorf("kvmd agent: --user-net-allow: %q is not an IPv4 CIDR (like 10.20.0.0/16)", c)
		}
		cfg.UserNetAllow = append(cfg.UserNetAllow, p.Masked())
	}
	for _, u := range strings.Split(advertise, ",") {
		if u = strings.TrimSpace(u); u != "" {
			cfg.AdvertiseURLs = append(cfg.AdvertiseURLs, u)
		}
	}
	return serveAgent(ctx, cfg, newLogger(stderr, logLevel), nil)
}

func (cfg agentConfig) validate() error {
	var errs []error
	if cfg.Token == "" {
		errs = append(errs, errors.New("no token: give --token, --token-file or KVMD_TOKEN"))
	}
	if cfg.MetricsToken != "" && cfg.MetricsToken == cfg.Token {
		errs = append(errs, errors.New("the metrics token equals the agent token: give the scraper its own token, which can read only /metrics"))
	}
	if cfg.StateDir == "" {
		errs = append(errs, errors.New("no state directory: give --state-dir or KVMD_STATE_DIR"))
	}
	if cfg.ImageMaxBytes < 0 {
		errs = append(errs, fmt.Errorf("--image-max-bytes %d: want a number of bytes (0: the default, 64 GiB)", cfg.ImageMaxBytes))
	}
	if (cfg.TLSCert == "") != (cfg.TLSKey == "") {
		errs = append(errs, errors.New("give both --tls-cert and --tls-key, or neither"))
	}
	for _, u := range cfg.AdvertiseURLs {
		if _, err := agentapi.CheckAddress(u); err != nil {
			errs = append(errs, fmt.Errorf("--advertise-url: %w", err))
		}
	}
	switch cfg.Driver {
	case "qemu":
	case "sim":
		if cfg.Capacity.VCPUs <= 0 || cfg.Capacity.MemoryMiB <= 0 || cfg.Capacity.DiskMiB <= 0 {
			errs = append(errs, errors.New("the sim driver needs the capacity to advertise: give --vcpus, --memory-mib and --disk-mib"))
		}
	default:
		errs = append(errs, fmt.Errorf("unknown driver %q: want qemu or sim", cfg.Driver))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("kvmd agent: %w", err)
	}
	return nil
}

// newDriver builds the VMM driver the configuration names.
func newDriver(ctx context.Context, cfg agentConfig, log *slog.Logger) (agent.Driver, error) {
	if cfg.Driver == "sim" {
		return sim.New(sim.Options{ImageDir: cfg.ImageDir}), nil
	}
	if cfg.QEMUUIDBase+cfg.QEMUUIDCount > 1<<32-2 || cfg.QEMUUIDCount == 0 {
		return nil, fmt.Errorf("kvmd agent: --qemu-uid-base %d and --qemu-uid-count %d: want a non-empty range below 4294967294", cfg.QEMUUIDBase, cfg.QEMUUIDCount)
	}
	d, err := qemu.New(ctx, qemu.Options{ImageDir: cfg.ImageDir, Accel: cfg.Accel, Logger: log,
		ConsoleLogBytes: cfg.ConsoleLogKiB << 10, UIDBase: uint32(cfg.QEMUUIDBase), UIDCount: uint32(cfg.QEMUUIDCount),
		UserNetUser: cfg.UserNetUser, UserNetAllow: cfg.UserNetAllow, OVMFDir: cfg.OVMFDir, Nice: cfg.VMNice})
	if err != nil {
		return nil, fmt.Errorf("kvmd agent: %w", err)
	}
	return d, nil
}

// serveAgent runs an agent server until ctx ends, then shuts down
// gracefully; its VMs keep running. ready, when set, is called with the
// listening address once connections are accepted.
func serveAgent(ctx context.Context, cfg agentConfig, log *slog.Logger, ready func(addr string)) error {
	if err := cfg.validate(); err != nil {
		return err
	}
	driver, err := newDriver(ctx, cfg, log)
	if err != nil {
		return err
	}
	peerHTTP, err := httpClientTrusting(cfg.PeerCAFile, "peer agent")
	if err != nil {
		return fmt.Errorf("kvmd agent: %w", err)
	}
	a, err := agent.New(ctx, agent.Config{
		StateDir: cfg.StateDir, Driver: driver, Token: cfg.Token, MetricsToken: cfg.MetricsToken, StopTimeout: cfg.StopTimeout, Logger: log,
		Capacity: cfg.Capacity, Pool: cfg.Pool, PeerHTTPClient: peerHTTP, Addresses: cfg.AdvertiseURLs,
		ImageCacheDir: cfg.ImageDir, ImageFetch: image.Config{MaxBytes: cfg.ImageMaxBytes}, DiskChainDepth: cfg.DiskChainDepth,
		UnderlayAddress: cfg.UnderlayAddress,
	})
	if err != nil {
		return err
	}
	defer func() { _ = a.Close() }()

	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return fmt.Errorf("kvmd agent: listen on %s: %w", cfg.Listen, err)
	}
	srv := &http.Server{
		Handler:           a.Handler(),
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       readTimeout,
		MaxHeaderBytes:    maxHeaderBytes,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
	served := make(chan error, 1)
	go func() {
		if cfg.TLSCert != "" {
			served <- srv.ServeTLS(ln, cfg.TLSCert, cfg.TLSKey)
		} else {
			served <- srv.Serve(ln)
		}
	}()
	log.Info("kvmd agent listening", "address", ln.Addr().String(), "driver", cfg.Driver, "tls", cfg.TLSCert != "")
	if ready != nil {
		ready(ln.Addr().String())
	}
	select {
	case err := <-served:
		return fmt.Errorf("kvmd agent: serve: %w", err)
	case <-ctx.Done():
	}
	// A create may be booting a guest: give calls in flight time to finish.
	shutdownCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutdownCtx); err != nil {
		return fmt.Errorf("kvmd agent: shutdown: %w", err)
	}
	if err := <-served; err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("kvmd agent: serve: %w", err)
	}
	log.Info("kvmd agent stopped; its VMs keep running")
	return nil
}
