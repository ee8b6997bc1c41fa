package qemu

// QMP: a session on a VM's monitor socket that stays open for one operation
// (a snapshot, a child's start, a state check), with named commands
// (qmp_commands.go) and waits on QEMU's events instead of polling, after
// Incus's qmp package (monitor.go, commands.go). Unlike Incus's monitor it
// is not kept for the VM's life: QEMU serves one client at a time on the
// socket, the agent runs one operation of a VM at a time, and nothing stays
// open between them (a restarted agent finds nothing to take over). One
// goroutine uses a session: replies are read in line, and the events read
// while waiting for one are kept for a later wait.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
)

// qmpTimeout bounds connecting, negotiating and one command's answer.
const qmpTimeout = 5 * time.Second

// maxQueuedEvents bounds the events a session keeps for a later wait.
const maxQueuedEvents = 256

// monitor is one QMP session on a VM's monitor socket.
type monitor struct {
	path string
	conn net.Conn
	dec  *json.Decoder
	// events were read while waiting for a reply; a wait looks here first.
	events []qmpEvent
	// broken is set once an exchange failed half way (a deadline, a
	// closed socket): the stream may be out of step, so nothing more is
	// sent on it.
	broken error
}

// qmpEvent is an asynchronous message from QEMU.
type qmpEvent struct {
	Event string          `json:"event"`
	Data  json.RawMessage `json:"data"`
}

type qmpMessage struct {
	Event  string          `json:"event"`
	Data   json.RawMessage `json:"data"`
	Return json.RawMessage `json:"return"`
	Error  *qmpError       `json:"error"`
	QMP    json.RawMessage `json:"QMP"`
}

// qmpError is QEMU's answer to a command that failed.
type qmpError struct {
	Class string `json:"class"`
	Desc  string `json:"desc"`
}

func (e *qmpError) Error() string { return e.Class + ": " + e.Desc }

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

// monitor opens a QMP session on m's monitor socket: connect, greeting,
// capabilities negotiation. The caller closes it.
func (d *Driver) monitor(ctx context.Context, m *agent.Machine) (*monitor, error) {
	d.qmpSessions.Add(1)
	return openMonitor(ctx, qmpPathOf(m))
}

func openMonitor(ctx context.Context, path string) (*monitor, error) {
	dctx, cancel := context.WithTimeout(ctx, qmpTimeout)
	defer cancel()
	conn, err := dialUnix(dctx, path)
	if err != nil {
		return nil, fmt.Errorf("connect to qmp socket %s: %w", path, err)
	}
	q := &monitor{path: path, conn: conn, dec: json.NewDecoder(conn)}
	err = q.exchange(ctx, qmpTimeout, func() error {
		var greeting qmpMessage
		if err := q.dec.Decode(&greeting); err != nil {
			return err
		}
		if greeting.QMP == nil {
			return errors.New("no QMP greeting")
		}
		return nil
	})
	if err == nil {
		err = q.run(ctx, "qmp_capabilities", nil, nil)
	}
	if err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("qmp session on %s: %w", path, err)
	}
	return q, nil
}

func (q *monitor) Close() error { return q.conn.Close() }

// exchange runs io on the connection with a deadline of timeout from now,
// or ctx's when sooner; ctx's end cuts it short. A failure leaves the
// session broken.
func (q *monitor) exchange(ctx context.Context, timeout time.Duration, io func() error) error {
	if q.broken != nil {
		return fmt.Errorf("the qmp session broke earlier: %w", q.broken)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	deadline, ctxDeadline := time.Now().Add(timeout), false
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline, ctxDeadline = d, true
	}
	if err := q.conn.SetDeadline(deadline); err != nil {
		q.broken = err
		return err
	}
	var fired sync.WaitGroup
	fired.Add(1)
	stop := context.AfterFunc(ctx, func() {
		defer fired.Done()
		_ = q.conn.SetDeadline(time.Now())
	})
	err := io()
	if stop() {
		fired.Done()
	}
	// The deadline that ctx's end set must not cut the next exchange.
	fired.Wait()
	if err != nil {
		cerr := ctx.Err()
		if cerr == nil && ctxDeadline && errors.Is(err, os.ErrDeadlineExceeded) {
			cerr = context.DeadlineExceeded // the connection's deadline was ctx's
		}
		if cerr != nil {
			err = fmt.Errorf("%w (%w)", cerr, err)
		}
		q.broken = err
	}
	return err
}

// read decodes the next message from QEMU.
func (q *monitor) read() (qmpMessage, error) {
	var msg qmpMessage
	err := q.dec.Decode(&msg)
	return msg, err
}

// keep queues an event for a later wait, dropping the oldest beyond the bound.
func (q *monitor) keep(msg qmpMessage) {
	if len(q.events) >= maxQueuedEvents {
		q.events = slices.Delete(q.events, 0, 1)
	}
	q.events = append(q.events, qmpEvent{Event: msg.Event, Data: msg.Data})
}

// run executes one command and decodes its return value into out. Events
// that arrive before the answer are kept for waitEvent.
func (q *monitor) run(ctx context.Context, cmd string, args, out any) error {
	return q.runWith(ctx, nil, cmd, args, out)
}

// runWith is run, with the file f passed to QEMU along with the command
// (SCM_RIGHTS on the socket) when f is not nil: what getfd takes.
func (q *monitor) runWith(ctx context.Context, f *os.File, cmd string, args, out any) error {
	req := struct {
		Execute   string `json:"execute"`
		Arguments any    `json:"arguments,omitempty"`
	}{cmd, args}
	b, err := json.Marshal(req)
	if err != nil {
		return err
	}
	var answer qmpMessage
	err = q.exchange(ctx, qmpTimeout, func() error {
		if err := q.write(b, f); err != nil {
			return err
		}
		for {
			msg, err := q.read()
			if err != nil {
				return fmt.Errorf("read answer: %w", err)
			}
			if msg.Event != "" {
				q.keep(msg)
				continue
			}
			answer = msg
			return nil
		}
	})
	switch {
	case err != nil:
		return fmt.Errorf("qmp %s: %w", cmd, err)
	case answer.Error != nil:
		return fmt.Errorf("qmp %s: %w", cmd, answer.Error)
	case out != nil && answer.Return != nil:
		return json.Unmarshal(answer.Return, out)
	}
	return nil
}

// write sends b, with f's descriptor when f is not nil.
func (q *monitor) write(b []byte, f *os.File) error {
	if f == nil {
		_, err := q.conn.Write(b)
		return err
	}
	uc, ok := q.conn.(*net.UnixConn)
	if !ok {
		return fmt.Errorf("qmp socket %s cannot pass a file: %T", q.path, q.conn)
	}
	n, _, err := uc.WriteMsgUnix(b, syscall.UnixRights(int(f.Fd())), nil)
	if err == nil && n < len(b) {
		_, err = uc.Write(b[n:])
	}
	return err
}

// waitEvent returns the first event, kept or new, for which match is true,
// waiting up to timeout (or ctx's end). Events before it that do not match
// are dropped.
func (q *monitor) waitEvent(ctx context.Context, timeout time.Duration, match func(qmpEvent) bool) (qmpEvent, error) {
	for i, e := range q.events {
		if match(e) {
			q.events = slices.Delete(q.events, 0, i+1)
			return e, nil
		}
	}
	q.events = q.events[:0]
	var found qmpEvent
	err := q.exchange(ctx, timeout, func() error {
		for {
			msg, err := q.read()
			if err != nil {
				return err
			}
			if msg.Event == "" {
				continue // an answer nobody waits for
			}
			if e := (qmpEvent{Event: msg.Event, Data: msg.Data}); match(e) {
				found = e
				return nil
			}
		}
	})
	return found, err
}

// withMonitor runs fn in a session of its own on m's monitor socket.
func (d *Driver) withMonitor(ctx context.Context, m *agent.Machine, fn func(*monitor) error) error {
	q, err := d.monitor(ctx, m)
	if err != nil {
		return err
	}
	defer func() { _ = q.Close() }()
	return fn(q)
}

// rescue runs fn, a clean-up after a failure, in q, or in a new session
// when q broke (a deadline or the caller's end cut an exchange short).
// QEMU serves one client at a time, so the broken session is closed first.
func (d *Driver) rescue(ctx context.Context, m *agent.Machine, q *monitor, fn func(*monitor) error) error {
	if q.broken == nil {
		return fn(q)
	}
	_ = q.Close()
	return d.withMonitor(ctx, m, fn)
}

// QMPSessions is how many QMP sessions the driver opened: one per
// operation, so tests can count them.
func (d *Driver) QMPSessions() int64 { return d.qmpSessions.Load() }

// awaitMonitor opens a QMP session on the QEMU just started for m once it
// answers: its socket listens early, its greeting comes once it is set up.
// It gives up when QEMU exits (exited) or start ends. Only the session it
// opens counts in qmpSessions, not the tries before QEMU listens.
func (d *Driver) awaitMonitor(ctx, start context.Context, m *agent.Machine, exited <-chan error) (*monitor, error) {
	for {
		q, err := openMonitor(ctx, qmpPathOf(m))
		if err == nil {
			d.qmpSessions.Add(1)
			return q, nil
		}
		select {
		case werr := <-exited:
			return nil, fmt.Errorf("qemu %d exited: %v", m.Process.PID, werr)
		case <-start.Done():
			return nil, err
		case <-ctx.Done():
			return nil, err
		case <-time.After(10 * time.Millisecond):
		}
	}
}
