package cmd

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// controlLogSink collects the server's logs while the test reads them.
type controlLogSink struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *controlLogSink) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *controlLogSink) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func TestControlServesAndShutsDownGracefully(t *testing.T) {
	dir := t.TempDir()
	tokenFile := filepath.Join(dir, "token")
	if err := os.WriteFile(tokenFile, []byte("file-token\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	env := map[string]string{"KVMD_AGENT_TOKEN": "agent-secret", "KVMD_DATA_DIR": filepath.Join(dir, "data")}
	getenv := func(k string) string { return env[k] }
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var logs controlLogSink
	done := make(chan error, 1)
	go func() {
		done <- runControl(ctx, []string{"--listen", "127.0.0.1:0", "--token-file", tokenFile, "--log-level", "debug"}, getenv, &logs)
	}()
	var addr string
	deadline := time.Now().Add(30 * time.Second)
	for addr == "" {
		for line := range strings.Lines(logs.String()) {
			var rec struct {
				Msg     string `json:"msg"`
				Address string `json:"address"`
			}
			if json.Unmarshal([]byte(line), &rec) == nil && rec.Msg == "control API listening" {
				addr = rec.Address
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("control API did not start; logs:\n%s", logs.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	get := func(path, token string) int {
		req, _ := http.NewRequest("GET", "http://"+addr+path, nil)
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		return resp.StatusCode
	}
	if got := get("/readyz", ""); got != 200 {
		t.Errorf("/readyz = %d", got)
	}
	if got := get("/v1/hosts", "file-token"); got != 200 {
		t.Errorf("token from --token-file: GET /v1/hosts = %d", got)
	}
	if got := get("/v1/hosts", "agent-secret"); got != 401 {
		t.Errorf("wrong token: GET /v1/hosts = %d", got)
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("shutdown: %v", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("control API did not shut down")
	}
	if strings.Contains(logs.String(), "file-token") || strings.Contains(logs.String(), "agent-secret") {
		t.Error("a token appeared in the logs")
	}
	if _, err := os.Stat(filepath.Join(dir, "data", "kvmd.db")); err != nil {
		t.Errorf("SQLite database in --data-dir: %v", err)
	}
}

func TestControlRefusesIncompleteConfiguration(t *testing.T) {
	getenv := func(string) string { return "" }
	err := runControl(context.Background(), []string{"--listen", "127.0.0.1:0"}, getenv, &bytes.Buffer{})
	if err == nil {
		t.Fatal("control started without tokens or a database")
	}
	for _, want := range []string{"no API token", "no agent token", "no database"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q lacks %q", err, want)
		}
	}
}
