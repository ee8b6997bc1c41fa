package image

import (
	"encoding/json"
	"strings"
	"testing"
)

// FuzzParseManifest: whatever bytes an image.json holds, a manifest that
// ParseManifest accepts names only plain files of its folder, has a known
// kind and disk format, and is read back the same from the JSON the cache
// writes of it (what was checked is what a driver opens).
func FuzzParseManifest(f *testing.F) {
	for _, s := range []string{
		`{"kind": "kernel", "kernel": "vmlinux", "initrd": "initrd.img", "cmdline": "console=ttyS0"}`,
		`{"kind": "disk", "disk": "disk.qcow2", "disk_format": "raw"}`,
		`{"kind": "kernel", "KERNEL": "../../etc/shadow"}`,
		`{"kind": "disk", "disk": "a", "disk": "../b"}`,
		`{"kind": "disk", "diſk": "x"}`,
		`{"kind": "disk", "disk": "d"} {}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := ParseManifest(b)
		if err != nil {
			return
		}
		if m.Kind != KindKernel && m.Kind != KindDisk {
			t.Fatalf("accepted kind %q", m.Kind)
		}
		if f := m.EffectiveDiskFormat(); f != "qcow2" && f != "raw" {
			t.Fatalf("accepted disk_format %q", f)
		}
		for k, v := range m.Files() {
			if v == "." || v == ".." || strings.ContainsAny(v, "/\\\x00") {
				t.Fatalf("accepted %s %q, which is not a plain file name", k, v)
			}
		}
		again, err := json.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		back, err := ParseManifest(again)
		if err != nil {
			t.Fatalf("the manifest written of an accepted one is refused: %v\n%s", err, again)
		}
		if back != m {
			t.Fatalf("read back %+v, want %+v", back, m)
		}
	})
}
