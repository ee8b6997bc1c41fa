package sim

// A simulated migration: the memory channel carries a few lines that stand
// for the VM's memory ("sim-page" lines, each named a simulation), sent in
// steps over MigrationTime while the simulated VM runs (pre-copy, phase
// memory), then an end line while it is paused (stop-and-copy); the target
// answers "ok" once it has all of it, as QEMU's return path does. The
// target acknowledges each page ("sim-ack"): a link that stalls holds the
// source in its phase, as a real stream's backpressure holds QEMU (a line
// would otherwise sit in socket buffers and the source run ahead). No guest
// state moves: a sim VM has none.
//
// Its read-write volumes do move, before the memory: one disk channel per
// volume carries the data blocks of the source's volume file into the
// target's (its copy, which the control plane made), so that what a test
// wrote into a volume on the source reads back on the target.

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

var _ agent.Migrator = (*Driver)(nil)

// MigrationFiles: a sim VM has no files of its own.
func (d *Driver) MigrationFiles(*agent.Machine, bool) ([]string, error) { return nil, nil }

// AdoptIncomingFiles has nothing to check: a sim VM has no disk file.
func (d *Driver) AdoptIncomingFiles(context.Context, *agent.Machine, []string) error { return nil }

// PrepareIncoming marks the VM paused, waiting for its simulated stream,
// with new simulated host ports for its forwards.
func (d *Driver) PrepareIncoming(_ context.Context, m *agent.Machine) error {
	for i := range m.NICs {
		for j := range m.NICs[i].PortForwards {
			m.NICs[i].PortForwards[j].HostPort = 0 // the source's ports are the source host's
		}
	}
	if err := d.assignPorts(m); err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.state[m.ID] = agentapi.StatePaused
	d.incoming[m.ID] = agent.IncomingActive
	d.plugged[m.ID] = map[string]bool{}
	for _, v := range m.Volumes {
		d.plugged[m.ID][v.ID] = true
	}
	return nil
}

// Receive reads the simulated memory stream.
func (d *Driver) Receive(_ context.Context, m *agent.Machine, channel string, conn net.Conn) error {
	if channel == agentapi.ChannelDisk {
		return receiveVolume(m, conn)
	}
	if channel != agentapi.ChannelMemory {
		return fmt.Errorf("sim vm %s: the simulation has no %s channel", m.ID, channel)
	}
	fail := func(err error) error {
		d.mu.Lock()
		if d.incoming[m.ID] == agent.IncomingActive {
			d.incoming[m.ID] = agent.IncomingFailed + ": " + err.Error()
		}
		d.mu.Unlock()
		return err
	}
	br := bufio.NewReader(conn)
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			return fail(fmt.Errorf("simulated stream of vm %s ended early: %w", m.ID, err))
		}
		line = strings.TrimSpace(line)
		switch {
		case strings.HasPrefix(line, "sim-migration "):
		case strings.HasPrefix(line, "sim-page "):
			if _, err := fmt.Fprintf(conn, "sim-ack %s\n", strings.TrimPrefix(line, "sim-page ")); err != nil {
				return fail(fmt.Errorf("simulated stream of vm %s: acknowledge %q: %w", m.ID, line, err))
			}
		case line == "sim-end":
			d.mu.Lock()
			d.incoming[m.ID] = agent.IncomingCompleted
			d.booted[m.ID] = time.Time{}
			d.mu.Unlock()
			_, err := conn.Write([]byte("ok\n"))
			return err
		default:
			return fail(fmt.Errorf("simulated stream of vm %s: unexpected %q", m.ID, line))
		}
	}
}

// IncomingState is the simulated stream's state.
func (d *Driver) IncomingState(_ context.Context, m *agent.Machine) (string, string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	st, ok := d.incoming[m.ID]
	if !ok {
		return agent.IncomingFailed, "the simulated vmm is gone"
	}
	if reason, failed := strings.CutPrefix(st, agent.IncomingFailed+": "); failed {
		return agent.IncomingFailed, reason
	}
	return st, ""
}

// MigrateOut sends the simulated stream: pre-copy steps while the VM runs,
// then the end while it is paused, and waits for the target's answer. A
// cancel or a failure leaves the VM running.
func (d *Driver) MigrateOut(ctx context.Context, m *agent.Machine, out agent.MigrateOut) (agentapi.Migration, error) {
	start := time.Now()
	d.mu.Lock()
	was := d.state[m.ID]
	d.outgoing[m.ID] = agent.OutgoingActive
	d.mu.Unlock()
	if was != agentapi.StateRunning && was != agentapi.StatePaused {
		return agentapi.Migration{}, fmt.Errorf("sim vm %s is not running", m.ID)
	}
	stats := agentapi.Migration{Phase: agentapi.PhaseMemory}
	total := m.MemoryMiB << 20
	fail := func(err error) (agentapi.Migration, error) {
		d.mu.Lock()
		d.outgoing[m.ID] = agent.OutgoingFailed
		if _, ok := d.state[m.ID]; ok {
			d.state[m.ID] = was
		}
		d.mu.Unlock()
		stats.TotalMS = time.Since(start).Milliseconds()
		return stats, err
	}
	for _, v := range m.Volumes {
		if v.ReadOnly {
			continue
		}
		n, err := sendVolume(ctx, out.Dial, v)
		if err != nil {
			return fail(fmt.Errorf("copy volume %s of sim vm %s: %w", v.ID, m.ID, err))
		}
		stats.Disk.Total += n
		stats.Disk.Transferred += n
	}
	conn, err := out.Dial(ctx, agentapi.ChannelMemory)
	if err != nil {
		return fail(err)
	}
	defer func() { _ = conn.Close() }()
	stop := context.AfterFunc(ctx, func() { _ = conn.Close() })
	defer stop()
	acks := bufio.NewReader(conn)
	stats.SetupMS = time.Since(start).Milliseconds()
	steps := max(d.opts.MigrationSteps, 1)
	if d.opts.MigrationSteps == 0 {
		steps = 10
	}
	dur := d.opts.MigrationTime
	if dur == 0 {
		dur = 100 * time.Millisecond
	}
	if _, err := fmt.Fprintf(conn, "sim-migration vm %s %d MiB (simulated: no guest memory moves)\n", m.ID, m.MemoryMiB); err != nil {
		return fail(err)
	}
	for i := 1; i <= steps; i++ {
		select {
		case <-ctx.Done():
			return fail(fmt.Errorf("migration of sim vm %s: %w", m.ID, ctx.Err()))
		case <-time.After(dur / time.Duration(steps)):
		}
		if _, err := fmt.Fprintf(conn, "sim-page %d/%d\n", i, steps); err != nil {
			return fail(err)
		}
		if ack, err := acks.ReadString('\n'); err != nil || ack != fmt.Sprintf("sim-ack %d/%d\n", i, steps) {
			return fail(fmt.Errorf("migration of sim vm %s: the target did not acknowledge page %d/%d (%q, %v)", m.ID, i, steps, ack, err))
		}
		done := total * int64(i) / int64(steps)
		stats.Memory = agentapi.MigrationBytes{Total: total, Transferred: done, Remaining: total - done}
		stats.TotalMS = time.Since(start).Milliseconds()
		if out.Progress != nil {
			out.Progress(stats)
		}
	}
	paused := time.Now()
	d.mu.Lock()
	if _, ok := d.state[m.ID]; ok {
		d.state[m.ID] = agentapi.StatePaused
	}
	d.mu.Unlock()
	stats.Phase = agentapi.PhaseStopAndCopy
	if out.Progress != nil {
		out.Progress(stats)
	}
	if _, err := conn.Write([]byte("sim-end\n")); err != nil {
		return fail(err)
	}
	answer, err := acks.ReadString('\n')
	if err != nil || answer != "ok\n" {
		return fail(fmt.Errorf("migration of sim vm %s: the target did not confirm the stream (%q, %v)", m.ID, answer, err))
	}
	d.mu.Lock()
	d.outgoing[m.ID] = agent.OutgoingCompleted
	d.mu.Unlock()
	stats.DowntimeMS = max(time.Since(paused).Milliseconds(), 1)
	stats.TotalMS = time.Since(start).Milliseconds()
	return stats, nil
}

// OutgoingState is the simulated stream's state as the source saw it.
func (d *Driver) OutgoingState(_ context.Context, m *agent.Machine) (string, agentapi.Migration) {
	d.mu.Lock()
	defer d.mu.Unlock()
	st, ok := d.outgoing[m.ID]
	if !ok {
		return agent.OutgoingNone, agentapi.Migration{}
	}
	return st, agentapi.Migration{}
}

// ResumeOutgoing runs the VM again after a completed stream its target
// did not take.
func (d *Driver) ResumeOutgoing(_ context.Context, m *agent.Machine) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.state[m.ID]; !ok {
		return fmt.Errorf("sim vm %s is not there to resume", m.ID)
	}
	d.state[m.ID] = agentapi.StateRunning
	d.outgoing[m.ID] = agent.OutgoingFailed
	return nil
}

// simVolumeBlock is the unit of a simulated volume copy; blocks of zeros
// are not sent (the target's file is sparse and empty).
const simVolumeBlock = 1 << 20

// sendVolume copies volume v's file over a disk channel: a header line,
// then "sim-block <offset> <length>" lines each followed by the bytes,
// then an end line; the target answers "ok". It returns the bytes sent.
func sendVolume(ctx context.Context, dial func(context.Context, string) (net.Conn, error), v agent.MachineVolume) (int64, error) {
	f, err := os.Open(v.Path)
	if err != nil {
		return 0, err
	}
	defer func() { _ = f.Close() }()
	conn, err := dial(ctx, agentapi.ChannelDisk)
	if err != nil {
		return 0, err
	}
	defer func() { _ = conn.Close() }()
	stop := context.AfterFunc(ctx, func() { _ = conn.Close() })
	defer stop()
	w := bufio.NewWriter(conn)
	if _, err := fmt.Fprintf(w, "sim-volume %s\n", v.ID); err != nil {
		return 0, err
	}
	buf := make([]byte, simVolumeBlock)
	var off, sent int64
	for {
		k, err := io.ReadFull(f, buf)
		if k > 0 && !allZero(buf[:k]) {
			if _, err := fmt.Fprintf(w, "sim-block %d %d\n", off, k); err != nil {
				return sent, err
			}
			if _, err := w.Write(buf[:k]); err != nil {
				return sent, err
			}
			sent += int64(k)
		}
		off += int64(k)
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			break
		}
		if err != nil {
			return sent, err
		}
	}
	if _, err := w.WriteString("sim-volume-end\n"); err != nil {
		return sent, err
	}
	if err := w.Flush(); err != nil {
		return sent, err
	}
	answer, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil || answer != "ok\n" {
		return sent, fmt.Errorf("the target did not take the volume (%q, %v)", answer, err)
	}
	return sent, nil
}

// receiveVolume writes a volume sent by sendVolume into the target's copy
// (one of m's volumes) and answers "ok".
func receiveVolume(m *agent.Machine, conn net.Conn) error {
	br := bufio.NewReader(conn)
	line, err := br.ReadString('\n')
	if err != nil {
		return fmt.Errorf("sim vm %s: volume stream ended early: %w", m.ID, err)
	}
	id, ok := strings.CutPrefix(strings.TrimSpace(line), "sim-volume ")
	i := slices.IndexFunc(m.Volumes, func(v agent.MachineVolume) bool { return v.ID == id && !v.ReadOnly })
	if !ok || i < 0 {
		return fmt.Errorf("sim vm %s: no read-write volume %q to receive", m.ID, strings.TrimSpace(line))
	}
	f, err := os.OpenFile(m.Volumes[i].Path, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer func() { _ = f.Close() }()
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			return fmt.Errorf("sim vm %s: volume %s stream ended early: %w", m.ID, id, err)
		}
		line = strings.TrimSpace(line)
		if line == "sim-volume-end" {
			break
		}
		var off, n int64
		if _, err := fmt.Sscanf(line, "sim-block %d %d", &off, &n); err != nil || n <= 0 || n > simVolumeBlock {
			return fmt.Errorf("sim vm %s: volume %s: unexpected %q", m.ID, id, line)
		}
		if _, err := io.Copy(io.NewOffsetWriter(f, off), io.LimitReader(br, n)); err != nil {
			return err
		}
	}
	if err := f.Sync(); err != nil {
		return err
	}
	_, err = conn.Write([]byte("ok\n"))
	return err
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}
