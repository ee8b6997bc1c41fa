package control

import (
	"context"
	"errors"

	"github.com/kvmfleet/terraform-provider-kvm/internal/store"
)

// maxForkDepth bounds the walk up a chain of forks (the agents refuse
// deeper snapshot chains anyway).
const maxForkDepth = 16

// recordAncestorSnapshotHost records host as a holder of the snapshot of
// every fork that fork f's source descends from: a child of f that starts
// on host pulls f's snapshot and, beneath it, its parents' snapshots. A
// delete of those forks then finds the copies there too.
func (s *Service) recordAncestorSnapshotHost(ctx context.Context, f store.Fork, host string) error {
	vmID := f.SourceVMID
	for range maxForkDepth {
		vm, err := s.store.GetVM(ctx, vmID)
		if errors.Is(err, store.ErrNotFound) || (err == nil && vm.ForkID == nil) {
			return nil
		}
		if err != nil {
			return err
		}
		parent := *vm.ForkID
		if err := s.store.AddForkSnapshotHost(ctx, parent, host); err != nil {
			if errors.Is(err, store.ErrNotFound) {
				return nil
			}
			return err
		}
		pf, err := s.store.GetFork(ctx, parent)
		if errors.Is(err, store.ErrNotFound) {
			return nil
		}
		if err != nil {
			return err
		}
		vmID = pf.SourceVMID
	}
	return nil
}
