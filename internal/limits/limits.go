// Package limits holds the bounds of one VM that the control API and the
// host agent both enforce, so that a request the control API accepts (and
// reserves capacity for) is never refused by the agent for its size.
// It imports nothing, so every layer may use it.
package limits

// Bounds of one VM.
const (
	// MaxVCPUs is the most vCPUs of one VM: QEMU's q35 machine type with
	// the default (non x2APIC-only) setup tops out at 255.
	MaxVCPUs = 255
	// MaxMemoryMiB is the most memory of one VM (16 TiB).
	MaxMemoryMiB = 16 << 20
	// MaxDiskMiB is the largest disk of one VM (64 TiB).
	MaxDiskMiB = 64 << 20
)
