package qemu

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
)

// fakeQMP serves QMP on a unix socket like QEMU does: one client at a time,
// a greeting, then an answer per command, as script says (the messages to
// send, events included). served counts the sessions it has served.
type fakeQMP struct {
	dir    string
	served atomic.Int64
}

func startFakeQMP(t *testing.T, script func(cmd string) []string) *fakeQMP {
	t.Helper()
	f := &fakeQMP{dir: t.TempDir()}
	ln, err := net.Listen("unix", filepath.Join(f.dir, qmpFileName))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			f.served.Add(1)
			serveQMP(conn, script) // one at a time, as QEMU
		}
	}()
	return f
}

func serveQMP(conn net.Conn, script func(cmd string) []string) {
	defer func() { _ = conn.Close() }()
	if _, err := conn.Write([]byte(`{"QMP": {"version": {}, "capabilities": []}}` + "\r\n")); err != nil {
		return
	}
	dec := json.NewDecoder(conn)
	for {
		var req struct {
			Execute string `json:"execute"`
		}
		if err := dec.Decode(&req); err != nil {
			return
		}
		msgs := []string{`{"return": {}}`}
		if req.Execute != "qmp_capabilities" {
			msgs = script(req.Execute)
		}
		for _, m := range msgs {
			if _, err := conn.Write([]byte(m + "\r\n")); err != nil {
				return
			}
		}
	}
}

func (f *fakeQMP) machine() *agent.Machine { return &agent.Machine{ID: "vm1", Dir: f.dir} }

func TestMonitorRunsCommandsAndKeepsEventsForALaterWait(t *testing.T) {
	f := startFakeQMP(t, func(cmd string) []string {
		switch cmd {
		case "query-status":
			return []string{`{"event": "RTC_CHANGE", "data": {"offset": 1}}`, `{"return": {"running": true, "status": "running"}}`}
		case "migrate":
			// QEMU may announce states before it answers the command.
			return []string{`{"event": "MIGRATION", "data": {"status": "setup"}}`, `{"return": {}}`,
				`{"event": "MIGRATION", "data": {"status": "active"}}`, `{"event": "MIGRATION", "data": {"status": "completed"}}`}
		}
		return []string{`{"error": {"class": "CommandNotFound", "desc": "The command ` + cmd + ` has not been found"}}`}
	})
	d := &Driver{}
	ctx := context.Background()
	q, err := d.monitor(ctx, f.machine())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = q.Close() }()
	st, err := q.queryStatus(ctx)
	if err != nil || !st.Running || st.Status != "running" {
		t.Fatalf("query-status = %+v, %v", st, err)
	}
	err = q.run(ctx, "no-such-command", nil, nil)
	var qe *qmpError
	if !errors.As(err, &qe) || qe.Class != "CommandNotFound" {
		t.Fatalf("unknown command: %v, want QEMU's CommandNotFound", err)
	}
	if err := q.migrate(ctx, "exec:cat > /dev/null"); err != nil {
		t.Fatal(err)
	}
	status, err := q.waitMigration(ctx, 5*time.Second)
	if err != nil || status != "completed" {
		t.Fatalf("waitMigration = %q, %v; want completed", status, err)
	}
	if n := f.served.Load(); n != 1 || d.QMPSessions() != 1 {
		t.Fatalf("%d sessions served, %d counted; want one for the whole operation", n, d.QMPSessions())
	}
}

func TestMonitorCutShortByItsContextBreaksAndRescueOpensANewSession(t *testing.T) {
	// Nothing ever answers cont: the wait can only end with its context.
	f := startFakeQMP(t, func(cmd string) []string {
		if cmd == "cont" {
			return nil
		}
		return []string{`{"return": {"running": false, "status": "paused"}}`}
	})
	d := &Driver{}
	m := f.machine()
	q, err := d.monitor(context.Background(), m)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = q.Close() }()
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if err := q.cont(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("cont without an answer = %v, want the context's deadline", err)
	}
	if err := q.run(context.Background(), "query-status", nil, nil); err == nil || !strings.Contains(err.Error(), "broke earlier") {
		t.Fatalf("a command on a broken session = %v, want a refusal", err)
	}
	// QEMU serves one client at a time: rescue must let go of the broken
	// session before it opens another, or the new one never gets its
	// greeting.
	var st qmpStatus
	err = d.rescue(context.Background(), m, q, func(q *monitor) (err error) {
		st, err = q.queryStatus(context.Background())
		return err
	})
	if err != nil || st.Status != "paused" || f.served.Load() != 2 {
		t.Fatalf("rescue = %+v, %v after %d sessions; want paused from a second session", st, err, f.served.Load())
	}
}
