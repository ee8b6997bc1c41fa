package agent

// The agent's identity (agentapi/identity.go): an ed25519 key made on first
// start in <state>/identity.key, and POST /v1/identity, which needs no
// token and signs a challenge only for an address this agent is reachable
// at. That is either an address it was told to advertise (Config.Addresses,
// e.g. a DNS name or a proxy in front of it) or the very IP and port the
// challenge came in on, with the scheme it came in with.

import (
	"crypto/ed25519"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"slices"

	"github.com/labstack/echo/v4"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

const identityKeyFile = "identity.key"

// loadIdentity reads the agent's key, or makes and saves one (0600).
func (a *Agent) loadIdentity() error {
	path := filepath.Join(a.cfg.StateDir, identityKeyFile)
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		_, key, gerr := ed25519.GenerateKey(rand.Reader)
		if gerr != nil {
			return gerr
		}
		der, merr := x509.MarshalPKCS8PrivateKey(key)
		if merr != nil {
			return merr
		}
		if err := writeFileAtomic(path, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), true); err != nil {
			return fmt.Errorf("save identity key %s: %w", path, err)
		}
		a.identity = key
		a.log.Info("identity key created", "key", agentapi.KeyFingerprint(a.PublicKey()), "file", path)
		return nil
	}
	if err != nil {
		return fmt.Errorf("read identity key %s: %w", path, err)
	}
	blk, _ := pem.Decode(b)
	if blk == nil || blk.Type != "PRIVATE KEY" {
		return fmt.Errorf("identity key %s is not a PEM private key; move it away to make a new one (the control plane must then re-register this host)", path)
	}
	k, err := x509.ParsePKCS8PrivateKey(blk.Bytes)
	key, ok := k.(ed25519.PrivateKey)
	if err != nil || !ok {
		return fmt.Errorf("identity key %s is not an ed25519 key; move it away to make a new one (the control plane must then re-register this host)", path)
	}
	a.identity = key
	return nil
}

// PublicKey is the agent's identity key.
func (a *Agent) PublicKey() ed25519.PublicKey {
	pub, _ := a.identity.Public().(ed25519.PublicKey)
	return pub
}

// AllowAddress adds an address this agent signs identity challenges for,
// beside Config.Addresses (e.g. a proxy started after the agent).
func (a *Agent) AllowAddress(addr string) error {
	c, err := agentapi.CheckAddress(addr)
	if err != nil {
		return err
	}
	a.addrMu.Lock()
	defer a.addrMu.Unlock()
	if !slices.Contains(a.addresses, c) {
		a.addresses = append(a.addresses, c)
	}
	return nil
}

// reachableAt says whether this agent may sign for address, a canonical
// address, for a challenge that came in on r.
func (a *Agent) reachableAt(address string, r *http.Request) bool {
	a.addrMu.Lock()
	listed := slices.Contains(a.addresses, address)
	a.addrMu.Unlock()
	if listed {
		return true
	}
	u, err := url.Parse(address)
	if err != nil {
		return false
	}
	if (u.Scheme == "https") != (r.TLS != nil) {
		return false
	}
	want, err := netip.ParseAddrPort(u.Host)
	if err != nil {
		return false // a name: only an advertised one is signed for
	}
	local, ok := r.Context().Value(http.LocalAddrContextKey).(net.Addr)
	if !ok {
		return false
	}
	got, err := netip.ParseAddrPort(local.String())
	return err == nil && got.Addr().Unmap() == want.Addr().Unmap() && got.Port() == want.Port()
}

func (a *Agent) postIdentity(c echo.Context) error {
	var ch agentapi.IdentityChallenge
	if err := bindJSON(c, &ch); err != nil {
		return err
	}
	if err := ch.Validate(); err != nil {
		return errInvalid("identity challenge: %v", err)
	}
	if !a.reachableAt(ch.Address, c.Request()) {
		return &Error{Status: http.StatusForbidden, Code: CodeForbidden,
			Message: fmt.Sprintf("this agent is not reachable at %s as far as it knows: start it with --advertise-url %s if that is its address", ch.Address, ch.Address)}
	}
	if ch.Underlay != "" {
		if u := a.overlays.Underlay(); !u.Addr.IsValid() || u.Addr.String() != ch.Underlay {
			have := "none (it was started without --underlay-address)"
			if u.Addr.IsValid() {
				have = u.Addr.String()
			}
			return &Error{Status: http.StatusForbidden, Code: CodeForbidden,
				Message: fmt.Sprintf("this agent's underlay address is not %s: it is %s; register the host with its own, or start the agent with --underlay-address %s if that is it",
					ch.Underlay, have, ch.Underlay)}
		}
	}
	return c.JSON(http.StatusOK, agentapi.ProveIdentity(a.identity, a.cfg.Token, ch))
}
