package store

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"gorm.io/gorm"
)

// Errors of networks and IPAM.
var (
	// ErrAddressTaken: an address the reservation asked for is held by
	// another live NIC of the network (the unique index decided).
	ErrAddressTaken = errors.New("address already taken on the network")
	// ErrMACTaken: a MAC the reservation asked for is held by a live VM.
	ErrMACTaken = errors.New("MAC address already used by a live VM")
	// ErrNetworkInUse: live NICs are attached to the network.
	ErrNetworkInUse = errors.New("network still has NICs attached")
	// ErrVNITaken: another overlay network has the VNI (the unique index
	// networks_vni decided).
	ErrVNITaken = errors.New("VNI already used by another overlay network")
)

// Network is a row of networks.
type Network struct {
	Name string `gorm:"column:name;primaryKey"`
	// Project is whose VMs may attach (the default user network: anyone's).
	Project string   `gorm:"column:project"`
	Mode    string   `gorm:"column:mode"`
	CIDR    string   `gorm:"column:cidr"`
	Gateway string   `gorm:"column:gateway"`
	DHCP    bool     `gorm:"column:dhcp"`
	Bridge  string   `gorm:"column:bridge"`
	Hosts   []string `gorm:"column:hosts;serializer:json"`
	// Allow is what a nat network's guests may reach beyond it (names of
	// nat networks, IPv4 CIDRs); fixed at create.
	Allow []string `gorm:"column:allow;serializer:json"`
	// VNI is an overlay network's VXLAN network identifier (nil for the
	// other modes); MTU the MTU of its bridges, tunnels and guests (0: the
	// mode's default). Both fixed at create.
	VNI *int64 `gorm:"column:vni"`
	MTU int64  `gorm:"column:mtu"`
	// RangeFirst..RangeLast are the assignable addresses as numbers (0 when
	// the network has no IPAM); GatewayNum is skipped inside the range.
	RangeFirst int64     `gorm:"column:range_first"`
	RangeLast  int64     `gorm:"column:range_last"`
	GatewayNum int64     `gorm:"column:gateway_num"`
	CreatedAt  time.Time `gorm:"column:created_at"`
	UpdatedAt  time.Time `gorm:"column:updated_at"`
}

// TableName is the table of Network.
func (Network) TableName() string { return "networks" }

// HasIPAM says whether the control plane assigns addresses on the network.
func (n Network) HasIPAM() bool { return n.RangeLast > 0 }

// Size is the number of assignable addresses (the gateway excluded).
func (n Network) Size() int64 {
	if !n.HasIPAM() {
		return 0
	}
	size := n.RangeLast - n.RangeFirst + 1
	if n.GatewayNum >= n.RangeFirst && n.GatewayNum <= n.RangeLast {
		size--
	}
	return size
}

// NIC is one network interface of a VM as stored in vms.nics (JSON) and,
// while the VM holds capacity, as a row of vm_nics.
type NIC struct {
	Network    string `json:"network"`
	MACAddress string `json:"mac_address"`
	// IPv4Address is the address shown; Address is its number when IPAM
	// assigned it (0 otherwise: no vm_nics address).
	IPv4Address  string        `json:"ipv4_address,omitempty"`
	Address      int64         `json:"address,omitempty"`
	Fixed        bool          `json:"fixed,omitempty"`
	PortForwards []PortForward `json:"port_forwards,omitempty"`
}

// PortForward is a forwarded guest port and, once the agent chose them, the
// host address and port.
type PortForward struct {
	GuestPort   int    `json:"guest_port"`
	HostAddress string `json:"host_address,omitempty"`
	HostPort    int    `json:"host_port,omitempty"`
}

// NetworkModeOverlay is the mode of overlay networks (api.NetworkOverlay;
// the store imports no API package).
const NetworkModeOverlay = "overlay"

// networksLock is the PostgreSQL advisory lock that serialises network
// creates, so that two replicas never both pass the overlap check.
const networksLock = 72540105

// InsertNetwork inserts a network. ErrDuplicateName when the name is taken.
func (s *Store) InsertNetwork(ctx context.Context, n Network) (Network, error) {
	return s.InsertNetworkChecked(ctx, n, nil)
}

// InsertNetworkChecked inserts a network after check accepted the networks
// that exist, with network creates serialised (an advisory lock on
// PostgreSQL, SQLite's single writer): check sees every network committed
// before and none can commit between its look and the insert. check may
// fill in what depends on the others (an overlay's lowest free VNI).
func (s *Store) InsertNetworkChecked(ctx context.Context, n Network, check func(all []Network, n *Network) error) (Network, error) {
	t := now()
	n.CreatedAt, n.UpdatedAt = t, t
	if n.Hosts == nil {
		n.Hosts = []string{}
	}
	if n.Allow == nil {
		n.Allow = []string{}
	}
	err := s.inTx(ctx, func(tx *gorm.DB) error {
		if check == nil {
			return tx.Create(&n).Error
		}
		if s.dialect == DialectPostgres {
			if err := tx.Exec("SELECT pg_advisory_xact_lock(?)", networksLock).Error; err != nil {
				return fmt.Errorf("lock networks: %w", err)
			}
		}
		var all []Network
		if err := tx.Order("name").Find(&all).Error; err != nil {
			return fmt.Errorf("list networks: %w", err)
		}
		if err := check(all, &n); err != nil {
			return err
		}
		return tx.Create(&n).Error
	})
	if isDuplicate(err) && n.VNI != nil && s.vniHeldByOther(ctx, n) {
		return Network{}, fmt.Errorf("network %q: vni %d: %w", n.Name, *n.VNI, ErrVNITaken)
	}
	if isDuplicate(err) {
		return Network{}, fmt.Errorf("network %q: %w", n.Name, ErrDuplicateName)
	}
	if err != nil {
		return Network{}, fmt.Errorf("insert network %q: %w", n.Name, err)
	}
	return n, nil
}

// vniHeldByOther says whether the refusal of n's insert was the VNI's
// index: another network holds the VNI (SQLite's translated error no
// longer names the index; PostgreSQL's does).
func (s *Store) vniHeldByOther(ctx context.Context, n Network) bool {
	var count int64
	err := s.db.WithContext(ctx).Model(&Network{}).Where("vni = ? AND name <> ?", *n.VNI, n.Name).Count(&count).Error
	return err == nil && count > 0
}

// GetNetwork returns one network; ErrNotFound when there is none.
func (s *Store) GetNetwork(ctx context.Context, name string) (Network, error) {
	var n Network
	err := s.db.WithContext(ctx).Where("name = ?", name).Take(&n).Error
	if errors.Is(err, gorm.ErrRecordNotFound) {
		return Network{}, fmt.Errorf("network %q: %w", name, ErrNotFound)
	}
	if err != nil {
		return Network{}, fmt.Errorf("read network %q: %w", name, err)
	}
	return n, nil
}

// ListNetworks returns every network by name.
func (s *Store) ListNetworks(ctx context.Context) ([]Network, error) {
	var out []Network
	if err := s.db.WithContext(ctx).Order("name").Find(&out).Error; err != nil {
		return nil, fmt.Errorf("list networks: %w", err)
	}
	return out, nil
}

// SetNetworkHosts replaces the hosts a network is limited to.
func (s *Store) SetNetworkHosts(ctx context.Context, name string, hosts []string) error {
	if hosts == nil {
		hosts = []string{}
	}
	text, err := jsonText(hosts)
	if err != nil {
		return err
	}
	res := s.db.WithContext(ctx).Exec("UPDATE networks SET hosts = ?, updated_at = ? WHERE name = ?", text, now(), name)
	if res.Error != nil {
		return fmt.Errorf("update hosts of network %q: %w", name, res.Error)
	}
	if res.RowsAffected == 0 {
		return fmt.Errorf("network %q: %w", name, ErrNotFound)
	}
	return nil
}

// NetworkUser is a VM with a live NIC on a network.
type NetworkUser struct {
	VMID string
	Name string
}

// NetworkUsers lists up to limit VMs with live NICs on the network.
func (s *Store) NetworkUsers(ctx context.Context, network string, limit int) ([]NetworkUser, error) {
	var out []NetworkUser
	err := s.db.WithContext(ctx).Raw(`SELECT DISTINCT v.id AS vm_id, v.name AS name FROM vm_nics n JOIN vms v ON v.id = n.vm_id
		WHERE n.network = ? ORDER BY v.id LIMIT ?`, network, limit).Scan(&out).Error
	if err != nil {
		return nil, fmt.Errorf("list vms on network %q: %w", network, err)
	}
	return out, nil
}

// DeleteNetwork removes a network that no live NIC uses; ErrNetworkInUse
// otherwise. A create that read the network just before and commits its
// NIC just after can still land on a deleted network (vm_nics has no
// foreign key, see migration 0005); such a VM keeps working on its host and
// blocks nothing but a network of the same name.
func (s *Store) DeleteNetwork(ctx context.Context, name string) error {
	res := s.db.WithContext(ctx).Exec("DELETE FROM networks WHERE name = ? AND NOT EXISTS (SELECT 1 FROM vm_nics WHERE network = ?)", name, name)
	if res.Error != nil {
		return fmt.Errorf("delete network %q: %w", name, res.Error)
	}
	if res.RowsAffected == 0 {
		if _, err := s.GetNetwork(ctx, name); err != nil {
			return err
		}
		return fmt.Errorf("network %q: %w", name, ErrNetworkInUse)
	}
	return nil
}

// CountAddresses returns how many IPAM addresses each network has handed out.
func (s *Store) CountAddresses(ctx context.Context) (map[string]int64, error) {
	var rows []struct {
		Network string
		N       int64
	}
	err := s.db.WithContext(ctx).Raw("SELECT network, COUNT(address) AS n FROM vm_nics GROUP BY network").Scan(&rows).Error
	if err != nil {
		return nil, fmt.Errorf("count addresses: %w", err)
	}
	out := make(map[string]int64, len(rows))
	for _, r := range rows {
		out[r.Network] = r.N
	}
	return out, nil
}

// AddressHolder returns the VM that holds an address on a network;
// ErrNotFound when it is free.
func (s *Store) AddressHolder(ctx context.Context, network string, address int64) (NetworkUser, error) {
	var out []NetworkUser
	err := s.db.WithContext(ctx).Raw(`SELECT v.id AS vm_id, v.name AS name FROM vm_nics n JOIN vms v ON v.id = n.vm_id
		WHERE n.network = ? AND n.address = ?`, network, address).Scan(&out).Error
	if err != nil {
		return NetworkUser{}, fmt.Errorf("read holder of an address on network %q: %w", network, err)
	}
	if len(out) == 0 {
		return NetworkUser{}, fmt.Errorf("address on network %q: %w", network, ErrNotFound)
	}
	return out[0], nil
}

// FreeAddresses returns up to limit free addresses of the network, lowest
// first, found from the gaps after held addresses (one pass over the
// network's index entries). It is the fallback when cheap probes keep
// hitting held addresses; empty means the network is full.
func (s *Store) FreeAddresses(ctx context.Context, n Network, limit int) ([]int64, error) {
	var out []int64
	err := s.db.WithContext(ctx).Raw(`SELECT c FROM (
			SELECT CAST(? AS BIGINT) AS c
			UNION SELECT CAST(? AS BIGINT) + 1
			UNION SELECT address + 1 FROM vm_nics WHERE network = ? AND address IS NOT NULL
		) cand
		WHERE c BETWEEN ? AND ? AND c <> ?
			AND NOT EXISTS (SELECT 1 FROM vm_nics WHERE network = ? AND address = cand.c)
		ORDER BY c LIMIT ?`,
		n.RangeFirst, n.GatewayNum, n.Name, n.RangeFirst, n.RangeLast, n.GatewayNum, n.Name, limit).Scan(&out).Error
	if err != nil {
		return nil, fmt.Errorf("find free addresses on network %q: %w", n.Name, err)
	}
	return out, nil
}

// insertNICsSQL inserts one vm_nics row (vm, index, network, mac, address).
const insertNICSQL = `INSERT INTO vm_nics (vm_id, nic_index, network, mac_address, address) VALUES (?, ?, ?, ?, ?)`

func nicAddress(n NIC) any {
	if n.Address == 0 {
		return nil
	}
	return n.Address
}

// insertNICRows writes the live NIC rows of a VM and classifies a refusal.
func insertNICRows(exec func(args ...any) error, vmID string, nics []NIC) error {
	for i, n := range nics {
		if err := exec(vmID, i, n.Network, n.MACAddress, nicAddress(n)); err != nil {
			return classifyNICError(err, vmID, n)
		}
	}
	return nil
}

// classifyNICError names the arbiter that refused a NIC row. SQLite names
// the columns of the violated index; PostgreSQL names the constraint.
func classifyNICError(err error, vmID string, n NIC) error {
	if err == nil {
		return nil
	}
	msg := err.Error()
	constraint := pgConstraint(err)
	switch {
	case constraint == "vm_nics_address" || strings.Contains(msg, "vm_nics.network, vm_nics.address"):
		return fmt.Errorf("vm %s: address %s on network %q: %w", vmID, n.IPv4Address, n.Network, ErrAddressTaken)
	case constraint == "vm_nics_mac" || strings.Contains(msg, "vm_nics.mac_address"):
		return fmt.Errorf("vm %s: MAC %s: %w", vmID, n.MACAddress, ErrMACTaken)
	}
	return fmt.Errorf("insert NIC of vm %s on network %q: %w", vmID, n.Network, err)
}

// SetVMNICs records the NICs as the agent reported them (MACs and
// forwarded ports) on a VM's row, and a changed MAC on its live rows.
func (s *Store) SetVMNICs(ctx context.Context, id string, nics []NIC) error {
	text, err := jsonText(nics)
	if err != nil {
		return err
	}
	return s.inTx(ctx, func(tx *gorm.DB) error {
		if err := updateVMRow(tx, "record NICs of", id, "UPDATE vms SET nics = ?, updated_at = ? WHERE id = ?", text, now(), id); err != nil {
			return err
		}
		setMAC := s.rawExec(ctx, tx, "UPDATE vm_nics SET mac_address = ? WHERE vm_id = ? AND nic_index = ? AND mac_address <> ?")
		for i, n := range nics {
			if err := setMAC(n.MACAddress, id, i, n.MACAddress); err != nil {
				return classifyNICError(err, id, n)
			}
		}
		return nil
	})
}

// LiveNIC is a row of vm_nics.
type LiveNIC struct {
	VMID       string `gorm:"column:vm_id"`
	Index      int    `gorm:"column:nic_index"`
	Network    string `gorm:"column:network"`
	MACAddress string `gorm:"column:mac_address"`
	Address    int64  `gorm:"column:address"`
}

// LiveNICs returns every vm_nics row (for checks and tools).
func (s *Store) LiveNICs(ctx context.Context) ([]LiveNIC, error) {
	var out []LiveNIC
	err := s.db.WithContext(ctx).Raw(`SELECT vm_id, nic_index, network, mac_address, COALESCE(address, 0) AS address
		FROM vm_nics ORDER BY vm_id, nic_index`).Scan(&out).Error
	if err != nil {
		return nil, fmt.Errorf("list NICs: %w", err)
	}
	return out, nil
}

// OverlayNIC is a live NIC on an overlay network with the host its VM is
// placed on (a migrating VM: the host its row names until the switch).
type OverlayNIC struct {
	VMID       string `gorm:"column:vm_id"`
	Network    string `gorm:"column:network"`
	MACAddress string `gorm:"column:mac_address"`
	Address    int64  `gorm:"column:address"`
	Host       string `gorm:"column:host_name"`
}

// OverlayNICs returns every live NIC on an overlay network, by network,
// host and MAC: what the agents' VXLAN forwarding entries are made from.
func (s *Store) OverlayNICs(ctx context.Context) ([]OverlayNIC, error) {
	var out []OverlayNIC
	err := s.db.WithContext(ctx).Raw(`SELECT n.vm_id, n.network, n.mac_address, COALESCE(n.address, 0) AS address, v.host_name
		FROM vm_nics n JOIN vms v ON v.id = n.vm_id JOIN networks w ON w.name = n.network
		WHERE w.mode = ? AND v.host_name <> '' ORDER BY n.network, v.host_name, n.mac_address`, NetworkModeOverlay).Scan(&out).Error
	if err != nil {
		return nil, fmt.Errorf("list NICs on overlay networks: %w", err)
	}
	return out, nil
}
