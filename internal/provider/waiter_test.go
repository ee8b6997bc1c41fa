package provider

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
)

// scripted is a refresh that reports the given states in turn, then the last
// one for ever, and counts its calls.
type scripted struct {
	states []string
	calls  int
}

func (s *scripted) refresh(context.Context) (int, string, error) {
	i := min(s.calls, len(s.states)-1)
	s.calls++
	return s.calls, s.states[i], nil
}

func testChange(s *scripted) stateChange[int] {
	return stateChange[int]{
		Pending: []string{"creating", "booting"},
		Target:  []string{"running"},
		Refresh: s.refresh,
		Unexpected: func(n int, state string) error {
			return fmt.Errorf("read %d reports %s", n, state)
		},
		TimedOut: func(n int, state string, err error) error {
			return fmt.Errorf("still %s after read %d: %w", state, n, err)
		},
		MaxInterval: time.Millisecond,
	}
}

func TestStateChangeWaitsThroughPendingToTarget(t *testing.T) {
	s := &scripted{states: []string{"creating", "booting", "booting", "running"}}
	n, err := testChange(s).wait(context.Background())
	if err != nil {
		t.Fatalf("wait: %v", err)
	}
	if n != 4 || s.calls != 4 {
		t.Fatalf("returned read %d after %d reads, want the 4th read after 4", n, s.calls)
	}
}

func TestStateChangeFromATargetReadsNothing(t *testing.T) {
	s := &scripted{states: []string{"creating"}}
	n, err := testChange(s).waitFrom(context.Background(), 7, "running")
	if err != nil || n != 7 || s.calls != 0 {
		t.Fatalf("waitFrom a target: got %d, %v after %d reads; want the object in hand, no error, no read", n, err, s.calls)
	}
}

func TestStateChangeStopsAtAnUnexpectedState(t *testing.T) {
	s := &scripted{states: []string{"creating", "error", "running"}}
	_, err := testChange(s).wait(context.Background())
	if err == nil || err.Error() != "read 2 reports error" {
		t.Fatalf("wait through an error state: got %v, want the Unexpected error of read 2", err)
	}
}

func TestStateChangeTimeoutNamesTheLastState(t *testing.T) {
	s := &scripted{states: []string{"creating", "booting"}}
	ctx, cancel := context.WithCancel(context.Background())
	c := testChange(s)
	refresh := c.Refresh
	c.Refresh = func(ctx context.Context) (int, string, error) {
		n, state, err := refresh(ctx)
		if n == 5 {
			cancel()
		}
		return n, state, err
	}
	_, err := c.wait(ctx)
	if !errors.Is(err, context.Canceled) || !strings.HasPrefix(err.Error(), "still booting after read 5") {
		t.Fatalf("wait past its context: got %v, want TimedOut's error for read 5 wrapping context.Canceled", err)
	}
}

func TestStateChangeRefreshErrorEndsTheWait(t *testing.T) {
	boom := errors.New("control API down")
	c := testChange(&scripted{states: []string{"creating"}})
	c.Refresh = func(context.Context) (int, string, error) { return 0, "", boom }
	if _, err := c.waitFrom(context.Background(), 1, "creating"); !errors.Is(err, boom) {
		t.Fatalf("wait with a failing read: got %v, want the read's error", err)
	}
}
