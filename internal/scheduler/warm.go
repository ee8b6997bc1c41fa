package scheduler

// DefaultWarmMargin is how close a score must be to the best one for a host
// with a matching warm VM to win: within 10% of the best score.
const DefaultWarmMargin = 0.10

// PreferWarm applies the warm pool preference to a ranking (best first).
//
// A host whose score is within margin of the best, that is
// score <= best x (1 + margin), and that has a ready warm VM of the
// request's image and shape (warm[host] > 0) wins over a better-scored host
// without one: a warm start takes milliseconds instead of a boot, which is
// worth a slightly worse fit. Outside the margin the score decides as
// usual. Among several warm hosts within the margin the best-scored one
// wins. Scores are positive (s(u) >= 1/c), so the relative margin is well
// defined; margin <= 0 turns the preference off.
//
// warm holds, per host name, how many matching warm VMs are ready; the
// caller computes it from the hosts' reports, so this stays pure. Every
// ranked entry gets its WarmReady; the moved host gets WarmPreferred. It
// reports whether the preference changed the winner.
func PreferWarm(res Result, margin float64, warm map[string]int) (Result, bool) {
	if len(res.Ranked) == 0 || len(warm) == 0 {
		return res, false
	}
	ranked := make([]Ranked, len(res.Ranked))
	copy(ranked, res.Ranked)
	for i := range ranked {
		ranked[i].WarmReady = max(warm[ranked[i].Host], 0)
	}
	res.Ranked = ranked
	if margin <= 0 || ranked[0].WarmReady > 0 {
		return res, false
	}
	limit := ranked[0].Score * (1 + margin)
	for i := 1; i < len(ranked) && ranked[i].Score <= limit; i++ {
		if ranked[i].WarmReady == 0 {
			continue
		}
		chosen := ranked[i]
		chosen.WarmPreferred = true
		copy(ranked[1:i+1], ranked[0:i])
		ranked[0] = chosen
		return res, true
	}
	return res, false
}
