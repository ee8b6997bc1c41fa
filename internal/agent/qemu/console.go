package qemu

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
)

// The serial console log of a VM is capped: QEMU appends to console.log
// (O_APPEND) for as long as the guest writes, and a guest may write
// without end. The agent trims each running VM's log that outgrew the cap,
// every trim interval: it keeps the head of the current boot (from the
// agent's boot marker, the cap's first sixteenth, at most 64 KiB: the
// kernel, the seed's lines, cloud-init's start), a line saying how much was
// left out, and the latest output up to the cap. Before a new boot the old
// log is trimmed to half the cap.
//
// The trim rewrites the file in place (QEMU holds it open): it copies the
// kept parts to the file's start and truncates the rest. What QEMU appends
// between the trim's last look at the file's size and the truncation (a
// few microseconds) is lost; GET console waits for the trim. A pipe read
// by the agent would lose everything the guest writes while the agent
// restarts, and QEMU would block on a full pipe: a file that the agent
// trims loses at most those microseconds.
//
// A VM's log can take the cap plus what the guest writes in one interval.
// QEMU's own output (qemu.log) is trimmed alike to qemuLogMax. The agent
// counts both caps, in whole MiB, in each VM's host disk (DiskOverhead).
const (
	DefaultConsoleLogBytes = 1 << 20
	consoleHeadMax         = 64 << 10
	defaultTrimInterval    = time.Second
	consoleTrimmedNote     = "kvm-agent: console log trimmed: "
	qemuLogMax             = 64 << 10
)

var _ agent.DiskOverhead = (*Driver)(nil)

// VMDiskOverheadMiB is the host disk each VM takes beside its disk: its
// console log's cap and QEMU's log's, in whole MiB.
func (d *Driver) VMDiskOverheadMiB() int64 {
	return (d.opts.ConsoleLogBytes + qemuLogMax + 1<<20 - 1) >> 20
}

func consoleHead(limit int64) int64 { return min(consoleHeadMax, limit/16) }

// watchConsole has the trimmer look after the console log of m's running
// QEMU until that process ends.
func (d *Driver) watchConsole(m *agent.Machine) {
	if m.Process.PID <= 0 {
		return
	}
	d.consoleMu.Lock()
	defer d.consoleMu.Unlock()
	d.consoles[m.Process.PID] = consoleWatch{path: filepath.Join(m.Dir, consoleFileName), process: m.Process, pidfile: pidfileOf(m)}
	if !d.trimming {
		d.trimming = true
		go d.trimConsoles()
	}
}

type consoleWatch struct {
	path    string
	process agent.Process
	pidfile string
}

// trimConsoles trims the watched logs every interval; it ends when no
// QEMU is left to watch (watchConsole starts it again).
func (d *Driver) trimConsoles() {
	t := time.NewTicker(d.opts.ConsoleTrimInterval)
	defer t.Stop()
	for range t.C {
		d.consoleMu.Lock()
		for pid, w := range d.consoles {
			if alive, _ := checkProcess(w.process, w.pidfile); !alive {
				delete(d.consoles, pid)
				continue
			}
			if _, err := trimConsole(w.path, d.opts.ConsoleLogBytes); err != nil && !errors.Is(err, fs.ErrNotExist) {
				d.log.Error("trim a vm's console log", "path", w.path, "err", err)
			}
			qemuLog := filepath.Join(filepath.Dir(w.path), qemuLogFileName)
			if _, err := trimConsole(qemuLog, qemuLogMax); err != nil && !errors.Is(err, fs.ErrNotExist) {
				d.log.Error("trim a vm's qemu log", "path", qemuLog, "err", err)
			}
		}
		if len(d.consoles) == 0 {
			d.trimming = false
			d.consoleMu.Unlock()
			return
		}
		d.consoleMu.Unlock()
	}
}

// trimConsole cuts the console log at path down to limit bytes when it is
// larger: the current boot's head, a note, the tail. It says whether it cut.
func trimConsole(path string, limit int64) (bool, error) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return false, err
	}
	defer func() { _ = f.Close() }()
	fi, err := f.Stat()
	if err != nil {
		return false, err
	}
	size := fi.Size()
	if size <= limit {
		return false, nil
	}
	start, err := lastIndexIn(f, size, []byte(agent.ConsoleBootMarker))
	if err != nil {
		return false, err
	}
	start = max(start, 0)
	headEnd := min(start+consoleHead(limit), size)
	// The note's length depends on the figure it holds: sized for the
	// largest, then padded.
	noteLen := int64(len(fmt.Sprintf("\r\n%s%20d bytes left out\r\n", consoleTrimmedNote, 0)))
	tailStart := max(headEnd, size-max(0, limit-(headEnd-start)-noteLen))
	buf := make([]byte, 0, limit+4096)
	head := make([]byte, headEnd-start)
	if _, err := f.ReadAt(head, start); err != nil {
		return false, err
	}
	buf = append(buf, head...)
	buf = append(buf, fmt.Sprintf("\r\n%s%d bytes left out\r\n", consoleTrimmedNote, start+tailStart-headEnd)...)
	tail := make([]byte, size-tailStart)
	if _, err := f.ReadAt(tail, tailStart); err != nil {
		return false, err
	}
	buf = append(buf, tail...)
	// What QEMU appended while the parts were read goes along.
	for range 3 {
		fi, err := f.Stat()
		if err != nil {
			return false, err
		}
		if fi.Size() <= size {
			break
		}
		more := make([]byte, fi.Size()-size)
		if _, err := f.ReadAt(more, size); err != nil && !errors.Is(err, io.EOF) {
			return false, err
		}
		buf, size = append(buf, more...), fi.Size()
	}
	if _, err := f.WriteAt(buf, 0); err != nil {
		return false, err
	}
	return true, f.Truncate(int64(len(buf)))
}

// lastIndexIn is the offset of the last needle in the first size bytes of
// f, or -1: read backwards in chunks, so that a huge log is read once and
// a trimmed one (marker near its start) in a few chunks.
func lastIndexIn(f *os.File, size int64, needle []byte) (int64, error) {
	const chunk = 256 << 10
	overlap := int64(len(needle) - 1)
	buf := make([]byte, chunk+overlap)
	for end := size; end > 0; {
		from := max(0, end-chunk)
		n := end - from + min(overlap, size-end)
		b := buf[:n]
		if _, err := f.ReadAt(b, from); err != nil && !errors.Is(err, io.EOF) {
			return -1, err
		}
		if i := bytes.LastIndex(b, needle); i >= 0 {
			return from + int64(i), nil
		}
		end = from
	}
	return -1, nil
}
