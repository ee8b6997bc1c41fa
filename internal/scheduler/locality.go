package scheduler

// DefaultImageMargin is how much worse (relative) a host's score may be
// than the best one for a host that already holds the image to be chosen
// over it: a fetch costs more than a slightly fuller host.
const DefaultImageMargin = 0.10

// PreferImageLocal marks the ranked hosts that hold the request's image
// (holds, a fact the caller gathered about the hosts) and, when the best
// host does not hold it, moves first the best-scored host that does and
// whose score is within margin of the best. It reports whether it
// reordered. The order is otherwise kept, so ties stay deterministic.
func PreferImageLocal(res Result, margin float64, holds map[string]bool) (Result, bool) {
	if len(res.Ranked) == 0 || len(holds) == 0 {
		return res, false
	}
	ranked := make([]Ranked, len(res.Ranked))
	copy(ranked, res.Ranked)
	for i := range ranked {
		ranked[i].ImageLocal = holds[ranked[i].Host]
	}
	res.Ranked = ranked
	if margin < 0 || ranked[0].ImageLocal {
		return res, false
	}
	limit := ranked[0].Score * (1 + margin)
	for i := 1; i < len(ranked) && ranked[i].Score <= limit; i++ {
		if !ranked[i].ImageLocal {
			continue
		}
		chosen := ranked[i]
		chosen.ImagePreferred = true
		copy(ranked[1:i+1], ranked[0:i])
		ranked[0] = chosen
		return res, true
	}
	return res, false
}
