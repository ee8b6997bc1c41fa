// Package cmd holds the subcommands of kvmd (control, agent, dev). server/
// only calls Run, so everything here is testable in process.
package cmd

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"

	"github.com/kvmfleet/terraform-provider-kvm/internal/version"
)

// Env reads an environment variable; tests pass a map-backed one.
type Env func(string) string

// Run dispatches args[0] (control | agent | dev | token) and runs it until
// ctx ends. Only `token create` and `token list` write to stdout.
func Run(ctx context.Context, args []string, getenv Env, stdout, stderr io.Writer) error {
	if len(args) < 1 {
		fmt.Fprint(stderr, usage)
		return errors.New("missing subcommand: want control, agent, dev or token")
	}
	sub, rest := args[0], args[1:]
	switch sub {
	case "control":
		return runControl(ctx, rest, getenv, stderr)
	case "agent":
		return runAgent(ctx, rest, getenv, stderr)
	case "dev":
		return runDev(ctx, rest, getenv, stderr)
	case "token":
		return runToken(ctx, rest, getenv, stdout, stderr)
	case "version", "--version":
		fmt.Fprintf(stdout, "kvmd %s (API level %d; serves API levels %d to %d)\n",
			version.Release(), version.Current(), version.MinServed(), version.MaxServed())
		return nil
	case "-h", "--help", "help":
		fmt.Fprint(stderr, usage)
		return nil
	default:
		fmt.Fprint(stderr, usage)
		return fmt.Errorf("unknown subcommand %q: want control, agent, dev or token", sub)
	}
}

const usage = `usage: kvmd <command> [flags]

commands:
  control   the control API (SQLite in --data-dir, or PostgreSQL with --database-url)
  agent     the host agent that runs VMs with QEMU (or the sim driver)
  dev       a control API on SQLite plus one local agent, in one process
  token     create, list or revoke API tokens (on the control API's database)
  version   print kvmd's release and the API levels it serves

Every flag can also come from the environment as KVMD_<FLAG>, e.g. KVMD_TOKEN.
Run "kvmd <command> -h" for its flags.
`

// parseFlags parses args into fs, then fills every flag not given on the
// command line from KVMD_<FLAG> (dashes become underscores).
func parseFlags(fs *flag.FlagSet, args []string, getenv Env) error {
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments: %s", strings.Join(fs.Args(), " "))
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	var errs []error
	fs.VisitAll(func(f *flag.Flag) {
		if given[f.Name] {
			return
		}
		name := "KVMD_" + strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_"))
		if v := getenv(name); v != "" {
			if err := fs.Set(f.Name, v); err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", name, err))
			}
		}
	})
	return errors.Join(errs...)
}

// readSecret returns value, or the trimmed content of file when value is empty.
func readSecret(value, file, what string) (string, error) {
	if value != "" {
		return value, nil
	}
	if file == "" {
		return "", nil
	}
	b, err := os.ReadFile(file)
	if err != nil {
		return "", fmt.Errorf("read %s file: %w", what, err)
	}
	return strings.TrimSpace(string(b)), nil
}

// metricsTokenFlags registers --metrics-token and --metrics-token-file,
// the same for the control API and the agent, and returns what reads the
// token after parsing ("" leaves /metrics open).
func metricsTokenFlags(fs *flag.FlagSet) func() (string, error) {
	token := fs.String("metrics-token", "", "bearer token /metrics requires (default: /metrics is open)")
	file := fs.String("metrics-token-file", "", "file holding the metrics token")
	return func() (string, error) { return readSecret(*token, *file, "metrics token") }
}

// newLogger returns the JSON logger on stderr that every subcommand uses.
func newLogger(stderr io.Writer, level string) *slog.Logger {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		l = slog.LevelInfo
	}
	return slog.New(slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: l}))
}
