package cmd

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// runToken is `kvmd token create|list|revoke`. It works on the database
// itself (the same --data-dir or --database-url as kvmd control), not
// through the API: an operator can make the first tokens before any
// client holds one, and while the API is down; whoever can open the
// database already holds every secret it guards. A revoke made here
// reaches running replicas when their token cache entry ages out
// (control.TokenCacheTTL, seconds); POST and DELETE /v1/tokens do the same
// over the API with an admin token, and a revoke there is immediate on
// the replica that serves it.
func runToken(ctx context.Context, args []string, getenv Env, stdout, stderr io.Writer) error {
	if len(args) < 1 {
		fmt.Fprint(stderr, tokenUsage)
		return errors.New("missing token command: want create, list or revoke")
	}
	sub, rest := args[0], args[1:]
	fs := flag.NewFlagSet("kvmd token "+sub, flag.ContinueOnError)
	fs.SetOutput(stderr)
	var cfg store.Config
	fs.StringVar(&cfg.DataDir, "data-dir", "", "directory of the control API's SQLite database (as kvmd control --data-dir)")
	fs.StringVar(&cfg.DatabaseURL, "database-url", "", "PostgreSQL URL of the control API (as kvmd control --database-url)")
	var (
		name, scopes, expiresAt, project string
		expiresIn                        time.Duration
		id                               string
	)
	switch sub {
	case "create":
		fs.StringVar(&name, "name", "", "name of the token (who or what uses it), e.g. ci")
		fs.StringVar(&scopes, "scopes", api.ScopeUser, "comma-separated scopes: admin (hosts, networks, images, tokens), user (VMs, forks, placements, reads)")
		fs.StringVar(&project, "project", "", "make a project token: it sees and acts on this project's VMs, forks and networks only (user scope; the project must exist) (default: a fleet-wide token)")
		fs.DurationVar(&expiresIn, "expires-in", 0, "lifetime of the token, e.g. 720h (default: no expiry)")
		fs.StringVar(&expiresAt, "expires-at", "", "expiry as an RFC 3339 time, e.g. 2027-01-01T00:00:00Z (instead of --expires-in)")
	case "list":
	case "revoke":
		// The id is the last argument: kvmd token revoke [flags] ID.
		if n := len(rest); n > 0 && !strings.HasPrefix(rest[n-1], "-") {
			id, rest = rest[n-1], rest[:n-1]
		}
	case "-h", "--help", "help":
		fmt.Fprint(stderr, tokenUsage)
		return nil
	default:
		fmt.Fprint(stderr, tokenUsage)
		return fmt.Errorf("unknown token command %q: want create, list or revoke", sub)
	}
	if err := parseFlags(fs, rest, getenv); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	if cfg.DatabaseURL == "" && cfg.DataDir == "" {
		return errors.New("no database: set --data-dir (SQLite) or --database-url (PostgreSQL), the same as kvmd control's")
	}
	if sub == "revoke" && id == "" {
		return errors.New("kvmd token revoke needs the token's id (see kvmd token list)")
	}
	cfg.Logger = slog.New(slog.DiscardHandler)
	st, err := store.Open(ctx, cfg)
	if err != nil {
		return err
	}
	defer func() { _ = st.Close() }()
	svc, err := control.New(ctx, st, control.Options{})
	if err != nil {
		return err
	}
	switch sub {
	case "create":
		in := api.TokenCreate{Name: name, Scopes: splitScopes(scopes), Project: project}
		switch {
		case expiresIn != 0 && expiresAt != "":
			return errors.New("give --expires-in or --expires-at, not both")
		case expiresIn < 0:
			return fmt.Errorf("--expires-in %s is negative", expiresIn)
		case expiresIn > 0:
			at := time.Now().Add(expiresIn).UTC().Truncate(time.Second)
			in.ExpiresAt = &at
		case expiresAt != "":
			at, err := time.Parse(time.RFC3339, expiresAt)
			if err != nil {
				return fmt.Errorf("--expires-at %q is not an RFC 3339 time such as 2027-01-01T00:00:00Z", expiresAt)
			}
			in.ExpiresAt = &at
		}
		tok, err := svc.CreateToken(ctx, in)
		if err != nil {
			return err
		}
		fmt.Fprintf(stderr, "created token %s (name %s, %s, scopes %s, expires %s); its secret is shown once, below:\n",
			tok.ID, tok.Name, projectOrFleet(tok.Project), strings.Join(tok.Scopes, ","), timeOrNever(tok.ExpiresAt))
		fmt.Fprintln(stdout, tok.Secret)
		return nil
	case "list":
		w := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(w, "ID\tNAME\tPROJECT\tSCOPES\tEXPIRES\tLAST USED\tCREATED")
		page := control.Page{Size: api.MaxPageSize}
		for {
			list, err := svc.ListTokens(ctx, page)
			if err != nil {
				return err
			}
			for _, t := range list.Items {
				fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", t.ID, t.Name, cmp.Or(t.Project, "-"), strings.Join(t.Scopes, ","),
					timeOrNever(t.ExpiresAt), timeOrNever(t.LastUsedAt), t.CreatedAt.UTC().Format(time.RFC3339))
			}
			if list.NextPageToken == "" {
				return w.Flush()
			}
			page.Token = list.NextPageToken
		}
	default: // revoke
		if err := svc.RevokeToken(ctx, id); err != nil {
			return err
		}
		fmt.Fprintf(stderr, "revoked token %s; running control API replicas refuse it within %s\n", id, control.TokenCacheTTL)
		return nil
	}
}

func splitScopes(s string) []string {
	var out []string
	for p := range strings.SplitSeq(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

func projectOrFleet(project string) string {
	if project == "" {
		return "fleet-wide"
	}
	return "project " + project
}

func timeOrNever(t *time.Time) string {
	if t == nil {
		return "never"
	}
	return t.UTC().Format(time.RFC3339)
}

const tokenUsage = `usage: kvmd token <create|list|revoke> [flags]

  kvmd token create --name ci --scopes user [--project NAME] [--expires-in 720h] --data-dir DIR
      prints the new token's secret on stdout (shown only this once)
  kvmd token list --data-dir DIR
      one line per token; PROJECT is "-" for a fleet-wide token
  kvmd token revoke --data-dir DIR ID

Scopes: admin (hosts, networks, images, tokens), user (VMs, forks,
placements, and reads of hosts, networks and images); a token may hold both.
admin does not imply user: an admin-only token cannot write VMs, and over
the API it may create only tokens whose scopes it holds itself (admin).
--project NAME makes a project token: it sees and acts on that project's
VMs, forks and networks only (another project's objects answer as unknown
ids), its VMs count against the project's quotas, and it cannot hold
admin. The project must exist (an admin creates it: POST /v1/projects).
Without --project the token is fleet-wide.
Use --database-url instead of --data-dir for PostgreSQL. The commands work
on the database directly (any scopes: whoever opens the database holds
them all); the API offers the same as POST, GET and DELETE /v1/tokens to
an admin token.
`
