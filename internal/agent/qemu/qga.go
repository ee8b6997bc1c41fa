package qemu

// The QEMU guest agent (QGA): a VM created with guest_agent has a
// virtio-serial port named org.qemu.guest_agent.0 whose host side is the
// unix socket qga.sock in the VM's directory (qgaArgs). When the guest runs
// qemu-guest-agent, the driver asks it for the guest's addresses, to shut
// the guest down and to freeze its file systems around a snapshot.
//
// The protocol is QMP's JSON framing without a greeting, read from QEMU's
// qga/qapi-schema.json. The channel keeps bytes across clients (a reply to
// a client that gave up can still be in it, and a half-written request of
// one in the guest agent's parser), so every session starts with
// guest-sync-delimited: the request is preceded by a 0xFF byte (the guest
// agent drops what it half read), the answer by a 0xFF byte (everything
// before it is stale), and replies are skipped until the one that echoes
// the session's random id. A session is used by one goroutine; the driver
// lets one session per VM run at a time (QEMU's chardev serves one client,
// the next waits in its listen queue).
//
// github.com/digitalocean/go-qemu has no guest agent client (its qmp
// package speaks the monitor protocol, with a greeting and
// qmp_capabilities, and no sync framing), so this one is written here, on
// the same deadline handling as the monitor session (qmp.go).

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
)

const (
	qgaFileName = "qga.sock"
	// qgaPortName is the virtio-serial port name qemu-guest-agent opens
	// (/dev/virtio-ports/org.qemu.guest_agent.0); udev starts its service
	// when the port appears.
	qgaPortName = "org.qemu.guest_agent.0"
	// qgaSyncTimeout bounds the sync that starts a session: a guest whose
	// agent is not (yet) running never answers, and every caller has
	// something to do instead (no addresses, the ACPI stop, an unfrozen
	// snapshot).
	qgaSyncTimeout = 3 * time.Second
	// qgaTimeout bounds one command's answer. A freeze syncs every file
	// system first, which takes seconds under TCG.
	qgaTimeout = 30 * time.Second
	// qgaSentinel is the byte that precedes a sync request and its answer.
	qgaSentinel = 0xFF
)

// errQGANoAnswer is a guest agent that did not answer the sync: none runs
// in the guest (yet), or the guest is paused.
var errQGANoAnswer = errors.New("the guest agent did not answer")

func qgaPathOf(m *agent.Machine) string { return filepath.Join(m.Dir, qgaFileName) }

// qgaArgs are the QEMU options of the guest agent channel: a virtio-serial
// bus, a unix socket server in the VM's directory (relative to QEMU's
// working directory, like the monitor's), and the port the guest agent
// opens. The socket is bound before QEMU drops its privileges (sandbox.go).
func qgaArgs(microvm bool) []string {
	bus := "virtio-serial-pci,id=qga-serial"
	if microvm {
		bus = "virtio-serial-device,id=qga-serial"
	}
	return []string{
		"-device", bus,
		"-chardev", "socket,id=qga,server=on,wait=off,path=" + qemuOptQuote(qgaFileName),
		"-device", "virtserialport,bus=qga-serial.0,chardev=qga,name=" + qgaPortName,
	}
}

// guestAgent is one session on a VM's guest agent socket.
type guestAgent struct {
	path string
	conn net.Conn
	r    *bufio.Reader
	// broken is set once an exchange failed half way: the next use syncs
	// again first (the protocol's rule after a client-side timeout).
	broken error
	// syncTimeout and timeout are qgaSyncTimeout and qgaTimeout (tests
	// shorten them).
	syncTimeout, timeout time.Duration
}

// qgaAnswer is one reply of the guest agent.
type qgaAnswer struct {
	Return json.RawMessage `json:"return"`
	Error  *qmpError       `json:"error"`
}

// dialGuestAgent connects to the guest agent socket at path and syncs
// within syncTimeout; commands then wait up to timeout for their answer.
// errQGANoAnswer (wrapped) says the guest agent did not answer the sync.
func dialGuestAgent(ctx context.Context, path string, syncTimeout, timeout time.Duration) (*guestAgent, error) {
	dctx, cancel := context.WithTimeout(ctx, syncTimeout)
	defer cancel()
	conn, err := dialUnix(dctx, path)
	if err != nil {
		return nil, fmt.Errorf("connect to guest agent socket %s: %w", path, err)
	}
	g := &guestAgent{path: path, conn: conn, r: bufio.NewReader(conn), syncTimeout: syncTimeout, timeout: timeout}
	if err := g.sync(ctx); err != nil {
		_ = conn.Close()
		return nil, err
	}
	return g, nil
}

func (g *guestAgent) Close() error { return g.conn.Close() }

// exchange runs io with a deadline of timeout from now (or ctx's when
// sooner); ctx's end cuts it short.
func (g *guestAgent) exchange(ctx context.Context, timeout time.Duration, io func() error) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	deadline := time.Now().Add(timeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	if err := g.conn.SetDeadline(deadline); err != nil {
		return err
	}
	var fired sync.WaitGroup
	fired.Add(1)
	stop := context.AfterFunc(ctx, func() {
		defer fired.Done()
		_ = g.conn.SetDeadline(time.Now())
	})
	err := io()
	if stop() {
		fired.Done()
	}
	fired.Wait()
	if err != nil {
		if cerr := ctx.Err(); cerr != nil {
			err = fmt.Errorf("%w (%w)", cerr, err)
		}
		g.broken = err
	}
	return err
}

// sync runs guest-sync-delimited with a random id: it reads past the 0xFF
// that precedes the answer, then skips replies until the one that echoes
// the id (replies meant for an earlier client, or an earlier sync).
func (g *guestAgent) sync(ctx context.Context) error {
	id := rand.Int64N(1 << 53) // exact in any JSON reader
	req, err := json.Marshal(map[string]any{"execute": "guest-sync-delimited", "arguments": map[string]any{"id": id}})
	if err != nil {
		return err
	}
	var stale []string
	err = g.exchange(ctx, g.syncTimeout, func() error {
		if _, err := g.conn.Write(append([]byte{qgaSentinel}, req...)); err != nil {
			return err
		}
		// Everything before the first sentinel is stale.
		if _, err := g.r.ReadBytes(qgaSentinel); err != nil {
			return err
		}
		for {
			a, err := g.readAnswer()
			if err != nil {
				return err
			}
			var got int64
			if a.Error == nil && json.Unmarshal(a.Return, &got) == nil && got == id {
				return nil
			}
			if len(stale) < 3 {
				stale = append(stale, truncate(strings.TrimSpace(string(a.Return)), 40))
			}
		}
	})
	if err != nil {
		if len(stale) > 0 {
			err = fmt.Errorf("%w; it answered other sync ids (%s), stale replies of an earlier client", err, strings.Join(stale, ", "))
		}
		return fmt.Errorf("guest agent on %s: sync: %w: %w", g.path, errQGANoAnswer, err)
	}
	g.broken = nil
	return nil
}

// readAnswer reads one reply: a line of JSON. A sentinel byte in it starts
// a new reply (a sync's answer): what precedes it is stale.
func (g *guestAgent) readAnswer() (qgaAnswer, error) {
	for {
		line, err := g.r.ReadBytes('\n')
		if err != nil {
			return qgaAnswer{}, err
		}
		if i := bytes.LastIndexByte(line, qgaSentinel); i >= 0 {
			line = line[i+1:]
		}
		line = bytes.TrimSpace(line)
		if len(line) == 0 {
			continue
		}
		var a qgaAnswer
		if err := json.Unmarshal(line, &a); err != nil {
			return qgaAnswer{}, fmt.Errorf("read answer %q: %w", truncate(string(line), 200), err)
		}
		return a, nil
	}
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n] + "..."
	}
	return s
}

// run executes cmd and decodes its return value into out.
func (g *guestAgent) run(ctx context.Context, cmd string, args, out any) error {
	if g.broken != nil {
		if err := g.sync(ctx); err != nil {
			return fmt.Errorf("qga %s: %w", cmd, err)
		}
	}
	req, err := json.Marshal(struct {
		Execute   string `json:"execute"`
		Arguments any    `json:"arguments,omitempty"`
	}{cmd, args})
	if err != nil {
		return err
	}
	var a qgaAnswer
	err = g.exchange(ctx, g.timeout, func() error {
		if _, err := g.conn.Write(req); err != nil {
			return err
		}
		a, err = g.readAnswer()
		return err
	})
	switch {
	case err != nil:
		return fmt.Errorf("qga %s on %s: %w", cmd, g.path, err)
	case a.Error != nil:
		return fmt.Errorf("qga %s on %s: %w", cmd, g.path, a.Error)
	case out != nil:
		if err := json.Unmarshal(a.Return, out); err != nil {
			return fmt.Errorf("qga %s on %s: answer %s: %w", cmd, g.path, truncate(string(a.Return), 200), err)
		}
	}
	return nil
}

// send writes cmd without waiting for an answer: guest-shutdown answers
// nothing on success.
func (g *guestAgent) send(ctx context.Context, cmd string, args any) error {
	req, err := json.Marshal(struct {
		Execute   string `json:"execute"`
		Arguments any    `json:"arguments,omitempty"`
	}{cmd, args})
	if err != nil {
		return err
	}
	return g.exchange(ctx, g.timeout, func() error {
		_, err := g.conn.Write(req)
		return err
	})
}

// shutdown asks the guest to power off (guest-shutdown, mode powerdown).
// The guest agent answers only a failure, so an answer that comes within
// a short wait is one; none means the request was taken.
func (g *guestAgent) shutdown(ctx context.Context) error {
	if err := g.send(ctx, "guest-shutdown", map[string]any{"mode": "powerdown"}); err != nil {
		return fmt.Errorf("qga guest-shutdown on %s: %w", g.path, err)
	}
	var a qgaAnswer
	err := g.exchange(ctx, time.Second, func() (err error) { a, err = g.readAnswer(); return err })
	switch {
	case err == nil && a.Error != nil:
		return fmt.Errorf("qga guest-shutdown on %s: %w", g.path, a.Error)
	case err == nil:
		return fmt.Errorf("qga guest-shutdown on %s: an unexpected answer %s", g.path, truncate(string(a.Return), 200))
	}
	return nil // no answer (a timeout, or the guest closed the port going down): taken
}

// fsfreeze freezes the guest's local file systems (after syncing them) and
// returns how many it froze.
func (g *guestAgent) fsfreeze(ctx context.Context) (int, error) {
	var n int
	err := g.run(ctx, "guest-fsfreeze-freeze", nil, &n)
	return n, err
}

// fsthaw thaws the guest's frozen file systems and returns how many.
func (g *guestAgent) fsthaw(ctx context.Context) (int, error) {
	var n int
	err := g.run(ctx, "guest-fsfreeze-thaw", nil, &n)
	return n, err
}

// qgaInterface is one interface of guest-network-get-interfaces.
type qgaInterface struct {
	Name            string `json:"name"`
	HardwareAddress string `json:"hardware-address"`
	IPAddresses     []struct {
		Type    string `json:"ip-address-type"`
		Address string `json:"ip-address"`
		Prefix  int    `json:"prefix"`
	} `json:"ip-addresses"`
}

// ipv4ByMAC asks the guest for its interfaces and returns the IPv4
// addresses of each, by lower-case MAC (loopback and interfaces without a
// MAC left out).
func (g *guestAgent) ipv4ByMAC(ctx context.Context) (map[string][]string, error) {
	var ifs []qgaInterface
	if err := g.run(ctx, "guest-network-get-interfaces", nil, &ifs); err != nil {
		return nil, err
	}
	out := map[string][]string{}
	for _, i := range ifs {
		mac := strings.ToLower(i.HardwareAddress)
		if mac == "" || mac == "00:00:00:00:00:00" {
			continue
		}
		for _, a := range i.IPAddresses {
			addr, err := netip.ParseAddr(a.Address)
			if a.Type != "ipv4" || err != nil || !addr.Is4() || addr.IsLoopback() {
				continue
			}
			out[mac] = append(out[mac], addr.String())
		}
	}
	return out, nil
}
