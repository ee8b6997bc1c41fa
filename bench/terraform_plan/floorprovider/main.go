// Command floorprovider is a do-nothing Terraform provider with kvm_vm's
// schema: the floor that bench/terraform_plan measures kvm_vm against. What
// terraform core and the plugin machinery cost over that schema, with no
// provider work at all, bounds how close kvm_vm can get to terraform_data.
//
// The name of the binary chooses the mode, so one build serves both (with
// dev_overrides Terraform finds a provider by its binary name anyway):
//
//	terraform-provider-floorfw   terraform-plugin-framework, resource floorfw_vm
//	terraform-provider-floorraw  terraform-plugin-go's tfprotov6, no framework, resource floorraw_vm
//
// Neither takes provider configuration.
package main

import (
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"strings"

	"github.com/hashicorp/terraform-plugin-framework/providerserver"
	"github.com/hashicorp/terraform-plugin-go/tfprotov6"
	"github.com/hashicorp/terraform-plugin-go/tfprotov6/tf6server"

	kvmprovider "github.com/kvmfleet/terraform-provider-kvm/internal/provider"
)

const (
	modeFramework = "floorfw"
	modeRaw       = "floorraw"
)

func main() {
	if err := run(context.Background(), os.Args[0]); err != nil {
		log.Fatal(err)
	}
}

func run(ctx context.Context, argv0 string) error {
	mode := strings.TrimPrefix(filepath.Base(argv0), "terraform-provider-")
	// The process settings of terraform-provider-kvm (provider/main.go), so
	// that what kvm_vm costs beyond floorfw_vm is the provider's own work.
	kvmprovider.SilenceUnreadSDKLogs()
	kvmprovider.TuneGC()
	defer kvmprovider.StartCPUProfile()()

	// The framework provider is also the raw mode's source of its schema.
	framework := providerserver.NewProtocol6(&floorProvider{typeName: mode})
	var server func() tfprotov6.ProviderServer
	switch mode {
	case modeFramework:
		server = framework
	case modeRaw:
		raw, err := newRawServer(ctx, framework(), mode+"_vm")
		if err != nil {
			return err
		}
		server = func() tfprotov6.ProviderServer { return raw }
	default:
		return fmt.Errorf("binary name %q: want terraform-provider-%s or terraform-provider-%s", argv0, modeFramework, modeRaw)
	}
	return tf6server.Serve("registry.terraform.io/kvmfleet/"+mode, server)
}
