package control

import (
	"context"
	"fmt"
	"log/slog"
)

// cleanup is the undo chain of a multi-step operation: each step that
// succeeds pushes its undo; on failure the undos run last-in first-out,
// once. An undo that fails stops the chain, because the earlier undos may
// depend on it (capacity is never released before the agent confirmed the
// VM is deleted).
type cleanup struct {
	log   *slog.Logger
	steps []cleanupStep
	done  bool
}

type cleanupStep struct {
	name string
	undo func(context.Context) error
}

func (c *cleanup) push(name string, undo func(context.Context) error) {
	c.steps = append(c.steps, cleanupStep{name: name, undo: undo})
}

// commit discards the undos: the operation succeeded.
func (c *cleanup) commit() { c.done = true }

// run undoes the pushed steps in reverse order; it does nothing after
// commit or a previous run.
func (c *cleanup) run(ctx context.Context) error {
	if c.done {
		return nil
	}
	c.done = true
	for i := len(c.steps) - 1; i >= 0; i-- {
		s := c.steps[i]
		if err := s.undo(ctx); err != nil {
			c.log.Error("cleanup step failed; the steps before it are kept", "step", s.name, "err", err)
			return fmt.Errorf("undo %s: %w", s.name, err)
		}
	}
	return nil
}
