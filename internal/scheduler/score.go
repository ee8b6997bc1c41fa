package scheduler

// Weights are the constants of the score. DefaultWeights are those of
// docs/guides/architecture.md.
type Weights struct {
	Memory  float64
	Disk    float64
	CPU     float64
	Balance float64 // weight of the variance of the three utilisations
	// Saturation is the constant c of s(u) = 1 / (c - u); it must exceed 1.
	Saturation float64
	// Spread is added to the score per VM of the request's group already in
	// the host's domain: fewer of the group in a domain is better.
	Spread float64
}

// DefaultWeights returns the weights of docs/guides/architecture.md.
func DefaultWeights() Weights {
	return Weights{Memory: 0.6, Disk: 0.3, CPU: 0.1, Balance: 0.5, Saturation: 1.01, Spread: 1}
}

// Terms are the weighted parts of a score; they add up to it.
type Terms struct {
	Memory  float64
	Disk    float64
	CPU     float64
	Balance float64
	// Spread is the group spread term (0 without a group).
	Spread float64
}

// Map returns the terms keyed as in the API's placement explanation; the
// spread term appears when it counts.
func (t Terms) Map() map[string]float64 {
	m := map[string]float64{"memory": t.Memory, "disk": t.Disk, "cpu": t.CPU, "balance": t.Balance}
	if t.Spread != 0 {
		m["spread"] = t.Spread
	}
	return m
}

// Score rates placing request on a host with this capacity and free space;
// lower is better. Each resource's utilisation after placement feeds a
// saturation penalty that is steep near full, and the variance of the three
// utilisations penalises stranding one resource while others are left over.
func Score(w Weights, capacity, free, request Resources) (float64, Terms) {
	uMem := utilisation(capacity.MemoryMiB, free.MemoryMiB, request.MemoryMiB)
	uDisk := utilisation(capacity.DiskMiB, free.DiskMiB, request.DiskMiB)
	uCPU := utilisation(capacity.VCPUs, free.VCPUs, request.VCPUs)
	t := Terms{
		Memory:  w.Memory * saturation(w.Saturation, uMem),
		Disk:    w.Disk * saturation(w.Saturation, uDisk),
		CPU:     w.CPU * saturation(w.Saturation, uCPU),
		Balance: w.Balance * variance(uMem, uDisk, uCPU),
	}
	return t.Memory + t.Disk + t.CPU + t.Balance, t
}

// utilisation after placing request, clamped to [0, 1]; a resource with no
// total counts as full (no information).
func utilisation(total, free, request int64) float64 {
	if total <= 0 {
		return 1
	}
	u := float64(total-free+request) / float64(total)
	return min(max(u, 0), 1)
}

func saturation(c, u float64) float64 { return 1 / (c - u) }

// variance is the population variance.
func variance(xs ...float64) float64 {
	var mean float64
	for _, x := range xs {
		mean += x
	}
	mean /= float64(len(xs))
	var v float64
	for _, x := range xs {
		v += (x - mean) * (x - mean)
	}
	return v / float64(len(xs))
}
