package cmd

import (
	"bytes"
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/control"
	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// TestTokenCommands: kvmd token create/list/revoke on the database of a
// running kvmd control: the created token works within its scope, list
// shows it without its secret, and after a revoke the API refuses it.
// The control API also guards /metrics with --metrics-token.
func TestTokenCommands(t *testing.T) {
	dataDir := filepath.Join(t.TempDir(), "data")
	getenv := func(k string) string { return map[string]string{"KVMD_DATA_DIR": dataDir}[k] }
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	token := func(args ...string) (string, string, error) {
		var out, errOut bytes.Buffer
		err := Run(ctx, append([]string{"token"}, args...), getenv, &out, &errOut)
		return out.String(), errOut.String(), err
	}

	secretOut, msg, err := token("create", "--name", "ci", "--scopes", "user", "--expires-in", "24h")
	if err != nil {
		t.Fatalf("token create: %v (%s)", err, msg)
	}
	secret := strings.TrimSpace(secretOut)
	if !strings.HasPrefix(secret, "kvmd_") || strings.Count(secretOut, "\n") != 1 || !strings.Contains(msg, "created token") {
		t.Fatalf("token create printed %q on stdout and %q on stderr", secretOut, msg)
	}
	if _, _, err := token("create", "--name", "bad", "--scopes", "root"); err == nil || !strings.Contains(err.Error(), `scope "root" is not known`) {
		t.Errorf("token create with an unknown scope: %v", err)
	}
	if _, _, err := token("create", "--name", "ci2"); err != nil {
		t.Errorf("token create with the default scope: %v", err)
	}

	var logs controlLogSink
	addr := make(chan string, 1)
	done := make(chan error, 1)
	go func() {
		done <- serveControl(ctx, controlConfig{Listen: "127.0.0.1:0", DataDir: dataDir, Token: "bootstrap-token",
			AgentToken: "agent-token", MetricsToken: "scrape-token", SyncInterval: time.Hour},
			newLogger(&logs, "debug"), func(a string) { addr <- a })
	}()
	var base string
	select {
	case a := <-addr:
		base = "http://" + a
	case err := <-done:
		t.Fatalf("kvmd control: %v", err)
	}
	status := func(method, path, bearer string) int {
		t.Helper()
		return bearerStatus(t, ctx, method, base+path, bearer)
	}
	if got := status("GET", "/v1/vms", secret); got != 200 {
		t.Errorf("GET /v1/vms with the created user token: %d", got)
	}
	if got := status("PUT", "/v1/hosts/h1", secret); got != 403 {
		t.Errorf("PUT /v1/hosts with the created user token: %d; want 403", got)
	}
	if got := status("GET", "/metrics", ""); got != 401 {
		t.Errorf("/metrics without the metrics token: %d; want 401", got)
	}
	if got := status("GET", "/metrics", "scrape-token"); got != 200 {
		t.Errorf("/metrics with the metrics token: %d; want 200", got)
	}

	list, _, err := token("list")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(list, "ci ") || strings.Contains(list, secret) || !strings.Contains(list, "user") {
		t.Errorf("token list:\n%s", list)
	}
	var id string
	for line := range strings.Lines(list) {
		if f := strings.Fields(line); len(f) > 1 && f[1] == "ci" {
			id = f[0]
		}
	}
	if _, msg, err := token("revoke", id); err != nil {
		t.Fatalf("token revoke %s: %v (%s)", id, err, msg)
	}
	if _, _, err := token("revoke", id); err == nil {
		t.Error("revoking the same token twice succeeded")
	}
	deadline := time.Now().Add(control.TokenCacheTTL + 10*time.Second)
	for status("GET", "/v1/vms", secret) != 401 {
		if time.Now().After(deadline) {
			t.Fatalf("the API still accepts a token revoked with kvmd token revoke after %s", control.TokenCacheTTL)
		}
		time.Sleep(200 * time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("kvmd control: %v", err)
	}
	// The request log names the token that acted, never its secret.
	if l := logs.String(); !strings.Contains(l, `"token":"`+id+` (ci)"`) || strings.Contains(l, secret[len("kvmd_"):]) ||
		strings.Contains(l, "scrape-token") || strings.Contains(l, "bootstrap-token") {
		t.Errorf("control API log: want the token id and name, no secret:\n%s", l)
	}
}

// kvmd token create --project makes a project token: list shows its
// project, the API lets it see that project alone, and a project token
// with admin, or of a project that does not exist, is refused.
func TestTokenCreateProject(t *testing.T) {
	dataDir := filepath.Join(t.TempDir(), "data")
	getenv := func(k string) string { return map[string]string{"KVMD_DATA_DIR": dataDir}[k] }
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	token := func(args ...string) (string, string, error) {
		var out, errOut bytes.Buffer
		err := Run(ctx, append([]string{"token"}, args...), getenv, &out, &errOut)
		return out.String(), errOut.String(), err
	}
	st, err := store.Open(ctx, store.Config{DataDir: dataDir})
	if err != nil {
		t.Fatal(err)
	}
	svc, err := control.New(ctx, st, control.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := svc.CreateProject(ctx, api.ProjectCreate{Name: "team-a"}); err != nil {
		t.Fatal(err)
	}
	_ = st.Close()

	secretOut, msg, err := token("create", "--name", "team-ci", "--project", "team-a")
	if err != nil {
		t.Fatalf("token create --project team-a: %v (%s)", err, msg)
	}
	secret := strings.TrimSpace(secretOut)
	if !strings.Contains(msg, "project team-a") {
		t.Errorf("token create --project team-a said %q, want it to name the project", msg)
	}
	if _, msg, err := token("create", "--name", "fleet-ci"); err != nil || !strings.Contains(msg, "fleet-wide") {
		t.Errorf("token create without --project: %v, said %q; want a fleet-wide token", err, msg)
	}
	if _, _, err := token("create", "--name", "bad", "--project", "team-a", "--scopes", "admin"); err == nil ||
		!strings.Contains(err.Error(), `cannot hold scope "admin"`) {
		t.Errorf("token create --project team-a --scopes admin: %v; want refused", err)
	}
	if _, _, err := token("create", "--name", "bad", "--project", "nope"); err == nil ||
		!strings.Contains(err.Error(), `project "nope" does not exist`) {
		t.Errorf("token create --project nope: %v; want refused", err)
	}

	list, _, err := token("list")
	if err != nil {
		t.Fatal(err)
	}
	projects := map[string]string{}
	for line := range strings.Lines(list) {
		if f := strings.Fields(line); len(f) > 2 {
			projects[f[1]] = f[2]
		}
	}
	if projects["NAME"] != "PROJECT" || projects["team-ci"] != "team-a" || projects["fleet-ci"] != "-" {
		t.Errorf("token list: want a PROJECT column with team-a for team-ci and - for fleet-ci:\n%s", list)
	}

	addr := make(chan string, 1)
	done := make(chan error, 1)
	go func() {
		done <- serveControl(ctx, controlConfig{Listen: "127.0.0.1:0", DataDir: dataDir, Token: "bootstrap-token",
			AgentToken: "agent-token", SyncInterval: time.Hour}, newLogger(&controlLogSink{}, "error"), func(a string) { addr <- a })
	}()
	var base string
	select {
	case a := <-addr:
		base = "http://" + a
	case err := <-done:
		t.Fatalf("kvmd control: %v", err)
	}
	for path, want := range map[string]int{"/v1/projects/team-a": 200, "/v1/projects/default": 404} {
		if got := bearerStatus(t, ctx, "GET", base+path, secret); got != want {
			t.Errorf("GET %s with team-a's token: %d; want %d", path, got, want)
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("kvmd control: %v", err)
	}
}
