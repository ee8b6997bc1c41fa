// Command terraform-provider-kvm is the Terraform provider for a KVM fleet run
// by kvmd. Terraform starts it; everything it does lives in internal/provider.
package main

import (
	"context"
	"flag"
	"log"

	"github.com/hashicorp/terraform-plugin-framework/providerserver"

	"github.com/kvmfleet/terraform-provider-kvm/internal/provider"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func main() {
	var debug bool
	flag.BoolVar(&debug, "debug", false, "start the provider with support for debuggers like delve")
	flag.Parse()
	provider.SilenceUnreadSDKLogs()
	provider.TuneGC()
	stopProfile := provider.StartCPUProfile()

	err := providerserver.Serve(context.Background(), provider.New(version), providerserver.ServeOpts{
		Address: "registry.terraform.io/kvmfleet/kvm",
		Debug:   debug,
	})
	stopProfile()
	if err != nil {
		log.Fatal(err.Error())
	}
}
