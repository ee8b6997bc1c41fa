package agent_test

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/network"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/sim"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv/netnstest"
)

// overlaySimAgent starts a sim agent in the test's namespace with
// underlay (none: "").
func overlaySimAgent(t *testing.T, underlay string) (*agentapi.Client, string, error) {
	t.Helper()
	a, err := agent.New(context.Background(), agent.Config{
		StateDir: t.TempDir(), Driver: sim.New(sim.Options{}), Token: token, NoSync: true,
		Capacity:        agentapi.Resources{VCPUs: 8, MemoryMiB: 8192, DiskMiB: 1 << 16},
		Logger:          slog.New(slog.NewTextHandler(io.Discard, nil)),
		UnderlayAddress: underlay,
	})
	if err != nil {
		return nil, "", err
	}
	srv := httptest.NewServer(a.Handler())
	t.Cleanup(func() { srv.Close(); _ = a.Close() })
	return agentapi.NewClient(srv.URL, token, agentapi.WithRetries(0)), srv.URL, nil
}

func overlayIdentity(t *testing.T, c *agentapi.Client, addr, underlay string) error {
	t.Helper()
	b := make([]byte, 32)
	_, _ = rand.Read(b)
	ch := agentapi.IdentityChallenge{Nonce: agentapi.NewNonce(b), Host: "h1", Address: addr, Underlay: underlay}
	proof, err := c.Identity(context.Background(), ch)
	if err != nil {
		return err
	}
	_, err = agentapi.VerifyIdentity(ch, proof, nil, token)
	return err
}

// The overlay routes of a sim agent program the kernel of its namespace
// (read back through netlink), refuse bad input with 400 and a host
// without an underlay with 409, and the identity proves the underlay
// address only when it is the agent's.
func TestOverlayRoutesProgramTheKernelWithTheSimDriver(t *testing.T) {
	if !netnstest.InOwnNetNS(t) {
		return
	}
	ctx := context.Background()
	// The underlay interface: a veth (this kernel may lack ul).
	ul := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "ovund0"}, PeerName: "ovund1"}
	if err := netlink.LinkAdd(ul); err != nil {
		t.Fatal(err)
	}
	addr, _ := netlink.ParseAddr("10.251.0.1/24")
	if err := netlink.AddrAdd(ul, addr); err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkSetUp(ul); err != nil {
		t.Fatal(err)
	}

	if _, _, err := overlaySimAgent(t, "10.251.0.9"); err == nil || !strings.Contains(err.Error(), "10.251.0.9") ||
		!strings.Contains(err.Error(), "10.251.0.1") {
		t.Fatalf("an agent with an underlay address no interface has started: %v; want a refusal naming it and the host's", err)
	}
	c, url, err := overlaySimAgent(t, "10.251.0.1")
	if err != nil {
		t.Fatal(err)
	}
	info, err := c.Info(ctx)
	if err != nil || info.UnderlayAddress != "10.251.0.1" || info.UnderlayMTU != 1500 {
		t.Fatalf("info underlay %q mtu %d (%v); want 10.251.0.1 and 1500", info.UnderlayAddress, info.UnderlayMTU, err)
	}

	o := agentapi.Overlay{Network: "blue", VNI: 4096, CIDR: "10.210.0.0/24", Gateway: "10.210.0.1", MTU: 1450,
		Peers: []agentapi.OverlayPeer{{Host: "h2", Underlay: "10.251.0.2"}, {Host: "h3", Underlay: "10.251.0.3"}},
		Entries: []agentapi.OverlayEntry{
			{MAC: "52:54:00:00:00:22", IPv4: "10.210.0.22", Underlay: "10.251.0.2"},
			{MAC: "52:54:00:00:00:33", IPv4: "10.210.0.33", Underlay: "10.251.0.3"},
		}}
	st, err := c.PutOverlay(ctx, "blue", o)
	if err != nil {
		t.Fatal(err)
	}
	want := agentapi.OverlayState{Network: "blue", VNI: 4096, Device: network.VXLANName("blue"), Bridge: network.BridgeName("blue"), MTU: 1450,
		FDB:   []agentapi.OverlayFDB{{MAC: "52:54:00:00:00:22", Dst: "10.251.0.2"}, {MAC: "52:54:00:00:00:33", Dst: "10.251.0.3"}},
		Neigh: []agentapi.OverlayNeigh{{IPv4: "10.210.0.22", MAC: "52:54:00:00:00:22"}, {IPv4: "10.210.0.33", MAC: "52:54:00:00:00:33"}}}
	if fmt.Sprint(st) != fmt.Sprint(want) {
		t.Fatalf("PUT answered %+v\nwant %+v", st, want)
	}
	// The kernel has it, not only the answer.
	vx, err := netlink.LinkByName(network.VXLANName("blue"))
	if v, ok := vx.(*netlink.Vxlan); err != nil || !ok || v.VxlanId != 4096 || v.SrcAddr.String() != "10.251.0.1" {
		t.Fatalf("vxlan device %+v (%v); want vni 4096 from 10.251.0.1", vx, err)
	}
	o.Entries = o.Entries[1:]
	if _, err := c.PutOverlay(ctx, "blue", o); err != nil {
		t.Fatal(err)
	}
	list, err := c.ListOverlays(ctx)
	if err != nil || len(list) != 1 || len(list[0].FDB) != 1 || list[0].FDB[0].MAC != "52:54:00:00:00:33" ||
		len(list[0].Neigh) != 1 || list[0].Neigh[0].IPv4 != "10.210.0.33" {
		t.Fatalf("GET after removing an entry: %+v (%v); want only 10.210.0.33's", list, err)
	}
	neigh, err := netlink.NeighList(vx.Attrs().Index, netlink.FAMILY_V4)
	if err != nil || len(neigh) != 1 || neigh[0].IP.String() != "10.210.0.33" {
		t.Fatalf("the kernel's neighbours of the device: %+v (%v)", neigh, err)
	}

	for name, bad := range map[string]func(o *agentapi.Overlay){
		"vni 0": func(o *agentapi.Overlay) { o.VNI = 0 },
		"bad mac": func(o *agentapi.Overlay) {
			o.Entries = []agentapi.OverlayEntry{{MAC: "zz", IPv4: "10.210.0.5", Underlay: "10.251.0.2"}}
		},
		"mtu over underlay": func(o *agentapi.Overlay) { o.MTU = 1460 },
		"other network":     func(o *agentapi.Overlay) { o.Network = "red" },
	} {
		b := o
		bad(&b)
		if _, err := c.PutOverlay(ctx, "blue", b); !errors.Is(err, agentapi.ErrInvalid) {
			t.Errorf("%s: %v; want 400", name, err)
		}
	}
	req, _ := http.NewRequest(http.MethodPut, url+"/v1/overlays/blue", strings.NewReader(`{"network":"blue","vni":5,"extra":1}`))
	req.Header.Set("Authorization", "Bearer "+token)
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != http.StatusBadRequest {
		t.Errorf("unknown field: %v %v; want 400", resp, err)
	} else {
		_ = resp.Body.Close()
	}

	if err := overlayIdentity(t, c, url, "10.251.0.1"); err != nil {
		t.Fatalf("identity with the agent's own underlay: %v", err)
	}
	var ae *agentapi.Error
	if err := overlayIdentity(t, c, url, "10.251.0.2"); !errors.As(err, &ae) || ae.Status != http.StatusForbidden {
		t.Fatalf("identity with another underlay address: %v; want 403", err)
	}

	if err := c.DeleteOverlay(ctx, "blue"); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{network.VXLANName("blue"), network.BridgeName("blue")} {
		if _, err := netlink.LinkByName(name); err == nil {
			t.Errorf("%s is still there after the delete", name)
		}
	}
	if list, err := c.ListOverlays(ctx); err != nil || len(list) != 0 {
		t.Fatalf("GET after the delete: %+v (%v)", list, err)
	}
	if err := c.DeleteOverlay(ctx, "blue"); err != nil {
		t.Fatalf("a second delete: %v; want 204", err)
	}

	none, noneURL, err := overlaySimAgent(t, "")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := none.PutOverlay(ctx, "blue", o); !errors.As(err, &ae) || ae.Status != http.StatusConflict ||
		!strings.Contains(ae.Message, "--underlay-address") {
		t.Fatalf("PUT on an agent without underlay: %v; want 409 naming --underlay-address", err)
	}
	if err := overlayIdentity(t, none, noneURL, "10.251.0.1"); !errors.As(err, &ae) || ae.Status != http.StatusForbidden {
		t.Fatalf("identity with an underlay on an agent without one: %v; want 403", err)
	}
	if err := overlayIdentity(t, none, noneURL, ""); err != nil {
		t.Fatalf("identity without underlay on an agent without one: %v", err)
	}
}
