package agent_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agent"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agent/sim"
	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// chainDepthProxy stands in front of an agent like one that keeps longer
// disk chains (an agent of a release before flattening): it lists extra
// backing files in every snapshot's metadata, and counts the requests for
// snapshot files, whatever their answer.
type chainDepthProxy struct {
	srv   *httptest.Server
	extra int
	files atomic.Int64
}

func startChainDepthProxy(t *testing.T, target string, extra int) *chainDepthProxy {
	t.Helper()
	u, err := url.Parse(target)
	if err != nil {
		t.Fatal(err)
	}
	p := &chainDepthProxy{extra: extra}
	rp := httputil.NewSingleHostReverseProxy(u)
	rp.ModifyResponse = func(resp *http.Response) error {
		path := resp.Request.URL.Path
		if strings.Contains(path, "/files/") {
			p.files.Add(1)
			return nil
		}
		if resp.Request.Method != http.MethodGet || !strings.HasPrefix(path, "/v1/snapshots/") || resp.StatusCode != http.StatusOK {
			return nil
		}
		var s agentapi.Snapshot
		err := json.NewDecoder(resp.Body).Decode(&s)
		_ = resp.Body.Close()
		if err != nil {
			return err
		}
		for i := range p.extra {
			s.Files = append(s.Files, agentapi.SnapshotFile{Name: "disk." + strconv.Itoa(i+1) + ".qcow2",
				Kind: agentapi.SnapshotFileBacking, SizeBytes: 512, SHA256: strings.Repeat("ab", 32)})
		}
		b, err := json.Marshal(s)
		if err != nil {
			return err
		}
		resp.Body = io.NopCloser(bytes.NewReader(b))
		resp.ContentLength = int64(len(b))
		resp.Header.Set("Content-Length", strconv.Itoa(len(b)))
		return nil
	}
	p.srv = httptest.NewServer(rp)
	t.Cleanup(p.srv.Close)
	return p
}

// startChainDepthAgent is a sim agent with disk chain depth depth.
func startChainDepthAgent(t *testing.T, depth int) (*agent.Agent, *agentapi.Client, string) {
	t.Helper()
	dir := t.TempDir()
	a, err := agent.New(context.Background(), agent.Config{
		StateDir: dir, Driver: sim.New(sim.Options{}), Token: token, DiskChainDepth: depth,
		Capacity: agentapi.Resources{VCPUs: 64, MemoryMiB: 65536, DiskMiB: 1 << 20},
		Logger:   slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatalf("agent.New: %v", err)
	}
	srv := httptest.NewServer(a.Handler())
	t.Cleanup(func() {
		srv.Close()
		_ = a.Close()
	})
	return a, agentapi.NewClient(srv.URL, token, agentapi.WithRetries(0)), dir
}

// TestPullRefusesChainDeeperThanDepth: a pull moves at most the disk chain
// depth. A snapshot whose metadata lists more disk files than the pulling
// agent's depth is refused with a conflict that names both figures, before
// any of its files is asked for, and leaves nothing behind; one within the
// depth is pulled.
func TestPullRefusesChainDeeperThanDepth(t *testing.T) {
	ctx := context.Background()
	const depth = 3
	src, srcClient, _ := startChainDepthAgent(t, depth)
	_, dstClient, dstDir := startChainDepthAgent(t, depth)
	if _, err := srcClient.CreateVM(ctx, "src", spec); err != nil {
		t.Fatal(err)
	}
	if _, err := srcClient.CreateSnapshot(ctx, "deep", agentapi.SnapshotSpec{VMID: "src"}); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		extra int
		ok    bool
	}{{extra: depth, ok: false}, {extra: depth - 1, ok: true}} {
		proxy := startChainDepthProxy(t, srcClient.BaseURL(), tc.extra)
		if err := src.AllowAddress(proxy.srv.URL); err != nil {
			t.Fatal(err)
		}
		child := spec
		child.Snapshot = &agentapi.SnapshotSource{ID: "deep", Address: proxy.srv.URL, PublicKey: agentapi.EncodeKey(src.PublicKey())}
		_, err := dstClient.CreateVM(ctx, "child-"+strconv.Itoa(tc.extra), child)
		disks := 1 + tc.extra
		if tc.ok {
			// The extra files do not exist at the source: the pull asks
			// for them, which is all this case shows.
			if proxy.files.Load() == 0 {
				t.Fatalf("a chain of %d disk files (depth %d): no file was asked for; err %v", disks, depth, err)
			}
			continue
		}
		if statusOf(err) != http.StatusConflict || !strings.Contains(err.Error(), fmt.Sprintf("disk chain of %d files", disks)) ||
			!strings.Contains(err.Error(), fmt.Sprintf("depth of %d", depth)) {
			t.Fatalf("child of a snapshot with %d disk files at depth %d: %v; want a 409 naming both", disks, depth, err)
		}
		if n := proxy.files.Load(); n != 0 {
			t.Fatalf("the refused pull asked for %d files, want none", n)
		}
		if left, _ := os.ReadDir(filepath.Join(dstDir, "snapshots")); len(left) != 0 {
			t.Fatalf("the refused pull left %v", left)
		}
	}
}
