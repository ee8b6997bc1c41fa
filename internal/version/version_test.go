package version

import (
	"net/http"
	"strings"
	"testing"
)

func TestServesOneLevelEitherWay(t *testing.T) {
	for level, want := range map[int]bool{Level - 2: false, Level - 1: true, Level: true, Level + 1: true, Level + 2: false} {
		if level < 1 {
			continue
		}
		if got := Serves(level); got != want {
			t.Errorf("Serves(%d) at level %d = %v, want %v", level, Level, got, want)
		}
	}
	if !Serves(LegacyLevel) {
		t.Errorf("level %d does not serve the releases before levels (%d): the previous release must stay served", Level, LegacyLevel)
	}
}

func TestFromHeader(t *testing.T) {
	p, err := FromHeader(http.Header{})
	if err != nil || p.Level != LegacyLevel || p.Release != "" {
		t.Errorf("no headers: %+v, %v; want level %d", p, err, LegacyLevel)
	}
	h := http.Header{}
	SetHeaders(h)
	if p, err := FromHeader(h); err != nil || p != Self() {
		t.Errorf("own headers: %+v, %v; want %+v", p, err, Self())
	}
	h.Set(HeaderLevel, "two")
	if _, err := FromHeader(h); err == nil {
		t.Error("a level that is not a number was accepted")
	}
}

func TestSkewErrorNamesBothVersions(t *testing.T) {
	msg := SkewError("control", Peer{Release: "9.0.0", Level: 9}, "agent of host h1")
	for _, want := range []string{Release(), "9.0.0 (API level 9)", "newer", "agent of host h1"} {
		if !strings.Contains(msg, want) {
			t.Errorf("%q does not say %q", msg, want)
		}
	}
}
