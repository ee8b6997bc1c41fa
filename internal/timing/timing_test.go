package timing_test

import (
	"context"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/timing"
)

func TestHeaderParsesBack(t *testing.T) {
	ctx, rec := timing.NewContext(context.Background())
	rec.Add("decode", 1500*time.Microsecond)
	rec.Add("agent.resume", 250*time.Microsecond)
	timing.Since(ctx, "placement", time.Now().Add(-2*time.Millisecond))
	got := timing.Parse(rec.Header())
	if len(got) != 3 || got[0].Name != "decode" || got[0].Duration != 1500*time.Microsecond ||
		got[1].Name != "agent.resume" || got[1].Duration != 250*time.Microsecond ||
		got[2].Name != "placement" || got[2].Duration < 2*time.Millisecond {
		t.Errorf("Parse(%q) = %+v; want decode 1.5ms, agent.resume 0.25ms, placement >= 2ms", rec.Header(), got)
	}
	if timing.FromContext(context.Background()) != nil {
		t.Error("a context without a recorder has one")
	}
	if got := timing.Parse("cache;desc=miss, db;dur=x, ;dur=1"); len(got) != 0 {
		t.Errorf("Parse of entries without a valid duration = %+v; want none", got)
	}
}
