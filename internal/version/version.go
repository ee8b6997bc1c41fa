// Package version is what kvmd says about its own version: the release it
// was built as and the API level its control API and agent API speak, and
// the skew contract between levels (which peers a process serves).
//
// Both APIs speak one level: kvmd is one binary, and a release that changes
// what one side sends or reads raises the level by one. A process serves a
// peer whose level is at most MaxSkew away from its own, in both
// directions: a control plane of level N drives agents of N-1 and N+1, an
// agent serves controls and peers of N-1 to N+1. A peer that sends no level
// is of level 1, the releases before levels existed.
package version

import (
	"fmt"
	"net/http"
	"strconv"
)

// Level is the API level of this source tree. Raise it by one in a release
// that sends a field or a call its previous release cannot read, and keep
// serving the previous level's requests (MaxSkew).
const Level = 2

// MaxSkew is how many levels apart two processes may be and still talk.
const MaxSkew = 1

// LegacyLevel is the level of a peer that sends none: the releases before
// this package (up to acff6cd).
const LegacyLevel = 1

// Headers every kvmd request and answer carries.
const (
	HeaderRelease = "Kvmd-Version"
	HeaderLevel   = "Kvmd-Api-Level"
)

// release is the release kvmd was built as: make build stamps it with
// -ldflags "-X github.com/kvmfleet/terraform-provider-kvm/internal/version.release=...".
var release = "0.1.0-dev"

// levelOverride, when stamped, is the level this binary claims instead of
// Level. It exists for the upgrade tests only (internal/upgradetest builds a
// binary that claims a level nothing else serves, to prove that the refusal
// is clear and nothing is corrupted); never stamp it in a release.
var levelOverride = ""

// Release is the release this binary was built as.
func Release() string { return release }

// Current is the API level this binary speaks.
func Current() int {
	if levelOverride != "" {
		if n, err := strconv.Atoi(levelOverride); err == nil && n > 0 {
			return n
		}
	}
	return Level
}

// MinServed and MaxServed are the peer levels this binary serves.
func MinServed() int { return max(LegacyLevel, Current()-MaxSkew) }

// MaxServed is the newest peer level this binary serves.
func MaxServed() int { return Current() + MaxSkew }

// Serves says whether a peer of level is within the skew contract.
func Serves(level int) bool { return level >= MinServed() && level <= MaxServed() }

// Peer is what a peer said about itself.
type Peer struct {
	Release string
	Level   int
}

// String names the peer as error messages do: "0.2.0 (API level 2)".
func (p Peer) String() string {
	r := p.Release
	if r == "" {
		r = "unknown release (before versions were announced)"
	}
	return fmt.Sprintf("%s (API level %d)", r, p.Level)
}

// Self is this binary as a Peer.
func Self() Peer { return Peer{Release: Release(), Level: Current()} }

// FromHeader reads a peer's release and level from its headers; a peer
// that sends no level is of LegacyLevel. A level that is not a positive
// number is an error.
func FromHeader(h http.Header) (Peer, error) {
	p := Peer{Release: h.Get(HeaderRelease), Level: LegacyLevel}
	if s := h.Get(HeaderLevel); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			return p, fmt.Errorf("header %s: %q is not a positive whole number", HeaderLevel, s)
		}
		p.Level = n
	}
	return p, nil
}

// FromInfo is a peer as its GET /v1/info answer names it (level 0: a
// release before levels, LegacyLevel).
func FromInfo(release string, level int) Peer {
	if level < 1 {
		level = LegacyLevel
	}
	return Peer{Release: release, Level: level}
}

// SetHeaders puts this binary's release and level on h.
func SetHeaders(h http.Header) {
	h.Set(HeaderRelease, Release())
	h.Set(HeaderLevel, strconv.Itoa(Current()))
}

// SkewError says why self does not serve peer, naming both.
func SkewError(selfRole string, peer Peer, peerRole string) string {
	dir := "newer"
	hint := "upgrade this " + selfRole + " first"
	if peer.Level < MinServed() {
		dir = "older"
		hint = "upgrade the " + peerRole + " (one release at a time)"
	}
	return fmt.Sprintf("kvmd %s %s does not serve the %s %s: it is %s than this %s serves (API levels %d to %d); %s",
		selfRole, Self(), peerRole, peer, dir, selfRole, MinServed(), MaxServed(), hint)
}
