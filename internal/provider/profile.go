package provider

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime/pprof"
)

// EnvCPUProfile names a folder: a provider process started with it set
// writes a CPU profile of its whole life there, as
// <binary>.<pid>.pprof (Terraform starts several provider processes per
// command). For measuring (bench/terraform_plan); unset, nothing happens.
const EnvCPUProfile = "KVM_PROVIDER_CPUPROFILE"

// StartCPUProfile starts the CPU profile EnvCPUProfile asks for and returns
// the function that ends it, to call when the provider has served; a
// profile that cannot start is reported on stderr (which Terraform logs) and
// the provider runs on without it.
func StartCPUProfile() (stop func()) {
	dir := os.Getenv(EnvCPUProfile)
	if dir == "" {
		return func() {}
	}
	name := filepath.Join(dir, fmt.Sprintf("%s.%d.pprof", filepath.Base(os.Args[0]), os.Getpid()))
	f, err := os.Create(name)
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: cannot write the CPU profile: %v\n", EnvCPUProfile, err)
		return func() {}
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		fmt.Fprintf(os.Stderr, "%s: cannot start the CPU profile %s: %v\n", EnvCPUProfile, name, err)
		_ = f.Close()
		return func() {}
	}
	return func() {
		pprof.StopCPUProfile()
		if err := f.Close(); err != nil {
			fmt.Fprintf(os.Stderr, "%s: writing the CPU profile %s: %v\n", EnvCPUProfile, name, err)
		}
	}
}
