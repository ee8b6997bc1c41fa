// Package seed builds a VM's NoCloud seed: an ISO 9660 image with the volume
// label "cidata" holding meta-data, user-data and network-config, which
// cloud-init reads at boot (and the busybox guest's init, for tests).
//
// meta-data and network-config are written as JSON, which is YAML too, so
// no value a user gives can break their syntax.
package seed

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"strings"

	"github.com/kdomanski/iso9660"
)

// VolumeLabel is the label cloud-init's NoCloud datasource looks for.
const VolumeLabel = "cidata"

// File names inside the seed.
const (
	FileMetaData      = "meta-data"
	FileUserData      = "user-data"
	FileNetworkConfig = "network-config"
)

// reservedMetaKeys are set by the product, never by a user's meta_data.
var reservedMetaKeys = map[string]bool{"instance-id": true, "local-hostname": true, "public-keys": true}

// NIC is one network interface as the guest should configure it.
type NIC struct {
	// MAC names the interface: the generated config matches it by MAC and
	// renames it ethN (N its index), which renders correctly on every
	// cloud-init backend, Debian's ifupdown included.
	MAC string
	// Address is a static address in prefix form ("10.0.0.5/24"); empty
	// means DHCP.
	Address string
	// Gateway is the default route of a static address (first NIC only).
	Gateway string
	// MTU is the interface's MTU (an overlay network's, smaller than the
	// link's usual 1500); 0: none set.
	MTU int
}

// Config is what goes into one VM's seed.
type Config struct {
	// InstanceID is the VM id: a fork child or a warm VM handed out is a new
	// instance, so cloud-init runs its per-instance modules again.
	InstanceID string
	Hostname   string
	// MetaData are extra meta-data keys; they may not set instance-id,
	// local-hostname or public-keys.
	MetaData          map[string]string
	UserData          []byte
	SSHAuthorizedKeys []string
	// NetworkConfig is used as given when set; otherwise it is generated
	// from NICs.
	NetworkConfig []byte
	NICs          []NIC
}

// Files returns the seed's files.
func (c Config) Files() (map[string][]byte, error) {
	if c.InstanceID == "" {
		return nil, errors.New("seed: instance-id is required")
	}
	meta := map[string]any{"instance-id": c.InstanceID}
	if c.Hostname != "" {
		meta["local-hostname"] = c.Hostname
	}
	if len(c.SSHAuthorizedKeys) > 0 {
		meta["public-keys"] = c.SSHAuthorizedKeys
	}
	for k, v := range c.MetaData {
		if reservedMetaKeys[k] {
			return nil, fmt.Errorf("seed: meta_data may not set %q: the product sets it", k)
		}
		meta[k] = v
	}
	metaJSON, err := json.MarshalIndent(meta, "", "  ")
	if err != nil {
		return nil, err
	}
	userData := c.UserData
	if len(userData) == 0 {
		userData = []byte("#cloud-config\n{}\n")
	}
	netConfig := c.NetworkConfig
	if len(netConfig) == 0 {
		if netConfig, err = NetworkConfig(c.NICs); err != nil {
			return nil, err
		}
	}
	return map[string][]byte{
		FileMetaData:      append(metaJSON, '\n'),
		FileUserData:      userData,
		FileNetworkConfig: netConfig,
	}, nil
}

// NetworkConfig renders network-config version 2 for nics: each NIC matched
// by its MAC and named ethN, with DHCP or its static address.
func NetworkConfig(nics []NIC) ([]byte, error) {
	type route struct {
		To  string `json:"to"`
		Via string `json:"via"`
	}
	type ethernet struct {
		Match     map[string]string `json:"match"`
		SetName   string            `json:"set-name"`
		DHCP4     bool              `json:"dhcp4"`
		Addresses []string          `json:"addresses,omitempty"`
		Routes    []route           `json:"routes,omitempty"`
		MTU       int               `json:"mtu,omitempty"`
	}
	eths := map[string]ethernet{}
	for i, n := range nics {
		mac := strings.ToLower(n.MAC)
		if _, err := parseMAC(mac); err != nil {
			return nil, fmt.Errorf("seed: NIC %d: %w", i, err)
		}
		if n.MTU != 0 && (n.MTU < 576 || n.MTU > 9000) {
			return nil, fmt.Errorf("seed: NIC %d: mtu %d is not between 576 and 9000", i, n.MTU)
		}
		e := ethernet{Match: map[string]string{"macaddress": mac}, SetName: fmt.Sprintf("eth%d", i), MTU: n.MTU}
		if n.Address == "" {
			e.DHCP4 = true
		} else {
			p, err := netip.ParsePrefix(n.Address)
			if err != nil || !p.Addr().Is4() {
				return nil, fmt.Errorf("seed: NIC %d: address %q: want an IPv4 address with its prefix, e.g. 10.0.0.5/24", i, n.Address)
			}
			e.Addresses = []string{p.String()}
			if n.Gateway != "" && i == 0 {
				gw, err := netip.ParseAddr(n.Gateway)
				if err != nil || !gw.Is4() || !p.Masked().Contains(gw) {
					return nil, fmt.Errorf("seed: NIC %d: gateway %q is not an IPv4 address inside %s", i, n.Gateway, p.Masked())
				}
				e.Routes = []route{{To: "0.0.0.0/0", Via: gw.String()}}
			}
		}
		eths[fmt.Sprintf("nic%d", i)] = e
	}
	b, err := json.MarshalIndent(map[string]any{"version": 2, "ethernets": eths}, "", "  ")
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}

func parseMAC(s string) ([6]byte, error) {
	var m [6]byte
	parts := strings.Split(s, ":")
	if len(parts) != 6 {
		return m, fmt.Errorf("MAC %q: want six colon-separated bytes", s)
	}
	for i, p := range parts {
		var b byte
		if _, err := fmt.Sscanf(p, "%02x", &b); err != nil || len(p) != 2 {
			return m, fmt.Errorf("MAC %q: byte %d is not two hex digits", s, i)
		}
		m[i] = b
	}
	return m, nil
}

// Write builds the seed ISO for c at path. The image is written beside path
// and renamed into place after an fsync, so a crash never leaves a torn seed.
func Write(path string, c Config) error {
	files, err := c.Files()
	if err != nil {
		return err
	}
	w, err := iso9660.NewWriter()
	if err != nil {
		return fmt.Errorf("seed: %w", err)
	}
	defer func() { _ = w.Cleanup() }()
	for _, name := range []string{FileMetaData, FileUserData, FileNetworkConfig} {
		if err := w.AddFile(bytes.NewReader(files[name]), name); err != nil {
			return fmt.Errorf("seed: add %s: %w", name, err)
		}
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".seed-*.iso")
	if err != nil {
		return fmt.Errorf("seed: %w", err)
	}
	defer func() { _ = os.Remove(tmp.Name()) }()
	if err := w.WriteTo(tmp, VolumeLabel); err != nil {
		_ = tmp.Close()
		return fmt.Errorf("seed: write %s: %w", path, err)
	}
	if err := tmp.Sync(); err != nil {
		_ = tmp.Close()
		return fmt.Errorf("seed: sync %s: %w", path, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("seed: %w", err)
	}
	// Only the VMM (the agent's user) reads it: user data may hold secrets.
	if err := os.Chmod(tmp.Name(), 0o600); err != nil {
		return fmt.Errorf("seed: %w", err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("seed: %w", err)
	}
	return nil
}

// Read returns the files of the seed ISO at path by name, and its volume
// label.
func Read(path string) (map[string][]byte, string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, "", fmt.Errorf("seed: %w", err)
	}
	defer func() { _ = f.Close() }()
	img, err := iso9660.OpenImage(f)
	if err != nil {
		return nil, "", fmt.Errorf("seed: open %s: %w", path, err)
	}
	label, err := img.Label()
	if err != nil {
		return nil, "", fmt.Errorf("seed: label of %s: %w", path, err)
	}
	root, err := img.RootDir()
	if err != nil {
		return nil, "", fmt.Errorf("seed: root of %s: %w", path, err)
	}
	children, err := root.GetChildren()
	if err != nil {
		return nil, "", fmt.Errorf("seed: files of %s: %w", path, err)
	}
	files := map[string][]byte{}
	for _, c := range children {
		if c.IsDir() {
			continue
		}
		b, err := io.ReadAll(io.LimitReader(c.Reader(), 1<<20))
		if err != nil {
			return nil, "", fmt.Errorf("seed: read %s of %s: %w", c.Name(), path, err)
		}
		files[c.Name()] = b
	}
	return files, label, nil
}
