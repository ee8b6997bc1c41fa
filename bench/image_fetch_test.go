package bench

// Registered images (issue 12):
//
//	go test ./bench -run '^$' -bench 'ImageFetch|ImageCreateFirstVsSecond' -benchtime 1x -timeout 20m
//
// ImageFetch: a 256 MiB raw image (random bytes) served on 127.0.0.1.
//   - cp-MiB/s: a plain `cp` of the file (page cache warm, no fsync),
//   - source-MiB/s: a sim agent fetches it from the HTTP server (sha256
//     while streaming, fsync, rename into the cache),
//   - peer-MiB/s: a second sim agent pulls it from the first (same checks),
//   - file-MiB/s: a third agent reads it by file:// URL.
//
// ImageCreateFirstVsSecond: the busybox guest registered as a kernel bundle
// (66 MB), a fresh real QEMU agent per run (empty cache); POST /v1/vms to
// its answer for the first VM (fetch + boot) and the second (boot only),
// p50 of 5 runs each.
//
// Numbers are reported, never asserted.

import (
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
	"github.com/kvmfleet/terraform-provider-kvm/internal/api"
	"github.com/kvmfleet/terraform-provider-kvm/internal/testenv"
)

const fetchImageMiB = 256

func waitImageReady(b *testing.B, c *agentapi.Client, sha string) {
	deadline := time.Now().Add(5 * time.Minute)
	for time.Now().Before(deadline) {
		st, err := c.Image(context.Background(), sha)
		if err == nil && st.Status == agentapi.ImageReady {
			return
		}
		if err == nil && st.Status == agentapi.ImageFailed {
			b.Fatalf("fetch failed: %s", st.Reason)
		}
		time.Sleep(5 * time.Millisecond)
	}
	b.Fatal("image never ready")
}

func BenchmarkImageFetch(b *testing.B) {
	defer machineState(b)()
	dir := b.TempDir()
	path := filepath.Join(dir, "big.raw")
	f, err := os.Create(path)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := io.CopyN(f, rand.Reader, fetchImageMiB<<20); err != nil {
		b.Fatal(err)
	}
	if err := f.Close(); err != nil {
		b.Fatal(err)
	}
	sha := testenv.FileSHA256(b, path)
	srv := testenv.StartImageServer(b, dir)
	mibps := func(d time.Duration) float64 { return fetchImageMiB / d.Seconds() }

	for b.Loop() {
		start := time.Now()
		if out, err := exec.Command("cp", path, filepath.Join(b.TempDir(), "copy.raw")).CombinedOutput(); err != nil {
			b.Fatalf("cp: %v: %s", err, out)
		}
		b.ReportMetric(mibps(time.Since(start)), "cp-MiB/s")

		fetch := func(src agentapi.ImageSource) (*testenv.Agent, time.Duration) {
			a := testenv.StartAgent(b, testenv.AgentOptions{})
			start := time.Now()
			if _, err := a.Client.PrefetchImage(context.Background(), src); err != nil {
				b.Fatal(err)
			}
			waitImageReady(b, a.Client, sha)
			return a, time.Since(start)
		}
		src := agentapi.ImageSource{Name: "big", SHA256: sha, SourceURL: srv.FileURL("big.raw"), Format: "raw"}
		first, d := fetch(src)
		b.ReportMetric(mibps(d), "source-MiB/s")
		peered := src
		peered.Peers = []agentapi.ImagePeer{{Address: first.Address, PublicKey: agentapi.EncodeKey(first.PublicKey)}}
		_, d = fetch(peered)
		b.ReportMetric(mibps(d), "peer-MiB/s")
		local := src
		local.SourceURL = "file://" + path
		_, d = fetch(local)
		b.ReportMetric(mibps(d), "file-MiB/s")
		if srv.Downloads() != 1 {
			b.Fatalf("downloads from the source = %d, want 1", srv.Downloads())
		}
	}
}

func BenchmarkImageCreateFirstVsSecond(b *testing.B) {
	defer machineState(b)()
	tarPath := filepath.Join(b.TempDir(), "busybox.tar")
	sha := testenv.BundleImage(b, filepath.Join(testenv.GuestImageDir(b), "busybox"), tarPath)
	srv := testenv.StartImageServer(b, filepath.Dir(tarPath))
	const runs = 5
	for b.Loop() {
		c := testenv.StartControl(b, testenv.ControlOptions{})
		ctx := context.Background()
		if _, err := c.Client.CreateImage(ctx, api.ImageCreate{Name: "bb", SourceURL: srv.FileURL("busybox.tar"), SHA256: sha, Format: "kernel"}); err != nil {
			b.Fatal(err)
		}
		var first, second []time.Duration
		for i := range runs {
			a := testenv.StartAgent(b, testenv.AgentOptions{Driver: "qemu", ImageDir: b.TempDir()})
			host := fmt.Sprintf("h%d", i)
			c.RegisterHost(b, host, a.Address)
			var ids []string
			for j, into := range []*[]time.Duration{&first, &second} {
				start := time.Now()
				vm, err := c.Client.CreateVM(ctx, api.VMCreate{Name: fmt.Sprintf("vm-%d-%d", i, j), Image: "bb", Host: host,
					VCPUs: 1, MemoryMiB: 128, DiskMiB: 64}, "")
				if err != nil {
					b.Fatal(err)
				}
				*into = append(*into, time.Since(start))
				ids = append(ids, vm.ID)
			}
			for _, id := range ids {
				if err := c.Client.DeleteVM(ctx, id); err != nil {
					b.Fatal(err)
				}
			}
			if err := c.Client.DeleteHost(ctx, host); err != nil {
				b.Fatal(err)
			}
			a.Stop()
		}
		b.ReportMetric(p50(first), "first-p50-ms")
		b.ReportMetric(p50(second), "second-p50-ms")
		b.ReportMetric(float64(srv.Downloads()), "downloads")
	}
}
