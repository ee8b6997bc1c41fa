package provider

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/hashicorp/terraform-plugin-framework-validators/int64validator"
	"github.com/hashicorp/terraform-plugin-framework-validators/stringvalidator"
	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/datasource"
	"github.com/hashicorp/terraform-plugin-framework/datasource/schema"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/types"

	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/client"
)

var (
	_ datasource.DataSource              = (*placementDataSource)(nil)
	_ datasource.DataSourceWithConfigure = (*placementDataSource)(nil)
)

// NewPlacementDataSource is the kvm_placement data source.
func NewPlacementDataSource() datasource.DataSource { return &placementDataSource{} }

type placementDataSource struct {
	data *providerData
}

type placementDataModel struct {
	Image      types.String     `tfsdk:"image"`
	VCPUs      types.Int64      `tfsdk:"vcpus"`
	MemoryMiB  types.Int64      `tfsdk:"memory_mib"`
	DiskMiB    types.Int64      `tfsdk:"disk_mib"`
	Host       types.String     `tfsdk:"host"`
	Networks   []types.String   `tfsdk:"networks"`
	Volumes    []types.String   `tfsdk:"volumes"`
	Fits       types.Bool       `tfsdk:"fits"`
	ChosenHost types.String     `tfsdk:"chosen_host"`
	Score      types.Float64    `tfsdk:"score"`
	Ranked     []rankedHostData `tfsdk:"ranked"`
	Rejected   []rejectionData  `tfsdk:"rejected"`
	Note       types.String     `tfsdk:"note"`
	// Constraints is the constraints block (null when absent).
	Constraints types.Object `tfsdk:"constraints"`
}

type rankedHostData struct {
	Host  types.String  `tfsdk:"host"`
	Score types.Float64 `tfsdk:"score"`
	Terms types.Map     `tfsdk:"terms"`
	// WarmReady: ready warm VMs of the request's image and shape.
	WarmReady types.Int64 `tfsdk:"warm_ready"`
}

type rejectionData struct {
	Host   types.String `tfsdk:"host"`
	Reason types.String `tfsdk:"reason"`
	Detail types.String `tfsdk:"detail"`
}

func (d *placementDataSource) Metadata(_ context.Context, req datasource.MetadataRequest, resp *datasource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_placement"
}

func (d *placementDataSource) Schema(_ context.Context, _ datasource.SchemaRequest, resp *datasource.SchemaResponse) {
	shape := func(description string) schema.Int64Attribute {
		return schema.Int64Attribute{
			MarkdownDescription: description,
			Required:            true,
			Validators:          []validator.Int64{int64validator.AtLeast(1)},
		}
	}
	resp.Schema = schema.Schema{
		MarkdownDescription: "A placement dry run: which host a VM of this shape would get now, the score of every host " +
			"that fits, and why each other host was rejected. It reserves nothing.",
		Attributes: map[string]schema.Attribute{
			"image": schema.StringAttribute{
				MarkdownDescription: "Guest image of the VM.",
				Required:            true,
				Validators:          []validator.String{stringvalidator.LengthAtLeast(1)},
			},
			"vcpus":      shape("Number of virtual CPUs."),
			"memory_mib": shape("Memory in MiB."),
			"disk_mib":   shape("Disk size in MiB."),
			"host": schema.StringAttribute{
				MarkdownDescription: "Consider only this host, as a `kvm_vm` pinned to it would.",
				Optional:            true,
				Validators:          []validator.String{stringvalidator.LengthAtLeast(1)},
			},
			"networks": schema.ListAttribute{
				MarkdownDescription: "Networks of the VM's NICs, in order, as its `network_interface` blocks name them; " +
					"omitted, one NIC on `default` as a `kvm_vm` without blocks. Hosts a network is not on are rejected " +
					"(`network`), and a network with no free address fails the read with `no_address`, as a create would.",
				ElementType: types.StringType,
				Optional:    true,
			},
			"volumes": schema.ListAttribute{
				MarkdownDescription: "Volumes (names or IDs) the VM would attach: every host but theirs is rejected " +
					"(`volume`), as a create would.",
				ElementType: types.StringType,
				Optional:    true,
			},
			"fits": schema.BoolAttribute{
				MarkdownDescription: "Whether any host can take the VM now.",
				Computed:            true,
			},
			"chosen_host": schema.StringAttribute{
				MarkdownDescription: "The host the VM would be placed on; null when none fits.",
				Computed:            true,
			},
			"score": schema.Float64Attribute{
				MarkdownDescription: "Score of the chosen host (lower is better); null when none fits.",
				Computed:            true,
			},
			"ranked": schema.ListNestedAttribute{
				MarkdownDescription: "Every host that fits, best first.",
				Computed:            true,
				NestedObject: schema.NestedAttributeObject{Attributes: map[string]schema.Attribute{
					"host":  schema.StringAttribute{MarkdownDescription: "Name of the host.", Computed: true},
					"score": schema.Float64Attribute{MarkdownDescription: "Its score (lower is better).", Computed: true},
					"terms": schema.MapAttribute{
						MarkdownDescription: "The terms the score adds up, by name.",
						ElementType:         types.Float64Type,
						Computed:            true,
					},
					"warm_ready": schema.Int64Attribute{
						MarkdownDescription: "How many warm VMs of this image and shape the host has ready (see `warm_pool` on `kvm_host`).",
						Computed:            true,
					},
				}},
			},
			"note": schema.StringAttribute{
				MarkdownDescription: "Set when something besides the score decided: a host whose score is within 10% of " +
					"the best wins when it has a ready warm VM of this image and shape and the best has none, or, for a " +
					"registered image (`kvm_image`), when it already holds the image and the best would have to fetch it. " +
					"For a registered image it also says whether the chosen host holds it.",
				Computed: true,
			},
			"rejected": schema.ListNestedAttribute{
				MarkdownDescription: "Every host that cannot take the VM, sorted by name, with the reason.",
				Computed:            true,
				NestedObject: schema.NestedAttributeObject{Attributes: map[string]schema.Attribute{
					"host": schema.StringAttribute{MarkdownDescription: "Name of the host.", Computed: true},
					"reason": schema.StringAttribute{
						MarkdownDescription: "Why it was rejected, the first filter it failed: `not_alive`, `unschedulable`, " +
							"`no_image`, `volume` (the volumes are on another host), `network` (a `network_interface`'s network is not on the host), `labels` (`host_labels` or the spread label), `group_cap` (`max_per_domain`), " +
							"`memory`, `cpu`, `disk`, or `not_pinned` (more may be added).",
						Computed: true,
					},
					"detail": schema.StringAttribute{
						MarkdownDescription: "The particulars, for example `memory: needs 4096 MiB, 2048 free`.",
						Computed:            true,
					},
				}},
			},
		},
		Blocks: map[string]schema.Block{"constraints": constraintsDataBlock()},
	}
}

func (d *placementDataSource) Configure(_ context.Context, req datasource.ConfigureRequest, resp *datasource.ConfigureResponse) {
	d.data = providerDataFrom(req.ProviderData, &resp.Diagnostics)
}

func (d *placementDataSource) Read(ctx context.Context, req datasource.ReadRequest, resp *datasource.ReadResponse) {
	var cfg placementDataModel
	resp.Diagnostics.Append(req.Config.Get(ctx, &cfg)...)
	if resp.Diagnostics.HasError() {
		return
	}
	in := api.PlacementRequest{
		Image:     cfg.Image.ValueString(),
		VCPUs:     cfg.VCPUs.ValueInt64(),
		MemoryMiB: cfg.MemoryMiB.ValueInt64(),
		DiskMiB:   cfg.DiskMiB.ValueInt64(),
		Host:      cfg.Host.ValueString(),
	}
	for _, n := range cfg.Networks {
		in.NetworkInterfaces = append(in.NetworkInterfaces, api.NetworkInterface{Network: n.ValueString()})
	}
	for _, v := range cfg.Volumes {
		in.Volumes = append(in.Volumes, api.VMVolume{Volume: v.ValueString()})
	}
	var diags diag.Diagnostics
	in.Constraints, diags = constraintsFromObject(ctx, cfg.Constraints)
	resp.Diagnostics.Append(diags...)
	if resp.Diagnostics.HasError() {
		return
	}
	res, err := d.data.client.Place(ctx, in)
	if errors.Is(err, client.ErrNoCapacity) {
		// A dry run that finds no host is an answer, not a failure.
		res, err = api.PlacementResult{Rejected: rejectionsOf(err)}, nil
	}
	if err != nil {
		addAPIError(&resp.Diagnostics, summaryPlacement,
			fmt.Sprintf("planning the placement of a %d vCPU, %d MiB VM of image %q", in.VCPUs, in.MemoryMiB, in.Image), err)
		return
	}
	cfg.Fits = types.BoolValue(res.Host != "")
	cfg.ChosenHost = optionalString(res.Host)
	cfg.Note = optionalString(res.Note)
	cfg.Score = types.Float64Null()
	if res.Host != "" {
		cfg.Score = types.Float64Value(res.Score)
	}
	cfg.Ranked = make([]rankedHostData, 0, len(res.Ranked))
	for _, r := range res.Ranked {
		terms := make(map[string]attr.Value, len(r.Terms))
		for k, v := range r.Terms {
			terms[k] = types.Float64Value(v)
		}
		cfg.Ranked = append(cfg.Ranked, rankedHostData{
			Host:  types.StringValue(r.Host),
			Score: types.Float64Value(r.Score),
			Terms: types.MapValueMust(types.Float64Type, terms),

			WarmReady: types.Int64Value(int64(r.WarmReady)),
		})
	}
	rejected := slices.Clone(res.Rejected)
	slices.SortFunc(rejected, func(a, b api.Rejection) int { return strings.Compare(a.Host, b.Host) })
	cfg.Rejected = make([]rejectionData, 0, len(rejected))
	for _, r := range rejected {
		cfg.Rejected = append(cfg.Rejected, rejectionData{Host: types.StringValue(r.Host), Reason: types.StringValue(r.Reason),
			Detail: types.StringValue(r.Detail)})
	}
	resp.Diagnostics.Append(resp.State.Set(ctx, &cfg)...)
}

// rejectionsOf reads the per-host reasons of a no_capacity error.
func rejectionsOf(err error) []api.Rejection {
	var ae *client.Error
	if !errors.As(err, &ae) {
		return nil
	}
	list, _ := ae.Details["rejected"].([]any)
	out := make([]api.Rejection, 0, len(list))
	for _, item := range list {
		m, _ := item.(map[string]any)
		host, _ := m["host"].(string)
		reason, _ := m["reason"].(string)
		detail, _ := m["detail"].(string)
		if host != "" {
			out = append(out, api.Rejection{Host: host, Reason: reason, Detail: detail})
		}
	}
	return out
}
