package qemu

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// qgaPeer is a scripted guest agent on a unix socket: each accepted
// connection is handed to script, which reads the client's requests and
// writes what a guest agent (or a broken one) would.
type qgaPeer struct {
	path string
}

type qgaRequest struct {
	Execute   string         `json:"execute"`
	Arguments map[string]any `json:"arguments"`
	// Sentinel says a 0xFF byte came before the request.
	Sentinel bool `json:"-"`
}

func startQGAPeer(t *testing.T, script func(t *testing.T, r *bufio.Reader, c net.Conn)) *qgaPeer {
	t.Helper()
	path := filepath.Join(t.TempDir(), qgaFileName)
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() { _ = l.Close(); <-done })
	go func() {
		defer close(done)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			script(t, bufio.NewReader(c), c)
			_ = c.Close()
		}
	}()
	return &qgaPeer{path: path}
}

// readRequest reads one request as qemu-ga's JSON lexer takes it: a 0xFF
// byte before it flushes the lexer, then one JSON object (the client's
// requests hold no braces inside strings).
func readRequest(r *bufio.Reader) (qgaRequest, error) {
	var req qgaRequest
	var obj []byte
	depth := 0
	for {
		b, err := r.ReadByte()
		if err != nil {
			return req, err
		}
		switch {
		case b == qgaSentinel && depth == 0:
			req.Sentinel = true
			continue
		case b == '{':
			depth++
		case b == '}':
			depth--
		}
		if depth > 0 || b == '}' {
			obj = append(obj, b)
		}
		if depth == 0 && b == '}' {
			return req, json.Unmarshal(obj, &req)
		}
	}
}

// syncID is the id of a guest-sync-delimited request.
func syncID(t *testing.T, req qgaRequest) int64 {
	t.Helper()
	if req.Execute != "guest-sync-delimited" {
		t.Errorf("first request %q, want guest-sync-delimited", req.Execute)
		return -1
	}
	if !req.Sentinel {
		t.Errorf("guest-sync-delimited came without a 0xFF before it: the guest agent would not flush a half-read request")
	}
	id, ok := req.Arguments["id"].(float64)
	if !ok {
		t.Errorf("guest-sync-delimited arguments %v: no numeric id", req.Arguments)
		return -1
	}
	return int64(id)
}

func writeLine(c net.Conn, s string) { _, _ = c.Write([]byte(s + "\n")) }

func TestQGASyncSkipsStaleRepliesAndRunsCommands(t *testing.T) {
	t.Parallel()
	p := startQGAPeer(t, func(t *testing.T, r *bufio.Reader, c net.Conn) {
		req, err := readRequest(r)
		if err != nil {
			t.Error(err)
			return
		}
		id := syncID(t, req)
		// A stale reply of an earlier client, half a line, then a stale
		// sync answer: all before the sentinel, or with another id.
		writeLine(c, `{"return": {"name": "eth0"}}`)
		_, _ = c.Write([]byte(`{"return": [{"na`))
		_, _ = c.Write([]byte{qgaSentinel})
		writeLine(c, `{"return": 12345}`)
		_, _ = c.Write([]byte{qgaSentinel})
		writeLine(c, fmt.Sprintf(`{"return": %d}`, id))
		if req, err = readRequest(r); err != nil {
			t.Error(err)
			return
		}
		if req.Execute != "guest-network-get-interfaces" {
			t.Errorf("second request %q, want guest-network-get-interfaces", req.Execute)
		}
		writeLine(c, `{"return": [{"name": "lo", "hardware-address": "00:00:00:00:00:00", "ip-addresses": [{"ip-address-type": "ipv4", "ip-address": "127.0.0.1", "prefix": 8}]},`+
			`{"name": "eth0", "hardware-address": "52:54:00:AB:CD:EF", "ip-addresses": [{"ip-address-type": "ipv4", "ip-address": "10.9.0.7", "prefix": 24}, {"ip-address-type": "ipv6", "ip-address": "fe80::1", "prefix": 64}]}]}`)
		if req, err = readRequest(r); err != nil {
			t.Error(err)
			return
		}
		if req.Execute != "guest-fsfreeze-freeze" {
			t.Errorf("third request %q, want guest-fsfreeze-freeze", req.Execute)
		}
		writeLine(c, `{"error": {"class": "GenericError", "desc": "failed to freeze /: Operation not supported"}}`)
	})
	ctx := context.Background()
	g, err := dialGuestAgent(ctx, p.path, 2*time.Second, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = g.Close() }()
	got, err := g.ipv4ByMAC(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"10.9.0.7"}; len(got) != 1 || !slices.Equal(got["52:54:00:ab:cd:ef"], want) {
		t.Fatalf("ipv4ByMAC = %v; want only 52:54:00:ab:cd:ef: %v", got, want)
	}
	_, err = g.fsfreeze(ctx)
	if err == nil || !strings.Contains(err.Error(), "Operation not supported") || !strings.Contains(err.Error(), "guest-fsfreeze-freeze") {
		t.Fatalf("fsfreeze error %v; want the guest agent's error, naming the command", err)
	}
}

func TestQGASyncFailsWhenOnlyOtherIDsAnswer(t *testing.T) {
	t.Parallel()
	p := startQGAPeer(t, func(t *testing.T, r *bufio.Reader, c net.Conn) {
		req, err := readRequest(r)
		if err != nil {
			return
		}
		id := syncID(t, req)
		for i := range 3 {
			_, _ = c.Write([]byte{qgaSentinel})
			writeLine(c, fmt.Sprintf(`{"return": %d}`, id+int64(i)+1))
		}
		time.Sleep(time.Second) // then nothing until the client gives up
	})
	_, err := dialGuestAgent(context.Background(), p.path, 300*time.Millisecond, time.Second)
	if !errors.Is(err, errQGANoAnswer) {
		t.Fatalf("sync against other ids: %v; want errQGANoAnswer", err)
	}
	if !strings.Contains(err.Error(), "other sync ids") {
		t.Fatalf("sync error %q does not say that other ids answered", err)
	}
}

func TestQGATimeouts(t *testing.T) {
	t.Parallel()
	t.Run("no guest agent", func(t *testing.T) {
		t.Parallel()
		// QEMU's side of a port nobody opened in the guest: the bytes go
		// nowhere and nothing answers.
		p := startQGAPeer(t, func(t *testing.T, r *bufio.Reader, c net.Conn) {
			_, _ = readRequest(r)
			time.Sleep(time.Second)
		})
		_, err := dialGuestAgent(context.Background(), p.path, 200*time.Millisecond, time.Second)
		if !errors.Is(err, errQGANoAnswer) {
			t.Fatalf("dial with a silent peer: %v; want errQGANoAnswer", err)
		}
	})
	t.Run("command times out, next one syncs again", func(t *testing.T) {
		t.Parallel()
		syncs := make(chan int, 4)
		p := startQGAPeer(t, func(t *testing.T, r *bufio.Reader, c net.Conn) {
			n := 0
			for {
				req, err := readRequest(r)
				if err != nil {
					return
				}
				switch req.Execute {
				case "guest-sync-delimited":
					n++
					syncs <- n
					_, _ = c.Write([]byte{qgaSentinel})
					writeLine(c, fmt.Sprintf(`{"return": %d}`, syncID(t, req)))
				case "guest-fsfreeze-thaw":
					if n == 1 {
						continue // the first never answers
					}
					writeLine(c, `{"return": 2}`)
				}
			}
		})
		ctx := context.Background()
		g, err := dialGuestAgent(ctx, p.path, time.Second, 200*time.Millisecond)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = g.Close() }()
		if _, err := g.fsthaw(ctx); err == nil {
			t.Fatal("fsthaw answered by nobody: no error")
		}
		n, err := g.fsthaw(ctx)
		if err != nil || n != 2 {
			t.Fatalf("fsthaw after a timeout = %d, %v; want 2 after a new sync", n, err)
		}
		if got := len(syncs); got != 2 {
			t.Fatalf("%d syncs; want 2 (one at the start, one after the timeout)", got)
		}
	})
	t.Run("canceled context", func(t *testing.T) {
		t.Parallel()
		p := startQGAPeer(t, func(t *testing.T, r *bufio.Reader, c net.Conn) {
			_, _ = readRequest(r)
			time.Sleep(2 * time.Second)
		})
		ctx, cancel := context.WithCancel(context.Background())
		time.AfterFunc(100*time.Millisecond, cancel)
		_, err := dialGuestAgent(ctx, p.path, 5*time.Second, 5*time.Second)
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("dial canceled: %v; want context.Canceled", err)
		}
	})
}

func TestQGAShutdown(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name, answer string
		wantErr      string
	}{
		{"taken: no answer", "", ""},
		{"refused", `{"error": {"class": "GenericError", "desc": "guest-shutdown has been disabled"}}`, "has been disabled"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			got := make(chan map[string]any, 1)
			p := startQGAPeer(t, func(t *testing.T, r *bufio.Reader, conn net.Conn) {
				req, err := readRequest(r)
				if err != nil {
					return
				}
				_, _ = conn.Write([]byte{qgaSentinel})
				writeLine(conn, fmt.Sprintf(`{"return": %d}`, syncID(t, req)))
				if req, err = readRequest(r); err != nil {
					return
				}
				if req.Execute == "guest-shutdown" {
					got <- req.Arguments
				}
				if c.answer != "" {
					writeLine(conn, c.answer)
				}
				time.Sleep(1500 * time.Millisecond)
			})
			ctx := context.Background()
			g, err := dialGuestAgent(ctx, p.path, time.Second, time.Second)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = g.Close() }()
			err = g.shutdown(ctx)
			switch {
			case c.wantErr == "" && err != nil:
				t.Fatalf("shutdown: %v; want nil (guest-shutdown answers nothing on success)", err)
			case c.wantErr != "" && (err == nil || !strings.Contains(err.Error(), c.wantErr)):
				t.Fatalf("shutdown: %v; want an error with %q", err, c.wantErr)
			}
			select {
			case args := <-got:
				if args["mode"] != "powerdown" {
					t.Fatalf("guest-shutdown arguments %v; want mode powerdown", args)
				}
			default:
				t.Fatal("the peer saw no guest-shutdown")
			}
		})
	}
}
