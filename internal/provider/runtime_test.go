package provider

import (
	"runtime/debug"
	"testing"
)

// TestTuneGC: the provider raises the GC target unless the user set GOGC.
func TestTuneGC(t *testing.T) {
	before := debug.SetGCPercent(100)
	t.Cleanup(func() { debug.SetGCPercent(before) })

	t.Setenv("GOGC", "")
	TuneGC()
	if got := debug.SetGCPercent(100); got != gcPercent {
		t.Fatalf("GC percent with GOGC unset = %d, want %d", got, gcPercent)
	}
	t.Setenv("GOGC", "100")
	TuneGC()
	if got := debug.SetGCPercent(100); got != 100 {
		t.Fatalf("GC percent with GOGC=100 = %d, want the user's 100", got)
	}
}
