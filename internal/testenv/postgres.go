// Package testenv starts what tests need in process: a PostgreSQL database
// per test, the control API, host agents and the guest image.
package testenv

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// PostgresURLEnv names the server that PostgreSQL tests use (CI sets it).
const PostgresURLEnv = "KVM_TEST_DATABASE_URL"

// PostgresURL returns the URL of a fresh, empty database for this test,
// dropped at cleanup. The server is KVM_TEST_DATABASE_URL or, when that is
// unset, a throwaway server started once per test binary from the system's
// initdb and postgres. It fails the test (never skips) when neither works.
func PostgresURL(t testing.TB) string {
	t.Helper()
	admin := os.Getenv(PostgresURLEnv)
	if admin == "" {
		var err error
		admin, err = throwawayPostgres()
		if err != nil {
			t.Fatalf("PostgreSQL tests need %s or the PostgreSQL server binaries (initdb, postgres): %v", PostgresURLEnv, err)
		}
	}
	u, err := url.Parse(admin)
	if err != nil {
		t.Fatalf("%s is not a URL: %v", PostgresURLEnv, err)
	}
	name := "kvmtest_" + randomHex(8)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := adminExec(ctx, admin, "CREATE DATABASE "+name); err != nil {
		t.Fatalf("create test database on %s: %v", u.Redacted(), err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := adminExec(ctx, admin, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)"); err != nil {
			t.Errorf("drop test database %s: %v", name, err)
		}
	})
	u.Path = "/" + name
	return u.String()
}

func adminExec(ctx context.Context, dsn, sql string) error {
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close(ctx) }()
	_, err = conn.Exec(ctx, sql)
	return err
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

var throwaway struct {
	once sync.Once
	url  string
	err  error
}

// throwawayPostgres starts one PostgreSQL server for this test binary in a
// temporary directory. It dies with the test binary (parent-death signal).
func throwawayPostgres() (string, error) {
	throwaway.once.Do(func() { throwaway.url, throwaway.err = startThrowawayPostgres() })
	return throwaway.url, throwaway.err
}

func startThrowawayPostgres() (string, error) {
	bin, err := postgresBinDir()
	if err != nil {
		return "", err
	}
	removeStaleServers()
	dir, err := os.MkdirTemp("", "kvmd-test-pg-")
	if err != nil {
		return "", err
	}
	// PostgreSQL refuses to run as root: run it as the postgres user then.
	var cred *syscall.Credential
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			return "", fmt.Errorf("running as root and there is no postgres user to run the server as: %w", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
		if err := os.Chown(dir, uid, gid); err != nil {
			return "", err
		}
	}
	data := filepath.Join(dir, "data")
	initdb := exec.Command(filepath.Join(bin, "initdb"), "-D", data, "-U", "postgres", "--auth=trust", "--no-sync")
	initdb.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	if out, err := initdb.CombinedOutput(); err != nil {
		return "", fmt.Errorf("initdb: %v: %s", err, out)
	}
	port, err := freePort()
	if err != nil {
		return "", err
	}
	srv := exec.Command(filepath.Join(bin, "postgres"), "-D", data, "-p", strconv.Itoa(port), "-k", dir,
		"-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "max_connections=200")
	srv.SysProcAttr = &syscall.SysProcAttr{Credential: cred, Pdeathsig: syscall.SIGTERM}
	logFile, err := os.Create(filepath.Join(dir, "postgres.log"))
	if err != nil {
		return "", err
	}
	srv.Stdout, srv.Stderr = logFile, logFile
	if err := srv.Start(); err != nil {
		return "", fmt.Errorf("start postgres: %w", err)
	}
	go func() { _ = srv.Wait() }()
	dsn := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", port)
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		err := adminExec(ctx, dsn, "SELECT 1")
		cancel()
		if err == nil {
			fmt.Fprintf(os.Stderr, "testenv: %s is unset; started a throwaway PostgreSQL on port %d in %s\n", PostgresURLEnv, port, dir)
			return dsn, nil
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(filepath.Join(dir, "postgres.log"))
			return "", fmt.Errorf("throwaway postgres did not answer: %v; log: %s", err, log)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// removeStaleServers deletes the directories of throwaway servers that
// have shut down (a running server keeps its postmaster.pid).
func removeStaleServers() {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), "kvmd-test-pg-*"))
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "data", "postmaster.pid")); errors.Is(err, os.ErrNotExist) {
			_ = os.RemoveAll(d)
		}
	}
}

func postgresBinDir() (string, error) {
	if p, err := exec.LookPath("initdb"); err == nil {
		return filepath.Dir(p), nil
	}
	matches, _ := filepath.Glob("/usr/lib/postgresql/*/bin/initdb")
	if len(matches) == 0 {
		return "", errors.New("initdb not found on PATH or in /usr/lib/postgresql/*/bin")
	}
	return filepath.Dir(matches[len(matches)-1]), nil
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer func() { _ = l.Close() }()
	return l.Addr().(*net.TCPAddr).Port, nil
}
