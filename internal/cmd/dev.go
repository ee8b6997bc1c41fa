package cmd

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"os/exec"
	"path/filepath"
	"sync"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/qemu"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
)

// devCPUAllocationRatio is the vCPU overcommit of the dev host.
const devCPUAllocationRatio = 4.0

// Capacity the dev agent advertises when it falls back to the sim driver.
var devSimCapacity = agentapi.Resources{VCPUs: 8, MemoryMiB: 16 << 10, DiskMiB: 100 << 10}

// runDev is `kvmd dev`: a control API on embedded SQLite plus one local
// agent in one process, the agent registered as a host. The quickstart.
func runDev(ctx context.Context, args []string, getenv Env, stderr io.Writer) error {
	fs := flag.NewFlagSet("kvmd dev", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var listen, dataDir, imageDir, driver, token, hostName, logLevel, agentListen string
	fs.StringVar(&listen, "listen", "127.0.0.1:8470", "address of the control API")
	fs.StringVar(&dataDir, "data-dir", ".kvmd-dev", "directory of the SQLite database and the agent's state")
	fs.StringVar(&imageDir, "image-dir", "", "directory of guest images (make image); default: KVM_IMAGE_DIR")
	fs.StringVar(&driver, "driver", "auto", "VMM driver of the local agent: auto (qemu when QEMU is installed, else sim), qemu or sim")
	fs.StringVar(&token, "token", "", "bearer token of the control API (default: a random one, printed)")
	fs.StringVar(&hostName, "host-name", "local", "name the local agent is registered under")
	fs.StringVar(&agentListen, "agent-listen", "127.0.0.1:0", "address of the local agent (default: a free loopback port)")
	fs.StringVar(&logLevel, "log-level", "info", "debug, info, warn or error")
	if err := parseFlags(fs, args, getenv); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	if imageDir == "" {
		imageDir = getenv("KVM_IMAGE_DIR")
	}
	log := newLogger(stderr, logLevel)
	switch driver {
	case "auto":
		driver = "qemu"
		if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
			driver = "sim"
			fmt.Fprintln(stderr, "kvmd dev: qemu-system-x86_64 is not installed, so the local agent uses the SIM driver (simulated VMs, image \"sim\"); install Debian's qemu-system-x86 and qemu-utils for real guests")
		}
	case "qemu", "sim":
	default:
		return fmt.Errorf("kvmd dev: unknown driver %q: want auto, qemu or sim", driver)
	}
	if token == "" {
		token = randomToken()
	}
	agentCfg := agentConfig{
		Listen: agentListen, StateDir: filepath.Join(dataDir, "agent"), ImageDir: imageDir,
		Driver: driver, Accel: "auto", Token: randomToken(), StopTimeout: 10 * time.Second,
		// The defaults of kvmd agent's flags, which kvmd dev does not parse.
		ConsoleLogKiB: qemu.DefaultConsoleLogBytes >> 10, QEMUUIDBase: qemu.DefaultUIDBase, QEMUUIDCount: qemu.DefaultUIDCount,
		UserNetUser: qemu.DefaultUserNetUser,
	}
	if driver == "sim" {
		agentCfg.Capacity = devSimCapacity
	}
	controlCfg := controlConfig{
		Listen: listen, DataDir: filepath.Join(dataDir, "control"), Token: token,
		AgentToken: agentCfg.Token, SyncInterval: 5 * time.Second, ShutdownTimeout: 30 * time.Second,
		// kvmd dev serves plain HTTP on one machine; its own agent may
		// listen off loopback (--agent-listen) and must still register.
		AllowInsecureAgents: true,
	}

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	agentAddr := make(chan string, 1)
	controlAddr := make(chan string, 1)
	errs := make(chan error, 2)
	var wg sync.WaitGroup
	wg.Go(func() {
		errs <- serveAgent(ctx, agentCfg, log.With("part", "agent"), func(a string) { agentAddr <- a })
		cancel()
	})
	var agentAt string
	select {
	case agentAt = <-agentAddr:
	case err := <-errs:
		wg.Wait()
		return fmt.Errorf("kvmd dev: local agent: %w", err)
	}
	wg.Go(func() {
		errs <- serveControl(ctx, controlCfg, log.With("part", "control"), func(a string) { controlAddr <- a })
		cancel()
	})
	var controlAt string
	select {
	case controlAt = <-controlAddr:
	case <-ctx.Done():
		wg.Wait()
		return devResult(errs)
	}

	c := client.New("http://"+controlAt, token, client.WithTimeout(30*time.Second))
	// Idle demo guests barely use their vCPUs, so one machine can hold a few
	// more of them than it has cores.
	ratio := devCPUAllocationRatio
	if _, err := c.PutHost(ctx, hostName, api.HostPut{Address: "http://" + agentAt, CPUAllocationRatio: &ratio}); err != nil {
		cancel()
		wg.Wait()
		return fmt.Errorf("kvmd dev: register the local agent as host %q: %w", hostName, err)
	}
	if err := registerDevImages(ctx, c, imageDir, filepath.Join(dataDir, "images"), stderr); err != nil {
		fmt.Fprintf(stderr, "kvmd dev: %v\n", err)
	}
	fmt.Fprintf(stderr, "kvmd dev: control API on http://%s (SQLite in %s), local agent %q on %s with the %s driver\n",
		controlAt, controlCfg.DataDir, hostName, agentAt, driver)
	fmt.Fprintf(stderr, "kvmd dev: for the provider:\n  export KVM_ENDPOINT=http://%s\n  export KVM_TOKEN=%s\n", controlAt, token)
	fmt.Fprintf(stderr, "kvmd dev: fleet page: http://%s/ui (sign in with the token)\n", controlAt)
	<-ctx.Done()
	wg.Wait()
	return devResult(errs)
}

// devResult gathers the errors of the two servers once both have stopped.
func devResult(errs chan error) error {
	close(errs)
	var all []error
	for err := range errs {
		all = append(all, err)
	}
	return errors.Join(all...)
}

func randomToken() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
