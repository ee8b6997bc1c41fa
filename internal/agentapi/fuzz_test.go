package agentapi_test

import (
	"bytes"
	"crypto/ed25519"
	"encoding/hex"
	"encoding/json"
	"net/url"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// FuzzCheckAddress: an address that passes is canonical (checking it again
// gives it back), and a call built on it reaches exactly that host and the
// call's path: nothing in an address can change where a call goes.
func FuzzCheckAddress(f *testing.F) {
	for _, s := range []string{
		"http://127.0.0.1:8471", "https://kvm-01.example.net:8471", "http://[::1]:8471", "HTTP://Host:1",
		"http://127.0.0.1:8471/", "http://127.0.0.1:8471/v1?x=", "http://127.0.0.1:8471#f", "http://u:p@h:1",
		"127.0.0.1:8471", "http://h:0", "http://h:65536", "http://h:01", "http://%31:1", "http://h:1\\@evil:2",
		"http://h:1?", "http:h:1", "http:///h:1", "ftp://h:1", "http://h%2fx:1", "http://[fe80::1%25eth0]:1",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, addr string) {
		c, err := agentapi.CheckAddress(addr)
		if err != nil {
			return
		}
		again, err := agentapi.CheckAddress(c)
		if err != nil || again != c {
			t.Fatalf("canonical %q of %q does not check out again: %q %v", c, addr, again, err)
		}
		u, err := url.Parse(c)
		if err != nil || u.User != nil || u.Path != "" || u.RawQuery != "" || u.Fragment != "" || u.Opaque != "" {
			t.Fatalf("canonical %q of %q carries more than scheme://host:port", c, addr)
		}
		call, err := url.Parse(agentapi.NewClient(c, "").BaseURL() + "/v1/info")
		if err != nil || call.Host != u.Host || call.Path != "/v1/info" || call.RawQuery != "" || call.User != nil {
			t.Fatalf("a call to %q goes to %v (%v)", c, call, err)
		}
	})
}

// FuzzVerifyIdentity: a proof decoded from any bytes verifies only when its
// key, signature and join proof are the genuine ones for the challenge.
func FuzzVerifyIdentity(f *testing.F) {
	seed := bytes.Repeat([]byte{1}, ed25519.SeedSize)
	key := ed25519.NewKeyFromSeed(seed)
	ch := agentapi.IdentityChallenge{Nonce: agentapi.NewNonce(bytes.Repeat([]byte{9}, 32)), Host: "h1", Address: "http://127.0.0.1:8471"}
	good := agentapi.ProveIdentity(key, "agent-token", ch)
	b, err := json.Marshal(good)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(b, false)
	f.Add(b, true)
	f.Add([]byte(`{}`), false)
	f.Add([]byte(`{"public_key":"AAAA","signature":"AAAA","join_proof":"00"}`), false)
	pub, _ := key.Public().(ed25519.PublicKey)
	goodMAC, _ := hex.DecodeString(good.JoinProof)
	f.Fuzz(func(t *testing.T, body []byte, pinned bool) {
		var p agentapi.IdentityProof
		if json.Unmarshal(body, &p) != nil {
			return
		}
		var pin ed25519.PublicKey
		if pinned {
			pin = pub
		}
		got, err := agentapi.VerifyIdentity(ch, p, pin, "agent-token")
		if err != nil {
			return
		}
		if !got.Equal(pub) {
			t.Fatalf("accepted a proof with another key: %+v", p)
		}
		if mac, err := hex.DecodeString(p.JoinProof); !pinned && (err != nil || !bytes.Equal(mac, goodMAC)) {
			t.Fatalf("accepted join proof %q, want %s", p.JoinProof, good.JoinProof)
		}
	})
}
