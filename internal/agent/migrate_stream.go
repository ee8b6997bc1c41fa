package agent

// The channels of a migration stream: the source agent opens each with an
// HTTP request to the target agent (agent token, after the target proved
// the identity the control plane pinned for it), upgraded to a raw
// connection. On it the target sends a fresh nonce and the source signs it
// with its own identity key, bound to the VM, the channel and the target's
// key: the target accepts the channel only for a VM it prepared as
// incoming from the agent with that pinned key. Then the bytes flow.

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

const (
	streamNonceLen = 32
	streamOK       = 0x01
	// handshakeTimeout bounds the challenge on a new channel.
	handshakeTimeout = 30 * time.Second
)

// streamMessage is what the source signs on a channel.
func streamMessage(id, channel string, nonce []byte, target ed25519.PublicKey) []byte {
	m := []byte("kvm-migration-stream/1\n" + id + "\n" + channel + "\n")
	m = append(m, nonce...)
	return append(m, target...)
}

// dialStream opens one channel of VM id's stream to the target c (whose
// key the caller verified) and answers the target's challenge.
func (a *Agent) dialStream(ctx context.Context, c *agentapi.Client, target ed25519.PublicKey, id, channel string) (net.Conn, error) {
	hctx, cancel := context.WithTimeout(ctx, handshakeTimeout)
	defer cancel()
	conn, err := c.OpenMigrationStream(hctx, id, channel)
	if err != nil {
		return nil, err
	}
	_ = conn.SetDeadline(time.Now().Add(handshakeTimeout))
	nonce := make([]byte, streamNonceLen)
	if _, err := io.ReadFull(conn, nonce); err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("migration channel %s of vm %s: read the target's challenge: %w", channel, id, err)
	}
	sig := ed25519.Sign(a.identity, streamMessage(id, channel, nonce, target))
	if _, err := conn.Write(sig); err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("migration channel %s of vm %s: answer the target's challenge: %w", channel, id, err)
	}
	ok := make([]byte, 1)
	if _, err := io.ReadFull(conn, ok); err != nil || ok[0] != streamOK {
		_ = conn.Close()
		return nil, fmt.Errorf("migration channel %s of vm %s: the target refused this agent's identity (is the target prepared for this vm from this agent?)", channel, id)
	}
	_ = conn.SetDeadline(time.Time{})
	return conn, nil
}

// getIncomingStream is GET /v1/vms/{id}/incoming/stream?channel=: the
// target's end of one channel.
func (a *Agent) getIncomingStream(c echo.Context) error {
	id, channel := c.Param("id"), c.QueryParam("channel")
	switch channel {
	case agentapi.ChannelFiles, agentapi.ChannelMemory, agentapi.ChannelDisk:
	default:
		return errInvalid("channel %q is not one of files, memory, disk", channel)
	}
	if c.Request().Header.Get("Upgrade") != agentapi.MigrationStreamUpgrade {
		return errInvalid("a migration stream needs Upgrade: %s", agentapi.MigrationStreamUpgrade)
	}
	in, err := a.incomingFor(id)
	if err != nil {
		return err
	}
	key, err := agentapi.DecodeKey(in.Source.PublicKey)
	if err != nil {
		return errConflict("vm %s: its source's pinned key: %v", id, err)
	}
	conn, brw, err := http.NewResponseController(c.Response().Writer).Hijack()
	if err != nil {
		return fmt.Errorf("migration stream of vm %s: take over the connection: %w", id, err)
	}
	c.Response().Committed = true
	defer func() { _ = conn.Close() }()
	_ = conn.SetDeadline(time.Now().Add(handshakeTimeout))
	if _, err := brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nUpgrade: " + agentapi.MigrationStreamUpgrade + "\r\nConnection: Upgrade\r\n\r\n"); err != nil {
		return nil
	}
	nonce := make([]byte, streamNonceLen)
	if _, err := rand.Read(nonce); err != nil {
		return nil
	}
	if _, err := brw.Write(nonce); err != nil || brw.Flush() != nil {
		return nil
	}
	sig := make([]byte, ed25519.SignatureSize)
	if _, err := io.ReadFull(brw, sig); err != nil {
		a.log.Warn("migration stream: no answer to the challenge", "vm", id, "channel", channel, "err", err)
		return nil
	}
	if !ed25519.Verify(key, streamMessage(id, channel, nonce, a.PublicKey()), sig) {
		a.log.Warn("migration stream refused: not signed by the source the control plane named", "vm", id, "channel", channel,
			"source", in.Source.Address, "remote", conn.RemoteAddr().String())
		_, _ = conn.Write([]byte{0})
		return nil
	}
	if _, err := conn.Write([]byte{streamOK}); err != nil {
		return nil
	}
	_ = conn.SetDeadline(time.Time{})
	rc := conn
	if n := brw.Reader.Buffered(); n > 0 {
		rc = &prefixedConn{Conn: conn, r: io.MultiReader(io.LimitReader(brw.Reader, int64(n)), conn)}
	}
	ctx := context.WithoutCancel(c.Request().Context())
	if err := a.receiveChannel(ctx, id, channel, rc); err != nil && !errors.Is(err, net.ErrClosed) {
		a.log.Warn("migration channel ended with an error", "vm", id, "channel", channel, "err", err)
	}
	return nil
}

// prefixedConn is a connection whose first bytes were read ahead.
type prefixedConn struct {
	net.Conn
	r io.Reader
}

func (p *prefixedConn) Read(b []byte) (int, error) { return p.r.Read(b) }

// CloseWrite half-closes the connection where it can (TCP).
func (p *prefixedConn) CloseWrite() error {
	if cw, ok := p.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}
