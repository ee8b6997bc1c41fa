package release_test

import (
	"archive/zip"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

const version = "0.1.0"

func repoRoot(t *testing.T) string {
	t.Helper()
	_, file, _, _ := runtime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
}

// run runs a command and fails the test with its output when it fails.
func run(t *testing.T, ctx context.Context, dir string, env []string, name string, args ...string) string {
	t.Helper()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir, cmd.Env = dir, env
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// TestReleaseInstallsFromAFilesystemMirror builds a release of this
// machine's platform with scripts/release.sh (what make release runs),
// checks the zip layout and the checksums, then has the CLI (terraform, or
// tofu: TF_ACC_TERRAFORM_PATH, see testenv.FindCLI) install the provider from the release's filesystem mirror (no
// dev_overrides, no network: the CLI config allows the mirror only) and
// plan examples/quickstart against a control API with a sim host.
func TestReleaseInstallsFromAFilesystemMirror(t *testing.T) {
	if os.Getenv("TF_ACC") == "" {
		t.Skip("acceptance test: set TF_ACC=1 (make test does) to run it with the terraform CLI")
	}
	cli, err := testenv.FindCLI()
	if err != nil {
		t.Skip(err.Error())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	root := repoRoot(t)
	dist := filepath.Join(t.TempDir(), "dist")
	platform := "linux_" + runtime.GOARCH
	env := append(os.Environ(), "RELEASE_PLATFORMS=linux/"+runtime.GOARCH)
	run(t, ctx, root, env, "bash", filepath.Join(root, "scripts", "release.sh"), version, dist)

	// The zip: one file, terraform-provider-kvm_v<version>, executable.
	zipName := "terraform-provider-kvm_" + version + "_" + platform + ".zip"
	zr, err := zip.OpenReader(filepath.Join(dist, zipName))
	if err != nil {
		t.Fatalf("open %s: %v", zipName, err)
	}
	if len(zr.File) != 1 || zr.File[0].Name != "terraform-provider-kvm_v"+version || zr.File[0].Mode()&0o111 == 0 {
		var names []string
		for _, f := range zr.File {
			names = append(names, f.Name+" "+f.Mode().String())
		}
		t.Errorf("%s holds %v, want the one executable terraform-provider-kvm_v%s", zipName, names, version)
	}
	_ = zr.Close()

	// The checksums cover the zip and the manifest and match them.
	sums, err := os.ReadFile(filepath.Join(dist, "terraform-provider-kvm_"+version+"_SHA256SUMS"))
	if err != nil {
		t.Fatal(err)
	}
	checked := 0
	for _, line := range strings.Split(strings.TrimSpace(string(sums)), "\n") {
		sum, name, ok := strings.Cut(line, "  ")
		if !ok {
			t.Fatalf("SHA256SUMS line %q is not '<sum>  <file>'", line)
		}
		b, err := os.ReadFile(filepath.Join(dist, name))
		if err != nil {
			t.Fatalf("SHA256SUMS names %s: %v", name, err)
		}
		if got := sha256.Sum256(b); hex.EncodeToString(got[:]) != sum {
			t.Errorf("%s: sha256 %x, SHA256SUMS says %s", name, got, sum)
		}
		checked++
	}
	if !bytes.Contains(sums, []byte(zipName)) || !bytes.Contains(sums, []byte("_manifest.json")) || checked != 2 {
		t.Errorf("SHA256SUMS:\n%s\nwant the zip and the manifest", sums)
	}
	kvmdSums, err := os.ReadFile(filepath.Join(dist, "kvmd_"+version+"_SHA256SUMS"))
	if err != nil || !bytes.Contains(kvmdSums, []byte("kvmd_"+version+"_"+platform+".tar.gz")) {
		t.Errorf("kvmd checksums: %v\n%s", err, kvmdSums)
	}

	// init from the mirror alone, under the address the CLI resolves
	// kvmfleet/kvm to.
	work := t.TempDir()
	cliConfig := filepath.Join(work, "terraformrc")
	mirror := filepath.Join(dist, "mirror")
	if err := os.WriteFile(cliConfig, []byte(`provider_installation {
  filesystem_mirror {
    path    = "`+mirror+`"
    include = ["`+cli.ProviderAddress()+`"]
  }
}
`), 0o600); err != nil {
		t.Fatal(err)
	}
	main, err := os.ReadFile(filepath.Join(root, "examples", "quickstart", "main.tf"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(work, "main.tf"), main, 0o600); err != nil {
		t.Fatal(err)
	}
	c := testenv.StartControl(t, testenv.ControlOptions{})
	c.RegisterHost(t, "local", testenv.StartAgent(t, testenv.AgentOptions{}).Address)
	var tfEnv []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "TF_") || strings.HasPrefix(kv, "KVM_") {
			continue // no dev_overrides, reattach or plugin cache from outside
		}
		tfEnv = append(tfEnv, kv)
	}
	tfEnv = append(tfEnv, "TF_CLI_CONFIG_FILE="+cliConfig, "TF_IN_AUTOMATION=1", "CHECKPOINT_DISABLE=1", "HOME="+work,
		"KVM_ENDPOINT="+c.URL, "KVM_TOKEN="+c.Token)
	out := run(t, ctx, work, tfEnv, cli.Path, "init", "-input=false", "-no-color")
	if !strings.Contains(out, "Installed kvmfleet/kvm v"+version) {
		t.Errorf("%s init did not install kvmfleet/kvm v%s from the mirror:\n%s", cli.Product, version, out)
	}
	if strings.Contains(out, "dev_overrides") || strings.Contains(out, "Provider development overrides") {
		t.Errorf("%s init used dev_overrides:\n%s", cli.Product, out)
	}
	lock, err := os.ReadFile(filepath.Join(work, ".terraform.lock.hcl"))
	if err != nil || !bytes.Contains(lock, []byte(`provider "`+cli.ProviderAddress()+`"`)) ||
		!bytes.Contains(lock, []byte(`version = "`+version+`"`)) {
		t.Errorf("lock file: %v\n%s", err, lock)
	}

	// terraform plan of the quickstart: two demo VMs and the cloud-init guest to add (exit code 2).
	cmd := exec.CommandContext(ctx, cli.Path, "plan", "-input=false", "-no-color", "-detailed-exitcode", "-var", "image=sim")
	cmd.Dir, cmd.Env = work, tfEnv
	plan, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if err == nil || !errors.As(err, &exit) || exit.ExitCode() != 2 {
		t.Fatalf("%s plan: %v (want exit status 2: changes)\n%s", cli.Product, err, plan)
	}
	for _, want := range []string{"kvm_vm.demo[0] will be created", "kvm_vm.demo[1] will be created", "kvm_vm.guest will be created", "Plan: 3 to add, 0 to change, 0 to destroy"} {
		if !bytes.Contains(plan, []byte(want)) {
			t.Errorf("%s plan lacks %q:\n%s", cli.Product, want, plan)
		}
	}
}
