package provider_test

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/provider"
)

// TestAccVM_foreign404KeepsState: a refresh through an endpoint that answers
// 404 without the control API's own not_found error (a wrong path prefix, a
// proxy's HTML page) is an error, and the VM stays in state.
func TestAccVM_foreign404KeepsState(t *testing.T) {
	f := newFleet(t, "h1")
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/html")
		w.WriteHeader(http.StatusNotFound)
		_, _ = w.Write([]byte("<html><body><h1>404 Not Found</h1></body></html>"))
	}))
	t.Cleanup(proxy.Close)
	good := vmConfig(f, "keep-1", "sim", 1, "")
	withEndpoint := func(endpoint string) string {
		return strings.Replace(good, `"`+f.Control.URL+`"`, `"`+endpoint+`"`, 1)
	}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{Config: good},
			{
				Config:      withEndpoint(f.Control.URL + "/prefix"),
				PlanOnly:    true,
				ExpectError: regexp.MustCompile(`Unable to Read VM`),
			},
			{
				Config:      withEndpoint(proxy.URL),
				PlanOnly:    true,
				ExpectError: regexp.MustCompile(`Unable to Read VM`),
			},
			{
				// Still in state: the right endpoint plans nothing.
				Config: good,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionNoop)},
				},
			},
		},
	})
}

// testCA is a private CA and a server certificate it signed for 127.0.0.1.
type testCA struct {
	pem    string // the CA certificate, PEM
	server tls.Certificate
}

func newTestCA(t *testing.T) testCA {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kvm test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	caCert, err := x509.ParseCertificate(caDER)
	if err != nil {
		t.Fatal(err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "kvmd control"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		KeyUsage:    x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	return testCA{
		pem:    string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER})),
		server: tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key},
	}
}

// TestAccProvider_privateCA: the control API served over TLS with a
// certificate from a private CA is reachable with ca_file, ca_pem or
// KVM_CA_FILE, and refused (unknown authority) without them.
func TestAccProvider_privateCA(t *testing.T) {
	f := newFleet(t, "h1")
	ca := newTestCA(t)
	target, err := url.Parse(f.Control.URL)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewUnstartedServer(httputil.NewSingleHostReverseProxy(target))
	srv.TLS = &tls.Config{Certificates: []tls.Certificate{ca.server}, MinVersion: tls.VersionTLS12}
	srv.StartTLS()
	t.Cleanup(srv.Close)
	caFile := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(caFile, []byte(ca.pem), 0o600); err != nil {
		t.Fatal(err)
	}
	config := func(caSettings string) string {
		return fmt.Sprintf(`
provider "kvm" {
  endpoint    = %q
  token       = %q
  max_retries = 1
%s
}

resource "kvm_vm" "test" {
  name       = "tls-1"
  image      = "sim"
  vcpus      = 1
  memory_mib = 512
  disk_mib   = 2048
}
`, srv.URL, f.Control.Token, caSettings)
	}
	withEnvCA := factories(provider.WithGetenv(func(k string) string {
		if k == provider.EnvCAFile {
			return caFile
		}
		return ""
	}))
	steps := []resource.TestStep{
		{
			Config: config(fmt.Sprintf("  ca_file = %q", caFile)),
			ConfigPlanChecks: resource.ConfigPlanChecks{
				PreApply:             []plancheck.PlanCheck{plancheck.ExpectResourceAction(vmAddr, plancheck.ResourceActionCreate)},
				PostApplyPostRefresh: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
			},
		},
		{
			Config:   config("  ca_pem = <<-EOT\n" + ca.pem + "  EOT"),
			PlanOnly: true,
		},
		{
			ProtoV6ProviderFactories: withEnvCA,
			Config:                   config(""),
			PlanOnly:                 true,
		},
		{
			Config:      config(""),
			PlanOnly:    true,
			ExpectError: regexp.MustCompile(`certificate signed by unknown authority`),
		},
		{
			Config:      config(`  ca_pem = "not a certificate"`),
			PlanOnly:    true,
			ExpectError: regexp.MustCompile(`Invalid CA Certificate`),
		},
		{
			Config:      config(fmt.Sprintf("  ca_file = %q\n  ca_pem = %q", caFile, ca.pem)),
			PlanOnly:    true,
			ExpectError: regexp.MustCompile(`(?s)Invalid Attribute Combination`),
		},
		{
			Config:      config(fmt.Sprintf("  ca_file = %q", caFile+".missing")),
			PlanOnly:    true,
			ExpectError: regexp.MustCompile(`Unable to Read CA File`),
		},
		{
			// Destroy needs a working provider configuration.
			Config: config(fmt.Sprintf("  ca_file = %q", caFile)),
		},
	}
	// Providers are given per step (the KVM_CA_FILE step has its own).
	for i := range steps {
		if steps[i].ProtoV6ProviderFactories == nil {
			steps[i].ProtoV6ProviderFactories = factories()
		}
	}
	resource.Test(t, resource.TestCase{CheckDestroy: f.checkFleetEmpty, Steps: steps})
}

// TestAccProvider_scopedToken: the provider works unchanged with a token
// from the database; a user-scoped token manages VMs, and registering a
// host with it fails with 403 and says which scope is needed.
func TestAccProvider_scopedToken(t *testing.T) {
	f := newFleet(t, "h1")
	tok, err := f.Control.Client.CreateToken(ctxT(t), api.TokenCreate{Name: "tf-user", Scopes: []string{api.ScopeUser}})
	if err != nil {
		t.Fatal(err)
	}
	block := strings.Replace(f.providerBlock(), `"`+f.Control.Token+`"`, `"`+tok.Secret+`"`, 1)
	vm := `
resource "kvm_vm" "test" {
  name       = "scoped-1"
  image      = "sim"
  vcpus      = 1
  memory_mib = 512
  disk_mib   = 2048
}
`
	a := f.startAgent(t)
	host := fmt.Sprintf(`
resource "kvm_host" "extra" {
  name    = "h2"
  address = %q
}
`, a.Address)
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: factories(),
		CheckDestroy:             f.checkFleetEmpty,
		Steps: []resource.TestStep{
			{
				Config: block + vm,
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(vmAddr, tfjsonpath.New("observed_state"), knownvalue.StringExact("running")),
				},
			},
			{
				Config:      block + vm + host,
				ExpectError: regexp.MustCompile(`(?s)Unable to Register Host.*scope.*admin`),
			},
			{Config: block + vm},
		},
	})
}
