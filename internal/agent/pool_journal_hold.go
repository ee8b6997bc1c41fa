//go:build kvmd_faultgate

package agent

import (
	"os"
	"strings"
)

// HandoverHoldEnv, in a kvmd built with -tags kvmd_faultgate (the kill -9
// tests of internal/faulttest build it so), names a handover step (Hold*)
// and a file, "<step>:<file>": the agent creates the file when a handover
// reaches that step and then waits there forever, for the test to kill it.
// A normal build has no such variable.
const HandoverHoldEnv = "KVMD_TEST_HANDOVER_HOLD"

func handoverHookFromEnv() func(step string) {
	at, file, ok := strings.Cut(os.Getenv(HandoverHoldEnv), ":")
	if !ok || at == "" || file == "" {
		return nil
	}
	return func(step string) {
		if step != at {
			return
		}
		if err := os.WriteFile(file, []byte(step+"\n"), 0o600); err != nil {
			panic("handover hold: write " + file + ": " + err.Error())
		}
		select {}
	}
}
