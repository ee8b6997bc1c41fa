package qemu

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"time"
)

// qmpTimeout bounds one QMP exchange (connect, negotiate, one command).
const qmpTimeout = 5 * time.Second

// qmpConn is one QMP session on a VM's monitor socket. QEMU serves one
// client at a time on it; the agent never runs two operations of one VM at
// once, so a session per call is enough and leaves nothing open.
type qmpConn struct {
	conn net.Conn
	dec  *json.Decoder
}

type qmpMessage struct {
	Event  string          `json:"event"`
	Return json.RawMessage `json:"return"`
	Error  *struct {
		Class string `json:"class"`
		Desc  string `json:"desc"`
	} `json:"error"`
	QMP json.RawMessage `json:"QMP"`
}

// dialUnix connects to a unix socket whose path may be longer than the
// 108 bytes a sockaddr holds: it then goes through /proc/self/fd/N/<name>
// of the opened directory, which is short.
func dialUnix(ctx context.Context, path string) (net.Conn, error) {
	var d net.Dialer
	if len(path) < 100 {
		return d.DialContext(ctx, "unix", path)
	}
	dir, err := os.Open(filepath.Dir(path))
	if err != nil {
		return nil, err
	}
	defer func() { _ = dir.Close() }()
	return d.DialContext(ctx, "unix", fmt.Sprintf("/proc/self/fd/%d/%s", dir.Fd(), filepath.Base(path)))
}

func dialQMP(ctx context.Context, path string) (*qmpConn, error) {
	ctx, cancel := context.WithTimeout(ctx, qmpTimeout)
	defer cancel()
	conn, err := dialUnix(ctx, path)
	if err != nil {
		return nil, fmt.Errorf("connect to qmp socket %s: %w", path, err)
	}
	deadline, _ := ctx.Deadline()
	_ = conn.SetDeadline(deadline)
	q := &qmpConn{conn: conn, dec: json.NewDecoder(conn)}
	var greeting qmpMessage
	if err := q.dec.Decode(&greeting); err != nil || greeting.QMP == nil {
		_ = conn.Close()
		return nil, fmt.Errorf("qmp greeting on %s: %v", path, errors.Join(err, errors.New("no QMP greeting")))
	}
	if err := q.execute("qmp_capabilities", nil, nil); err != nil {
		_ = conn.Close()
		return nil, err
	}
	return q, nil
}

func (q *qmpConn) Close() error { return q.conn.Close() }

// execute runs one command and decodes its return value into out.
// Asynchronous events that arrive in between are skipped.
func (q *qmpConn) execute(cmd string, args, out any) error {
	req := map[string]any{"execute": cmd}
	if args != nil {
		req["arguments"] = args
	}
	b, err := json.Marshal(req)
	if err != nil {
		return err
	}
	if _, err := q.conn.Write(b); err != nil {
		return fmt.Errorf("qmp %s: %w", cmd, err)
	}
	for {
		var m qmpMessage
		if err := q.dec.Decode(&m); err != nil {
			return fmt.Errorf("qmp %s: read answer: %w", cmd, err)
		}
		switch {
		case m.Event != "":
			continue
		case m.Error != nil:
			return fmt.Errorf("qmp %s: %s: %s", cmd, m.Error.Class, m.Error.Desc)
		case m.Return != nil:
			if out != nil {
				return json.Unmarshal(m.Return, out)
			}
			return nil
		}
	}
}

// qmp runs one command in a session of its own.
func qmp(ctx context.Context, path, cmd string, args, out any) error {
	q, err := dialQMP(ctx, path)
	if err != nil {
		return err
	}
	defer func() { _ = q.Close() }()
	return q.execute(cmd, args, out)
}

// qmpStatus is the answer of query-status.
type qmpStatus struct {
	Running bool   `json:"running"`
	Status  string `json:"status"`
}
