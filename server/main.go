// Command kvmd runs the control API (kvmd control), a host agent (kvmd agent)
// or both in one process for a quickstart (kvmd dev).
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/kvmfleet/terraform-provider-kvm/internal/cmd"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := cmd.Run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "kvmd:", err)
		os.Exit(1)
	}
}
