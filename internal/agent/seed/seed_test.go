package seed

import (
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kdomanski/iso9660"
)

func testConfig() Config {
	return Config{
		InstanceID:        "vm-123",
		Hostname:          "web-1",
		MetaData:          map[string]string{"role": "web"},
		UserData:          []byte("#cloud-config\nruncmd: [[touch, /tmp/x]]\n"),
		SSHAuthorizedKeys: []string{"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl test"},
		NICs: []NIC{
			{MAC: "52:54:00:AA:BB:01", Address: "10.7.0.5/24", Gateway: "10.7.0.1"},
			{MAC: "52:54:00:aa:bb:02"},
		},
	}
}

// readISO returns the files of the seed at path and its volume label, as a
// reader of ISO 9660 (not this package's writer) sees them.
func readISO(t *testing.T, path string) (string, map[string]string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	img, err := iso9660.OpenImage(f)
	if err != nil {
		t.Fatalf("open %s: %v", path, err)
	}
	label, err := img.Label()
	if err != nil {
		t.Fatal(err)
	}
	root, err := img.RootDir()
	if err != nil {
		t.Fatal(err)
	}
	children, err := root.GetChildren()
	if err != nil {
		t.Fatal(err)
	}
	files := map[string]string{}
	for _, c := range children {
		b, err := io.ReadAll(c.Reader())
		if err != nil {
			t.Fatal(err)
		}
		files[c.Name()] = string(b)
	}
	return label, files
}

func TestWriteRoundTrip(t *testing.T) {
	path := filepath.Join(t.TempDir(), "seed.iso")
	if err := Write(path, testConfig()); err != nil {
		t.Fatal(err)
	}
	label, files := readISO(t, path)
	if label != VolumeLabel {
		t.Errorf("label %q, want %q", label, VolumeLabel)
	}
	var meta map[string]any
	if err := json.Unmarshal([]byte(files[FileMetaData]), &meta); err != nil {
		t.Fatalf("meta-data %q: %v (files %v)", files[FileMetaData], err, files)
	}
	if meta["instance-id"] != "vm-123" || meta["local-hostname"] != "web-1" || meta["role"] != "web" {
		t.Errorf("meta-data = %v", meta)
	}
	if keys, _ := meta["public-keys"].([]any); len(keys) != 1 {
		t.Errorf("public-keys = %v", meta["public-keys"])
	}
	if files[FileUserData] != string(testConfig().UserData) {
		t.Errorf("user-data = %q", files[FileUserData])
	}
	var net struct {
		Version   int `json:"version"`
		Ethernets map[string]struct {
			Match     map[string]string `json:"match"`
			SetName   string            `json:"set-name"`
			DHCP4     bool              `json:"dhcp4"`
			Addresses []string          `json:"addresses"`
			Routes    []struct{ To, Via string }
		} `json:"ethernets"`
	}
	if err := json.Unmarshal([]byte(files[FileNetworkConfig]), &net); err != nil {
		t.Fatalf("network-config %q: %v", files[FileNetworkConfig], err)
	}
	if net.Version != 2 || len(net.Ethernets) != 2 {
		t.Fatalf("network-config = %+v", net)
	}
	e0, e1 := net.Ethernets["nic0"], net.Ethernets["nic1"]
	if e0.Match["macaddress"] != "52:54:00:aa:bb:01" || e0.SetName != "eth0" || e0.DHCP4 ||
		len(e0.Addresses) != 1 || e0.Addresses[0] != "10.7.0.5/24" || len(e0.Routes) != 1 || e0.Routes[0].Via != "10.7.0.1" {
		t.Errorf("nic0 = %+v", e0)
	}
	if e1.Match["macaddress"] != "52:54:00:aa:bb:02" || e1.SetName != "eth1" || !e1.DHCP4 || len(e1.Addresses) != 0 {
		t.Errorf("nic1 = %+v", e1)
	}
	if entries, _ := os.ReadDir(filepath.Dir(path)); len(entries) != 1 {
		t.Errorf("the seed's folder holds %d entries, want only the seed (no temporary file left)", len(entries))
	}
}

func TestNetworkConfigGivenIsKept(t *testing.T) {
	c := testConfig()
	c.NetworkConfig = []byte("version: 2\nethernets: {}\n")
	files, err := c.Files()
	if err != nil {
		t.Fatal(err)
	}
	if string(files[FileNetworkConfig]) != string(c.NetworkConfig) {
		t.Errorf("network-config = %q, want the given one", files[FileNetworkConfig])
	}
}

func TestEmptyUserDataIsValidCloudConfig(t *testing.T) {
	files, err := Config{InstanceID: "vm-1"}.Files()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(string(files[FileUserData]), "#cloud-config\n") {
		t.Errorf("user-data = %q", files[FileUserData])
	}
}

func TestRejects(t *testing.T) {
	cases := map[string]Config{
		"no instance id":          {Hostname: "x"},
		"meta-data instance-id":   {InstanceID: "vm", MetaData: map[string]string{"instance-id": "other"}},
		"meta-data hostname":      {InstanceID: "vm", MetaData: map[string]string{"local-hostname": "other"}},
		"bad MAC":                 {InstanceID: "vm", NICs: []NIC{{MAC: "52:54:00:zz:00:01"}}},
		"short MAC":               {InstanceID: "vm", NICs: []NIC{{MAC: "52:54:00:00:01"}}},
		"address without prefix":  {InstanceID: "vm", NICs: []NIC{{MAC: "52:54:00:00:00:01", Address: "10.0.0.5"}}},
		"gateway outside network": {InstanceID: "vm", NICs: []NIC{{MAC: "52:54:00:00:00:01", Address: "10.0.0.5/24", Gateway: "10.0.1.1"}}},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			if err := Write(filepath.Join(dir, "seed.iso"), c); err == nil {
				t.Fatal("Write succeeded, want an error")
			}
			if entries, _ := os.ReadDir(dir); len(entries) != 0 {
				t.Errorf("a refused seed left %d files", len(entries))
			}
		})
	}
}

// TestLinuxMountsSeed mounts the seed with the kernel's iso9660 driver, as a
// guest does, and reads the files under the names cloud-init opens.
func TestLinuxMountsSeed(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting a loop device needs root")
	}
	if _, err := exec.LookPath("mount"); err != nil {
		t.Skip("no mount command")
	}
	dir := t.TempDir()
	path := filepath.Join(dir, "seed.iso")
	if err := Write(path, testConfig()); err != nil {
		t.Fatal(err)
	}
	mnt := filepath.Join(dir, "mnt")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mount", "-t", "iso9660", "-o", "loop,ro", path, mnt).CombinedOutput(); err != nil {
		t.Skipf("cannot loop-mount here: %v: %s", err, out)
	}
	defer func() { _ = exec.Command("umount", mnt).Run() }()
	if out, err := exec.Command("blkid", "-o", "value", "-s", "LABEL", path).Output(); err == nil && strings.TrimSpace(string(out)) != VolumeLabel {
		t.Errorf("blkid label %q, want %q", out, VolumeLabel)
	}
	for _, name := range []string{FileMetaData, FileUserData, FileNetworkConfig} {
		b, err := os.ReadFile(filepath.Join(mnt, name))
		if err != nil {
			t.Errorf("the guest cannot open %s: %v", name, err)
			continue
		}
		if len(b) == 0 {
			t.Errorf("%s is empty", name)
		}
	}
	b, _ := os.ReadFile(filepath.Join(mnt, FileUserData))
	if string(b) != string(testConfig().UserData) {
		t.Errorf("user-data through the kernel = %q", b)
	}
}

// An overlay network's MTU reaches the guest in the generated config.
func TestNetworkConfigCarriesTheMTU(t *testing.T) {
	b, err := NetworkConfig([]NIC{{MAC: "52:54:00:aa:bb:01", MTU: 1450}, {MAC: "52:54:00:aa:bb:02"}})
	if err != nil {
		t.Fatal(err)
	}
	var got struct {
		Ethernets map[string]map[string]any `json:"ethernets"`
	}
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	if mtu, ok := got.Ethernets["nic0"]["mtu"].(float64); !ok || mtu != 1450 {
		t.Errorf("nic0 = %v; want mtu 1450", got.Ethernets["nic0"])
	}
	if _, ok := got.Ethernets["nic1"]["mtu"]; ok {
		t.Errorf("nic1 = %v; want no mtu (the link's)", got.Ethernets["nic1"])
	}
	if _, err := NetworkConfig([]NIC{{MAC: "52:54:00:aa:bb:01", MTU: 100}}); err == nil {
		t.Error("mtu 100 accepted")
	}
}
