package testenv

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"
)

// PostgresServer is a PostgreSQL server of one test, which the test may
// stop, start and restart (fault injection). It never touches the
// machine's shared server: it has its own data directory and port.
type PostgresServer struct {
	URL string // postgres://postgres@127.0.0.1:port/postgres?sslmode=disable

	bin, dir, data string
	port           int
	cred           *syscall.Credential
}

// StartPostgresServer runs initdb and starts a server in a temporary
// directory on a free port; the server is stopped (immediate mode) and
// its directory removed at cleanup. It fails the test when the PostgreSQL
// server binaries are missing.
func StartPostgresServer(t testing.TB) *PostgresServer {
	t.Helper()
	bin, err := postgresBinDir()
	if err != nil {
		t.Fatalf("PostgreSQL server binaries: %v", err)
	}
	// Not t.TempDir: its parent is private to root, and the server runs as
	// the postgres user when the test runs as root.
	dir, err := os.MkdirTemp("", "kvmd-test-pgserver-")
	if err != nil {
		t.Fatal(err)
	}
	s := &PostgresServer{bin: bin, dir: dir, data: filepath.Join(dir, "data")}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			t.Fatalf("running as root and there is no postgres user to run the server as: %v", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		s.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
		if err := os.Chown(dir, uid, gid); err != nil {
			t.Fatal(err)
		}
	}
	if out, err := s.run("initdb", "-D", s.data, "-U", "postgres", "--auth=trust", "--no-sync"); err != nil {
		t.Fatalf("initdb: %v: %s", err, out)
	}
	if s.port, err = freePort(); err != nil {
		t.Fatal(err)
	}
	s.URL = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", s.port)
	t.Cleanup(func() { _, _ = s.run("pg_ctl", "-D", s.data, "-m", "immediate", "-w", "stop") })
	s.Start(t)
	return s
}

func (s *PostgresServer) run(name string, args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(s.bin, name), args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: s.cred}
	cmd.Dir = s.dir
	return cmd.CombinedOutput()
}

// Start starts the server and waits until it accepts connections.
func (s *PostgresServer) Start(t testing.TB) {
	t.Helper()
	opts := fmt.Sprintf("-p %d -k %s -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200", s.port, s.dir)
	if out, err := s.run("pg_ctl", "-D", s.data, "-l", filepath.Join(s.dir, "postgres.log"), "-o", opts, "-w", "start"); err != nil {
		log, _ := os.ReadFile(filepath.Join(s.dir, "postgres.log"))
		t.Fatalf("pg_ctl start: %v: %s; log: %s", err, out, log)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		err := adminExec(ctx, s.URL, "SELECT 1")
		cancel()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("PostgreSQL on port %d does not answer after start: %v", s.port, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Stop stops the server in fast mode: sessions are cut, as in a failover
// or a restart by an operator.
func (s *PostgresServer) Stop(t testing.TB) {
	t.Helper()
	if out, err := s.run("pg_ctl", "-D", s.data, "-m", "fast", "-w", "stop"); err != nil {
		t.Fatalf("pg_ctl stop: %v: %s", err, out)
	}
}

// Restart is pg_ctl restart -m fast.
func (s *PostgresServer) Restart(t testing.TB) {
	t.Helper()
	s.Stop(t)
	s.Start(t)
}
