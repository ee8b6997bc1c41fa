package agentapi_test

import (
	"bytes"
	"crypto/ed25519"
	"errors"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// An underlay address in a challenge is signed: a proof for one underlay
// does not verify for another or for none, and a challenge without one
// signs exactly the message it signed before underlay addresses existed.
func TestOverlayIdentityUnderlaySigned(t *testing.T) {
	key := ed25519.NewKeyFromSeed(bytes.Repeat([]byte{2}, ed25519.SeedSize))
	pub, _ := key.Public().(ed25519.PublicKey)
	ch := agentapi.IdentityChallenge{Nonce: agentapi.NewNonce(bytes.Repeat([]byte{7}, 32)), Host: "h1", Address: "http://127.0.0.1:8471"}

	legacy := "kvmd agent identity v1\n" + ch.Nonce + "\nh1\nhttp://127.0.0.1:8471\n" + agentapi.EncodeKey(pub) + "\n"
	if got := string(agentapi.IdentityMessage(ch, pub)); got != legacy {
		t.Fatalf("message without underlay changed:\n%q\nwant\n%q", got, legacy)
	}

	withUnderlay := ch
	withUnderlay.Underlay = "10.99.0.1"
	if err := withUnderlay.Validate(); err != nil {
		t.Fatalf("valid challenge refused: %v", err)
	}
	proof := agentapi.ProveIdentity(key, "tok", withUnderlay)
	if _, err := agentapi.VerifyIdentity(withUnderlay, proof, nil, "tok"); err != nil {
		t.Fatalf("genuine proof with underlay refused: %v", err)
	}
	other := withUnderlay
	other.Underlay = "10.99.0.2"
	for name, c := range map[string]agentapi.IdentityChallenge{"other underlay": other, "no underlay": ch} {
		if _, err := agentapi.VerifyIdentity(c, proof, pub, "tok"); !errors.Is(err, agentapi.ErrBadIdentity) {
			t.Errorf("%s: proof for 10.99.0.1 verified: %v", name, err)
		}
	}

	for _, bad := range []string{"10.0.0.300", "::1", "10.0.0.1\n", "010.0.0.1", "host"} {
		c := ch
		c.Underlay = bad
		if err := c.Validate(); err == nil {
			t.Errorf("underlay %q accepted", bad)
		}
	}
}
