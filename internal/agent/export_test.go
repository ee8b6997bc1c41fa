package agent

// SetVolumeHook makes New's agent call hook once a new volume's files are
// complete, before they are renamed into place: a test kills the agent
// there.
func SetVolumeHook(c *Config, hook func(id string) error) { c.volumeHook = hook }

// SetHandoverHook makes New's agent call hook at each step of a warm
// handover (agent.Hold*).
func SetHandoverHook(c *Config, hook func(step string)) { c.handoverHook = hook }
