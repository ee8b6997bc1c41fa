package cmd

import (
	"bytes"
	"context"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// --sqlite-sync sets what the database runs with (read back from SQLite's
// PRAGMA synchronous, logged at start-up): full by default, so that an
// acknowledged create survives a power loss; normal on request; anything
// else is refused.
func TestControlSQLiteSync(t *testing.T) {
	for _, tc := range []struct {
		flags []string
		want  string
	}{{nil, "full"}, {[]string{"--sqlite-sync", "full"}, "full"}, {[]string{"--sqlite-sync", "normal"}, "normal"}} {
		t.Run(tc.want+strings.Join(tc.flags, "_"), func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			args := append([]string{"--listen", "127.0.0.1:0", "--token", "t1", "--agent-token", "t2",
				"--data-dir", filepath.Join(t.TempDir(), "data")}, tc.flags...)
			var logs controlLogSink
			done := make(chan error, 1)
			go func() { done <- runControl(ctx, args, func(string) string { return "" }, &logs) }()
			got := ""
			for deadline := time.Now().Add(30 * time.Second); got == "" && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
				for line := range strings.Lines(logs.String()) {
					var rec struct {
						Msg  string `json:"msg"`
						Sync string `json:"sqlite_sync"`
					}
					if json.Unmarshal([]byte(line), &rec) == nil && rec.Msg == "control API listening" {
						got = rec.Sync
					}
				}
			}
			cancel()
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			if got != tc.want {
				t.Errorf("SQLite runs with synchronous %q, want %q; logs:\n%s", got, tc.want, logs.String())
			}
		})
	}
	err := runControl(context.Background(), []string{"--listen", "127.0.0.1:0", "--token", "t1", "--agent-token", "t2",
		"--data-dir", t.TempDir(), "--sqlite-sync", "sometimes"}, func(string) string { return "" }, &bytes.Buffer{})
	if err == nil || !strings.Contains(err.Error(), "--sqlite-sync") {
		t.Errorf("--sqlite-sync sometimes: %v, want an error naming the flag", err)
	}
}
