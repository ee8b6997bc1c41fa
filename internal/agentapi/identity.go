package agentapi

// Agent identity: how the control plane learns that an address really is
// an agent of its fleet before it sends the agent token there.
//
// Every agent holds an ed25519 key that it generates in its state directory
// on first start. POST /v1/identity needs no token: the caller sends an
// IdentityChallenge (a fresh nonce, the host name it registers, and the
// address it reaches the agent at) and the agent answers its public key, a
// signature over the challenge and the key, and a join proof: an HMAC of the
// same message keyed with the agent token. The token itself never crosses
// the wire in either direction.
//
// The control plane pins the key of a host when it registers it, and only
// when the join proof checks out (so only a holder of the agent token can
// join, and an impostor at an address learns nothing); later, the same key
// must sign at any new address of that host. An agent signs only for an
// address it is reachable at (its own listening address, or one it was
// told to advertise), so a relay at another address cannot borrow a real
// agent's answer.

import (
	"crypto/ed25519"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"regexp"
	"strconv"
	"strings"
)

// IdentityChallenge is the body of POST /v1/identity.
type IdentityChallenge struct {
	// Nonce is 32 random bytes, base64url without padding, fresh per call.
	Nonce string `json:"nonce"`
	// Host is the host name the caller registers the agent as ("" for a
	// check that is not a registration).
	Host string `json:"host"`
	// Address is the address the caller reaches the agent at
	// (scheme://host:port, see CheckAddress).
	Address string `json:"address"`
	// Underlay, when set, is the underlay address the caller registers
	// the host with (overlay networks): the agent proves it only when it
	// is its own --underlay-address. It is signed only when set, so a
	// challenge without it signs as before.
	Underlay string `json:"underlay_address,omitempty"`
}

// IdentityProof is the answer of POST /v1/identity.
type IdentityProof struct {
	// PublicKey is the agent's ed25519 public key, base64 (standard).
	PublicKey string `json:"public_key"`
	// Signature is the key's ed25519 signature of IdentityMessage, base64.
	Signature string `json:"signature"`
	// JoinProof is HMAC-SHA256(agent token, IdentityMessage), hex.
	JoinProof string `json:"join_proof"`
}

// Identity errors a caller can test with errors.Is.
var (
	ErrBadIdentity = errors.New("the address did not prove the agent identity")
	ErrBadAddress  = errors.New("not an agent address")
)

const (
	nonceBytes       = 32
	identityDomain   = "kvmd agent identity v1"
	maxAddressLength = 300
)

var hostNamePattern = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$`)

// CheckAddress checks an agent address: http or https, a host and a port,
// and nothing else (no user info, path, query or fragment). It returns the
// address in its canonical form: lower-case scheme and host, no trailing
// slash.
func CheckAddress(addr string) (string, error) {
	bad := func(why string) (string, error) {
		return "", fmt.Errorf("address %q: %s: %w", addr, why, ErrBadAddress)
	}
	if len(addr) > maxAddressLength {
		return bad(fmt.Sprintf("longer than %d characters", maxAddressLength))
	}
	if strings.ContainsAny(addr, " \t\r\n\\") {
		return bad("contains whitespace or a backslash")
	}
	u, err := url.Parse(addr)
	if err != nil {
		return bad("not a URL")
	}
	switch {
	case u.Scheme != "http" && u.Scheme != "https":
		return bad("want http://host:port or https://host:port")
	case u.Opaque != "" || u.User != nil:
		return bad("user info is not allowed")
	case u.Path != "" || u.RawPath != "":
		return bad("a path is not allowed")
	case u.RawQuery != "" || u.ForceQuery:
		return bad("a query is not allowed")
	case u.Fragment != "" || strings.Contains(addr, "#"):
		return bad("a fragment is not allowed")
	}
	host, port, err := net.SplitHostPort(u.Host)
	if err != nil || host == "" {
		return bad("want host:port after the scheme")
	}
	if p, err := strconv.Atoi(port); err != nil || p < 1 || p > 65535 || strconv.Itoa(p) != port {
		return bad("the port must be a number from 1 to 65535")
	}
	if strings.ContainsAny(host, "%/?#@") {
		return bad("bad host")
	}
	return strings.ToLower(u.Scheme) + "://" + strings.ToLower(net.JoinHostPort(host, port)), nil
}

// NewNonce returns a fresh challenge nonce from random bytes b (32 bytes).
func NewNonce(b []byte) string { return base64.RawURLEncoding.EncodeToString(b) }

// Validate checks a challenge before it is signed or verified.
func (ch IdentityChallenge) Validate() error {
	n, err := base64.RawURLEncoding.DecodeString(ch.Nonce)
	if err != nil || len(n) != nonceBytes {
		return fmt.Errorf("nonce must be %d bytes, base64url without padding", nonceBytes)
	}
	if ch.Host != "" && !hostNamePattern.MatchString(ch.Host) {
		return fmt.Errorf("host %q is not a valid host name", ch.Host)
	}
	canonical, err := CheckAddress(ch.Address)
	if err != nil {
		return err
	}
	if canonical != ch.Address {
		return fmt.Errorf("address %q is not in its canonical form %q", ch.Address, canonical)
	}
	if ch.Underlay != "" {
		ip, err := netip.ParseAddr(ch.Underlay)
		if err != nil || !ip.Is4() || ip.String() != ch.Underlay {
			return fmt.Errorf("underlay address %q is not an IPv4 address in dotted form", ch.Underlay)
		}
	}
	return nil
}

// IdentityMessage is what the signature and the join proof cover: the
// challenge and the public key, each on its own line (none may contain a
// newline: Validate). The underlay address is a last line only when the
// challenge has one, so proofs of challenges without it are unchanged.
func IdentityMessage(ch IdentityChallenge, publicKey ed25519.PublicKey) []byte {
	msg := fmt.Appendf(nil, "%s\n%s\n%s\n%s\n%s\n", identityDomain, ch.Nonce, ch.Host, ch.Address,
		base64.StdEncoding.EncodeToString(publicKey))
	if ch.Underlay != "" {
		msg = fmt.Appendf(msg, "underlay %s\n", ch.Underlay)
	}
	return msg
}

// ProveIdentity answers a challenge with key and the agent token. The
// caller has validated the challenge and that it may sign for its address.
func ProveIdentity(key ed25519.PrivateKey, agentToken string, ch IdentityChallenge) IdentityProof {
	pub, _ := key.Public().(ed25519.PublicKey)
	msg := IdentityMessage(ch, pub)
	mac := hmac.New(sha256.New, []byte(agentToken))
	mac.Write(msg)
	return IdentityProof{
		PublicKey: base64.StdEncoding.EncodeToString(pub),
		Signature: base64.StdEncoding.EncodeToString(ed25519.Sign(key, msg)),
		JoinProof: hex.EncodeToString(mac.Sum(nil)),
	}
}

// VerifyIdentity checks proof against the challenge the caller sent. With
// pinned set, the proof must be signed by that key (a known host); without,
// the join proof must check out with agentToken (a host that joins). It
// returns the agent's public key.
func VerifyIdentity(ch IdentityChallenge, proof IdentityProof, pinned ed25519.PublicKey, agentToken string) (ed25519.PublicKey, error) {
	pub, err := base64.StdEncoding.DecodeString(proof.PublicKey)
	if err != nil || len(pub) != ed25519.PublicKeySize {
		return nil, fmt.Errorf("%w: its public key is not an ed25519 key", ErrBadIdentity)
	}
	sig, err := base64.StdEncoding.DecodeString(proof.Signature)
	if err != nil || len(sig) != ed25519.SignatureSize {
		return nil, fmt.Errorf("%w: its signature is not an ed25519 signature", ErrBadIdentity)
	}
	key := ed25519.PublicKey(pub)
	msg := IdentityMessage(ch, key)
	if !ed25519.Verify(key, msg, sig) {
		return nil, fmt.Errorf("%w: the signature does not match its key", ErrBadIdentity)
	}
	if pinned != nil {
		if !key.Equal(pinned) {
			return nil, fmt.Errorf("%w: it answers with key %s, the host's pinned key is %s", ErrBadIdentity,
				KeyFingerprint(key), KeyFingerprint(pinned))
		}
		return key, nil
	}
	got, err := hex.DecodeString(proof.JoinProof)
	mac := hmac.New(sha256.New, []byte(agentToken))
	mac.Write(msg)
	if err != nil || !hmac.Equal(got, mac.Sum(nil)) {
		return nil, fmt.Errorf("%w: its join proof does not match the agent token", ErrBadIdentity)
	}
	return key, nil
}

// EncodeKey is the text form of a public key as hosts store it.
func EncodeKey(k ed25519.PublicKey) string { return base64.StdEncoding.EncodeToString(k) }

// DecodeKey parses EncodeKey's form.
func DecodeKey(s string) (ed25519.PublicKey, error) {
	b, err := base64.StdEncoding.DecodeString(s)
	if err != nil || len(b) != ed25519.PublicKeySize {
		return nil, fmt.Errorf("not an ed25519 public key: %q", s)
	}
	return ed25519.PublicKey(b), nil
}

// KeyFingerprint is a short name of a key for messages and logs: the
// first 16 hex digits of its SHA-256.
func KeyFingerprint(k ed25519.PublicKey) string {
	sum := sha256.Sum256(k)
	return "SHA256:" + hex.EncodeToString(sum[:8])
}
