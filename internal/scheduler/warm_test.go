package scheduler

import "testing"

func TestPreferWarm(t *testing.T) {
	ranked := func() Result {
		return Result{Ranked: []Ranked{
			{Host: "a", Score: 1.00},
			{Host: "b", Score: 1.05},
			{Host: "c", Score: 1.09},
			{Host: "d", Score: 1.20},
		}}
	}
	tests := []struct {
		name      string
		margin    float64
		warm      map[string]int
		wantFirst string
		wantOrder []string
		decided   bool
	}{
		{name: "no warm VMs: score decides", margin: 0.1, warm: nil, wantFirst: "a", wantOrder: []string{"a", "b", "c", "d"}},
		{name: "warm host within margin wins", margin: 0.1, warm: map[string]int{"c": 1}, wantFirst: "c", wantOrder: []string{"c", "a", "b", "d"}, decided: true},
		{name: "best warm host within margin wins", margin: 0.1, warm: map[string]int{"b": 2, "c": 1}, wantFirst: "b", wantOrder: []string{"b", "a", "c", "d"}, decided: true},
		{name: "warm host outside margin loses", margin: 0.1, warm: map[string]int{"d": 3}, wantFirst: "a", wantOrder: []string{"a", "b", "c", "d"}},
		{name: "smaller margin excludes it", margin: 0.04, warm: map[string]int{"b": 1}, wantFirst: "a", wantOrder: []string{"a", "b", "c", "d"}},
		{name: "best host already warm: nothing moves", margin: 0.1, warm: map[string]int{"a": 1, "b": 1}, wantFirst: "a", wantOrder: []string{"a", "b", "c", "d"}},
		{name: "zero margin turns it off", margin: 0, warm: map[string]int{"b": 1}, wantFirst: "a", wantOrder: []string{"a", "b", "c", "d"}},
		{name: "zero ready counts as none", margin: 0.1, warm: map[string]int{"b": 0}, wantFirst: "a", wantOrder: []string{"a", "b", "c", "d"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := ranked()
			got, decided := PreferWarm(in, tt.margin, tt.warm)
			if decided != tt.decided {
				t.Errorf("decided = %v, want %v", decided, tt.decided)
			}
			for i, h := range tt.wantOrder {
				if got.Ranked[i].Host != h {
					t.Fatalf("order = %v, want %v", hosts(got.Ranked), tt.wantOrder)
				}
			}
			if got.Ranked[0].WarmPreferred != tt.decided {
				t.Errorf("WarmPreferred of %s = %v, want %v", got.Ranked[0].Host, got.Ranked[0].WarmPreferred, tt.decided)
			}
			for _, r := range got.Ranked {
				if r.WarmReady != tt.warm[r.Host] {
					t.Errorf("WarmReady of %s = %d, want %d", r.Host, r.WarmReady, tt.warm[r.Host])
				}
			}
			if in.Ranked[0].Host != "a" {
				t.Errorf("the input ranking was modified: %v", hosts(in.Ranked))
			}
		})
	}
}

// TestPreferWarmWithScores checks the margin on real scores: a warm host
// slightly more loaded than the best wins, a much more loaded one does not.
func TestPreferWarmWithScores(t *testing.T) {
	req := Request{Image: "busybox", Resources: Resources{VCPUs: 1, MemoryMiB: 128, DiskMiB: 256}}
	host := func(name string, allocMem int64) Host {
		return Host{Name: name, Alive: true, Schedulable: true, Images: []string{"busybox"},
			Total: Resources{VCPUs: 8, MemoryMiB: 16384, DiskMiB: 102400}, Allocated: Resources{MemoryMiB: allocMem}}
	}
	hostsIn := []Host{host("empty", 0), host("light", 1024), host("heavy", 14336)}
	res := Rank(DefaultWeights(), hostsIn, req)
	if res.Ranked[0].Host != "empty" {
		t.Fatalf("best without warm VMs = %s, want empty", res.Ranked[0].Host)
	}
	got, decided := PreferWarm(res, DefaultWarmMargin, map[string]int{"light": 1})
	if !decided || got.Ranked[0].Host != "light" {
		t.Errorf("warm light host within the margin: winner %s (decided %v), want light; scores %v", got.Ranked[0].Host, decided, scores(res.Ranked))
	}
	got, decided = PreferWarm(res, DefaultWarmMargin, map[string]int{"heavy": 1})
	if decided || got.Ranked[0].Host != "empty" {
		t.Errorf("warm heavy host outside the margin: winner %s (decided %v), want empty; scores %v", got.Ranked[0].Host, decided, scores(res.Ranked))
	}
}

func hosts(rs []Ranked) []string {
	out := make([]string, len(rs))
	for i, r := range rs {
		out[i] = r.Host
	}
	return out
}

func scores(rs []Ranked) map[string]float64 {
	out := map[string]float64{}
	for _, r := range rs {
		out[r.Host] = r.Score
	}
	return out
}
