// Package provider is the Terraform provider for a KVM fleet: it maps kvm_host,
// kvm_vm and the data sources onto the control API through internal/client.
package provider

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/hashicorp/terraform-plugin-framework-validators/int64validator"
	"github.com/hashicorp/terraform-plugin-framework-validators/stringvalidator"
	"github.com/hashicorp/terraform-plugin-framework/datasource"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/provider"
	"github.com/hashicorp/terraform-plugin-framework/provider/schema"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-log/tflog"

	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
)

// Environment variables read when the provider block leaves a setting out.
const (
	EnvEndpoint = "KVM_ENDPOINT"
	EnvToken    = "KVM_TOKEN"
	EnvCAFile   = "KVM_CA_FILE"
	EnvProject  = "KVM_PROJECT"
)

// Defaults of the provider settings.
const (
	defaultRequestTimeout = 2 * time.Minute
	defaultMaxRetries     = 4
	retryBackoff          = 250 * time.Millisecond
)

var _ provider.Provider = (*kvmProvider)(nil)

// Option changes how New builds the provider; tests use it to watch or break
// the HTTP traffic.
type Option func(*kvmProvider)

// WithHTTPClient makes the provider send every control API request through h.
func WithHTTPClient(h *http.Client) Option {
	return func(p *kvmProvider) { p.httpClient = h }
}

// WithGetenv replaces os.Getenv for the KVM_* environment fallbacks.
func WithGetenv(getenv func(string) string) Option {
	return func(p *kvmProvider) { p.getenv = getenv }
}

// New returns the constructor that providerserver and the acceptance tests
// call once per provider instance.
func New(version string, opts ...Option) func() provider.Provider {
	return func() provider.Provider {
		p := &kvmProvider{version: version, getenv: os.Getenv}
		for _, o := range opts {
			o(p)
		}
		return p
	}
}

type kvmProvider struct {
	version    string
	httpClient *http.Client
	getenv     func(string) string
}

type providerModel struct {
	Endpoint       types.String `tfsdk:"endpoint"`
	Token          types.String `tfsdk:"token"`
	RequestTimeout types.String `tfsdk:"request_timeout"`
	MaxRetries     types.Int64  `tfsdk:"max_retries"`
	CAFile         types.String `tfsdk:"ca_file"`
	CAPEM          types.String `tfsdk:"ca_pem"`
	Project        types.String `tfsdk:"project"`
}

func (p *kvmProvider) Metadata(_ context.Context, _ provider.MetadataRequest, resp *provider.MetadataResponse) {
	resp.TypeName = "kvm"
	resp.Version = p.version
}

func (p *kvmProvider) Schema(_ context.Context, _ provider.SchemaRequest, resp *provider.SchemaResponse) {
	resp.Schema = schema.Schema{
		MarkdownDescription: "The `kvm` provider declares hosts and virtual machines of a KVM fleet run by " +
			"`kvmd control` and places, starts, stops and deletes VMs through its control API.",
		Attributes: map[string]schema.Attribute{
			"endpoint": schema.StringAttribute{
				MarkdownDescription: "URL of the control API, for example `http://127.0.0.1:8470`. " +
					"A bare `host:port` means `http://host:port`. Falls back to the `" + EnvEndpoint + "` environment variable.",
				Optional: true,
			},
			"token": schema.StringAttribute{
				MarkdownDescription: "Bearer token of the control API (`kvmd control --token`). " +
					"Falls back to the `" + EnvToken + "` environment variable.",
				Optional:  true,
				Sensitive: true,
			},
			"request_timeout": schema.StringAttribute{
				MarkdownDescription: "Timeout of one HTTP request to the control API, as a Go duration such as `90s` or `2m`. " +
					"A create waits for its VM to boot within one request. Defaults to `2m`.",
				Optional:   true,
				Validators: []validator.String{durationValidator{}},
			},
			"ca_file": schema.StringAttribute{
				MarkdownDescription: "Path of a PEM file with the CA certificate(s) that signed the control API's TLS certificate, " +
					"for an `https://` endpoint served with a private CA. Trusted in addition to the system's CAs. " +
					"Conflicts with `ca_pem`. Falls back to the `" + EnvCAFile + "` environment variable.",
				Optional:   true,
				Validators: []validator.String{stringvalidator.ConflictsWith(path.MatchRoot("ca_pem"))},
			},
			"ca_pem": schema.StringAttribute{
				MarkdownDescription: "The same as `ca_file`, given as PEM text (for example `file(\"ca.pem\")` or a value from a secret store). " +
					"Conflicts with `ca_file`.",
				Optional: true,
			},
			"project": schema.StringAttribute{
				MarkdownDescription: "Project that the `kvm_vm`s and `kvm_network`s of this configuration are created in " +
					"(`kvm_fork` children belong to their source VM's project). Left out, the control API uses the token's " +
					"project: a project token's own, `default` for a fleet-wide token. A project token may name only its own " +
					"project; an admin token may name any. It is read at create only: changing it later moves nothing. " +
					"Falls back to the `" + EnvProject + "` environment variable.",
				Optional:   true,
				Validators: []validator.String{projectNameValidator()},
			},
			"max_retries": schema.Int64Attribute{
				MarkdownDescription: fmt.Sprintf("How often a request is retried after a connection error, a 5xx answer or "+
					"`409 in_flight`, with exponential backoff from %s. A create sends the same `Idempotency-Key` on every "+
					"retry, so a retry never makes a second VM. Defaults to `%d`.", retryBackoff, defaultMaxRetries),
				Optional:   true,
				Validators: []validator.Int64{int64validator.Between(0, 20)},
			},
		},
	}
}

func (p *kvmProvider) Configure(ctx context.Context, req provider.ConfigureRequest, resp *provider.ConfigureResponse) {
	var cfg providerModel
	resp.Diagnostics.Append(req.Config.Get(ctx, &cfg)...)
	if resp.Diagnostics.HasError() {
		return
	}

	for attr, v := range map[string]types.String{"endpoint": cfg.Endpoint, "token": cfg.Token, "request_timeout": cfg.RequestTimeout,
		"ca_file": cfg.CAFile, "ca_pem": cfg.CAPEM, "project": cfg.Project} {
		if v.IsUnknown() {
			resp.Diagnostics.AddAttributeError(path.Root(attr), summaryUnknownSetting,
				fmt.Sprintf("The provider cannot reach the control API while %q is unknown. Set it to a value known at plan time, "+
					"or set it through the environment.", attr))
		}
	}
	if cfg.MaxRetries.IsUnknown() {
		resp.Diagnostics.AddAttributeError(path.Root("max_retries"), summaryUnknownSetting,
			"The provider cannot configure its client while \"max_retries\" is unknown. Set it to a value known at plan time.")
	}
	if resp.Diagnostics.HasError() {
		return
	}

	endpoint := firstNonEmpty(cfg.Endpoint.ValueString(), p.getenv(EnvEndpoint))
	token := firstNonEmpty(cfg.Token.ValueString(), p.getenv(EnvToken))
	project := firstNonEmpty(cfg.Project.ValueString(), p.getenv(EnvProject))
	if token != "" {
		ctx = tflog.MaskMessageStrings(ctx, token)
	}

	if endpoint == "" {
		resp.Diagnostics.AddAttributeError(path.Root("endpoint"), "Missing KVM Control API Endpoint",
			"Set \"endpoint\" in the provider block or the "+EnvEndpoint+" environment variable to the URL of the control API, "+
				"for example http://127.0.0.1:8470.")
	} else if err := checkEndpoint(endpoint); err != nil {
		resp.Diagnostics.AddAttributeError(path.Root("endpoint"), "Invalid KVM Control API Endpoint",
			fmt.Sprintf("The endpoint %q is not usable: %s. Use a URL such as http://127.0.0.1:8470.", endpoint, err))
	}
	if token == "" {
		resp.Diagnostics.AddAttributeError(path.Root("token"), "Missing KVM Control API Token",
			"Set \"token\" in the provider block or the "+EnvToken+" environment variable to the bearer token of the control "+
				"API (kvmd control --token, or the token that kvmd dev prints).")
	}
	if project != "" && !projectNamePattern.MatchString(project) {
		resp.Diagnostics.AddAttributeError(path.Root("project"), "Invalid KVM Project",
			fmt.Sprintf("The project %q (project or %s) is no project name, which must be %s.", project, EnvProject, projectNameRule))
	}
	timeout := defaultRequestTimeout
	if s := cfg.RequestTimeout.ValueString(); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil || d <= 0 {
			resp.Diagnostics.AddAttributeError(path.Root("request_timeout"), "Invalid Request Timeout",
				fmt.Sprintf("%q is not a positive duration; use a value such as \"90s\" or \"2m\".", s))
		}
		timeout = d
	}
	retries := int64(defaultMaxRetries)
	if !cfg.MaxRetries.IsNull() {
		retries = cfg.MaxRetries.ValueInt64()
	}
	if resp.Diagnostics.HasError() {
		return
	}

	caFile, caPEM := cfg.CAFile.ValueString(), cfg.CAPEM.ValueString()
	caAttr := path.Root("ca_pem")
	if caPEM == "" {
		caAttr = path.Root("ca_file")
		if caFile == "" {
			caFile = p.getenv(EnvCAFile)
		}
		if caFile != "" {
			b, err := os.ReadFile(caFile)
			if err != nil {
				resp.Diagnostics.AddAttributeError(caAttr, "Unable to Read CA File",
					fmt.Sprintf("The provider could not read the CA file %q (ca_file or %s): %s. Point it at a readable PEM file "+
						"with the CA certificate that signed the control API's certificate.", caFile, EnvCAFile, err))
				return
			}
			caPEM = string(b)
		}
	}
	httpClient := p.httpClient
	if caPEM != "" {
		if httpClient != nil {
			resp.Diagnostics.AddAttributeError(caAttr, "CA Ignored",
				"This provider instance was built with its own HTTP client (a test option), which the CA setting cannot change.")
			return
		}
		var err error
		if httpClient, err = httpClientTrusting(caPEM); err != nil {
			resp.Diagnostics.AddAttributeError(caAttr, "Invalid CA Certificate",
				fmt.Sprintf("The CA setting is not usable: %s. Give one or more PEM blocks \"-----BEGIN CERTIFICATE-----\".", err))
			return
		}
	}

	opts := []client.Option{client.WithTimeout(timeout), client.WithRetries(int(retries), retryBackoff)}
	if httpClient != nil {
		opts = append(opts, client.WithHTTPClient(httpClient))
	}
	data := newProviderData(client.New(endpoint, token, opts...))
	data.project = project
	tflog.Debug(ctx, "configured the KVM control API client", map[string]any{
		"endpoint": data.client.Endpoint(), "request_timeout": timeout.String(), "max_retries": retries,
		"private_ca": caPEM != "", "project": project,
	})
	resp.DataSourceData = data
	resp.ResourceData = data
}

func (p *kvmProvider) Resources(_ context.Context) []func() resource.Resource {
	return []func() resource.Resource{
		NewHostResource,
		NewVMResource,
		NewForkResource,
		NewImageResource,
		NewNetworkResource,
		NewProjectResource,
		NewVolumeResource,
	}
}

func (p *kvmProvider) DataSources(_ context.Context) []func() datasource.DataSource {
	return []func() datasource.DataSource{
		NewHostDataSource,
		NewHostsDataSource,
		NewVMDataSource,
		NewPlacementDataSource,
		NewForkDataSource,
		NewImageDataSource,
		NewNetworkDataSource,
		NewVMConsoleDataSource,
		NewProjectDataSource,
		NewVolumeDataSource,
	}
}

// checkEndpoint accepts what client.New accepts: an http(s) URL with a host,
// or a bare host:port.
func checkEndpoint(endpoint string) error {
	raw := endpoint
	if !strings.Contains(raw, "://") {
		raw = "http://" + raw
	}
	u, err := url.Parse(raw)
	if err != nil {
		return err
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return fmt.Errorf("the scheme must be http or https, not %q", u.Scheme)
	}
	if u.Host == "" {
		return fmt.Errorf("it has no host")
	}
	if u.RawQuery != "" || u.Fragment != "" {
		return fmt.Errorf("it must not carry a query or fragment")
	}
	return nil
}

// httpClientTrusting returns an HTTP client that trusts the system's CAs
// and the PEM certificates given.
func httpClientTrusting(caPEM string) (*http.Client, error) {
	pool, err := x509.SystemCertPool()
	if err != nil {
		pool = x509.NewCertPool()
	}
	if !pool.AppendCertsFromPEM([]byte(caPEM)) {
		return nil, errors.New("it holds no PEM certificate")
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.TLSClientConfig = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	return &http.Client{Transport: tr}, nil
}

func firstNonEmpty(vals ...string) string {
	for _, v := range vals {
		if v != "" {
			return v
		}
	}
	return ""
}

// durationValidator checks that a string parses with time.ParseDuration and
// is positive.
type durationValidator struct{}

var _ validator.String = durationValidator{}

func (durationValidator) Description(context.Context) string {
	return "value must be a positive Go duration such as 90s or 2m"
}

func (v durationValidator) MarkdownDescription(ctx context.Context) string { return v.Description(ctx) }

func (durationValidator) ValidateString(_ context.Context, req validator.StringRequest, resp *validator.StringResponse) {
	if req.ConfigValue.IsNull() || req.ConfigValue.IsUnknown() {
		return
	}
	s := req.ConfigValue.ValueString()
	if d, err := time.ParseDuration(s); err != nil || d <= 0 {
		resp.Diagnostics.AddAttributeError(req.Path, "Invalid Duration",
			fmt.Sprintf("%q is not a positive duration; use a value such as \"90s\" or \"2m\".", s))
	}
}
