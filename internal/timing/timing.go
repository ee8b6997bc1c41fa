// Package timing records how long the steps of one request take, carried
// in its context, and writes and reads them as a Server-Timing header: the
// control API and the agent answer a create's steps that way, and the
// clients fold the steps of the calls they make into their own request's,
// so a caller sees where the time went without a profiler.
package timing

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Step is one timed step of a request.
type Step struct {
	Name     string
	Duration time.Duration
}

// Recorder collects the steps of one request.
type Recorder struct {
	mu    sync.Mutex
	steps []Step
}

type key struct{}

// NewContext returns a context whose steps go to the returned Recorder.
func NewContext(ctx context.Context) (context.Context, *Recorder) {
	r := &Recorder{}
	return context.WithValue(ctx, key{}, r), r
}

// FromContext is the Recorder of ctx, nil when it has none.
func FromContext(ctx context.Context) *Recorder {
	r, _ := ctx.Value(key{}).(*Recorder)
	return r
}

// Since records step name of the request in ctx as lasting from start
// until now, and returns now (the next step's start). Without a Recorder
// in ctx it only returns now.
func Since(ctx context.Context, name string, start time.Time) time.Time {
	now := time.Now()
	if r := FromContext(ctx); r != nil {
		r.Add(name, now.Sub(start))
	}
	return now
}

// Add records a step that took d.
func (r *Recorder) Add(name string, d time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.steps = append(r.steps, Step{Name: name, Duration: d})
}

// Steps returns the recorded steps in order.
func (r *Recorder) Steps() []Step {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Step(nil), r.steps...)
}

// Header is the steps as a Server-Timing header value:
// name;dur=milliseconds, in order.
func (r *Recorder) Header() string {
	var b strings.Builder
	for i, st := range r.Steps() {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString(st.Name)
		b.WriteString(";dur=")
		b.WriteString(strconv.FormatFloat(float64(st.Duration.Microseconds())/1000, 'f', 3, 64))
	}
	return b.String()
}

// Parse reads the steps of a Server-Timing header value written by Header
// (entries without a duration are left out).
func Parse(header string) []Step {
	var steps []Step
	for part := range strings.SplitSeq(header, ",") {
		name, dur, ok := strings.Cut(strings.TrimSpace(part), ";dur=")
		if !ok || name == "" {
			continue
		}
		ms, err := strconv.ParseFloat(dur, 64)
		if err != nil {
			continue
		}
		steps = append(steps, Step{Name: name, Duration: time.Duration(ms * float64(time.Millisecond))})
	}
	return steps
}
