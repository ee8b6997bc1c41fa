package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"gorm.io/gorm"
	"gorm.io/gorm/clause"
)

// Resources is an amount of capacity in whole vCPUs and MiB.
type Resources struct {
	VCPUs     int64 `gorm:"column:vcpus"`
	MemoryMiB int64 `gorm:"column:memory_mib"`
	DiskMiB   int64 `gorm:"column:disk_mib"`
}

// PoolTarget is one warm pool shape a host should keep.
type PoolTarget struct {
	Image     string `json:"image"`
	VCPUs     int64  `json:"vcpus"`
	MemoryMiB int64  `json:"memory_mib"`
	DiskMiB   int64  `json:"disk_mib"`
	Size      int    `json:"size"`
}

// Host is a row of hosts.
type Host struct {
	Name               string            `gorm:"column:name;primaryKey"`
	Address            string            `gorm:"column:address"`
	Labels             map[string]string `gorm:"column:labels;serializer:json"`
	Schedulable        bool              `gorm:"column:schedulable"`
	Alive              bool              `gorm:"column:alive"`
	MissedSyncs        int               `gorm:"column:missed_syncs"`
	LastSeen           *time.Time        `gorm:"column:last_seen"`
	Accel              string            `gorm:"column:accel"`
	Driver             string            `gorm:"column:driver"`
	Images             []string          `gorm:"column:images;serializer:json"`
	CPUAllocationRatio float64           `gorm:"column:cpu_allocation_ratio"`
	MemoryReservedMiB  int64             `gorm:"column:memory_reserved_mib"`
	Total              Resources         `gorm:"embedded;embeddedPrefix:total_"`
	Capacity           Resources         `gorm:"embedded;embeddedPrefix:cap_"`
	Allocated          Resources         `gorm:"embedded;embeddedPrefix:alloc_"`
	// Warm is what the host's warm pool holds, as its agent last reported.
	Warm     Resources    `gorm:"embedded;embeddedPrefix:warm_"`
	WarmPool []PoolTarget `gorm:"column:warm_pool;serializer:json"`
	// Isolation is how the agent holds each VM to its shape.
	Isolation string `gorm:"column:isolation"`
	// RetiredAt is when the host was retired (its agent gone for good); nil
	// for a host in service.
	RetiredAt *time.Time `gorm:"column:retired_at"`
	// AgentKey is the ed25519 public key (base64) the host's agent proved;
	// "" until it has (hosts registered before agents joined).
	AgentKey string `gorm:"column:agent_key"`
	// UnderlayAddress is the IPv4 address the host's VXLAN tunnels run
	// from ("" when it takes no overlay NIC); its agent proved it.
	UnderlayAddress string `gorm:"column:underlay_address"`
	// Drain is the host's drain (drain.go): its state ("" in service) and
	// progress.
	Drain Drain `gorm:"embedded;embeddedPrefix:drain_"`
	// AgentRelease and AgentAPILevel are the agent's kvmd as it last
	// reported (level 0: not yet seen, or a release before levels);
	// AgentRefused says why the control plane refuses the agent ("" when
	// it is within the skew contract).
	AgentRelease  string    `gorm:"column:agent_release"`
	AgentAPILevel int       `gorm:"column:agent_api_level"`
	AgentRefused  string    `gorm:"column:agent_refused"`
	CreatedAt     time.Time `gorm:"column:created_at"`
	UpdatedAt     time.Time `gorm:"column:updated_at"`
}

// TableName is the table of Host.
func (Host) TableName() string { return "hosts" }

// HostFacts is what a host's agent reports about itself.
type HostFacts struct {
	Total Resources
	// Warm is what the warm pool holds; Isolation as in Host.
	Warm      Resources
	Isolation string
	Accel     string
	Driver    string
	Images    []string
	// Release and APILevel are the agent's kvmd (internal/version).
	Release  string
	APILevel int
}

// CapacityFunc computes usable capacity from totals, the vCPU allocation
// ratio and reserved memory (the scheduler's rule, passed in so the store
// holds no placement policy).
type CapacityFunc func(total Resources, cpuRatio float64, memoryReservedMiB int64) Resources

// UpsertHost registers a host or updates its configuration and facts. The
// allocation of an existing host is kept. The host is marked alive: its
// agent just answered.
func (s *Store) UpsertHost(ctx context.Context, h Host) (Host, error) {
	if err := s.UpsertHosts(ctx, []Host{h}); err != nil {
		return Host{}, err
	}
	return s.GetHost(ctx, h.Name)
}

// UpsertHosts is UpsertHost for many hosts in one transaction (bulk
// registration, benchmarks).
func (s *Store) UpsertHosts(ctx context.Context, hosts []Host) error {
	t := now()
	rows := make([]Host, len(hosts))
	for i, h := range hosts {
		h.CreatedAt, h.UpdatedAt, h.LastSeen = t, t, &t
		h.Alive, h.MissedSyncs = true, 0
		h.Allocated = Resources{}
		if h.Labels == nil {
			h.Labels = map[string]string{}
		}
		if h.Images == nil {
			h.Images = []string{}
		}
		if h.WarmPool == nil {
			h.WarmPool = []PoolTarget{}
		}
		if h.Drain.Failed == nil {
			h.Drain.Failed = DrainFailures{}
		}
		rows[i] = h
	}
	err := s.inTx(ctx, func(tx *gorm.DB) error {
		return tx.Clauses(clause.OnConflict{
			Columns: []clause.Column{{Name: "name"}},
			DoUpdates: clause.AssignmentColumns([]string{
				"address", "labels", "schedulable", "alive", "missed_syncs", "last_seen", "accel", "driver", "images",
				"cpu_allocation_ratio", "memory_reserved_mib", "total_vcpus", "total_memory_mib", "total_disk_mib",
				"cap_vcpus", "cap_memory_mib", "cap_disk_mib", "warm_pool", "agent_key", "updated_at",
				"warm_vcpus", "warm_memory_mib", "warm_disk_mib", "isolation", "underlay_address",
			}),
			// A retired host stays retired: it never comes back alive.
			Where: clause.Where{Exprs: []clause.Expression{clause.Expr{SQL: "hosts.retired_at IS NULL"}}},
		}).CreateInBatches(&rows, 200).Error
	})
	if err != nil && isDuplicate(err) {
		err = fmt.Errorf("%w: %v", ErrAgentKeyTaken, err)
	}
	if err != nil {
		if len(hosts) == 1 {
			return fmt.Errorf("save host %s: %w", hosts[0].Name, err)
		}
		return fmt.Errorf("save %d hosts: %w", len(hosts), err)
	}
	return nil
}

// GetHost returns one host; ErrNotFound when it is not registered.
func (s *Store) GetHost(ctx context.Context, name string) (Host, error) {
	var h Host
	err := s.db.WithContext(ctx).Where("name = ?", name).Take(&h).Error
	if errors.Is(err, gorm.ErrRecordNotFound) {
		return Host{}, fmt.Errorf("host %s: %w", name, ErrNotFound)
	}
	if err != nil {
		return Host{}, fmt.Errorf("read host %s: %w", name, err)
	}
	return h, nil
}

// HostWithAgentKey returns the host whose agent proved key; ErrNotFound
// when none has.
func (s *Store) HostWithAgentKey(ctx context.Context, key string) (Host, error) {
	var h Host
	err := s.db.WithContext(ctx).Where("agent_key = ? AND agent_key <> ''", key).Take(&h).Error
	if errors.Is(err, gorm.ErrRecordNotFound) {
		return Host{}, fmt.Errorf("host with agent key %s: %w", key, ErrNotFound)
	}
	if err != nil {
		return Host{}, fmt.Errorf("read host with agent key: %w", err)
	}
	return h, nil
}

// PinHostKey records the key the agent of a host without one proved at
// address. It changes nothing (and says so with ErrNotFound) when the host
// was re-registered, moved or pinned meanwhile.
func (s *Store) PinHostKey(ctx context.Context, name, address, key string) error {
	res := s.db.WithContext(ctx).Exec(`UPDATE hosts SET agent_key = ?, updated_at = ?
		WHERE name = ? AND address = ? AND agent_key = ''`, key, now(), name, address)
	if res.Error != nil {
		if isDuplicate(res.Error) {
			return fmt.Errorf("pin agent key of host %s: %w", name, ErrAgentKeyTaken)
		}
		return fmt.Errorf("pin agent key of host %s: %w", name, res.Error)
	}
	if res.RowsAffected != 1 {
		return fmt.Errorf("pin agent key of host %s at %s: %w", name, address, ErrNotFound)
	}
	return nil
}

// ListHosts returns up to limit hosts with names after `after`, by name.
func (s *Store) ListHosts(ctx context.Context, after string, limit int) ([]Host, error) {
	var hs []Host
	if err := keysetPage(s.db.WithContext(ctx), "name", after, limit).Find(&hs).Error; err != nil {
		return nil, fmt.Errorf("list hosts: %w", err)
	}
	return hs, nil
}

// AllHosts returns every host, by name.
func (s *Store) AllHosts(ctx context.Context) ([]Host, error) {
	var hs []Host
	if err := s.db.WithContext(ctx).Order("name").Find(&hs).Error; err != nil {
		return nil, fmt.Errorf("read hosts: %w", err)
	}
	return hs, nil
}

// DeleteHost deregisters a host that has no VMs. The conditions on the
// allocation make a reservation that commits first win on PostgreSQL (the
// DELETE re-checks the updated row); the foreign key from vms backs it up.
func (s *Store) DeleteHost(ctx context.Context, name string) error {
	var deleted int64
	err := s.inTx(ctx, func(tx *gorm.DB) error {
		res := tx.Exec(`DELETE FROM hosts WHERE name = ?
			AND alloc_vcpus = 0 AND alloc_memory_mib = 0 AND alloc_disk_mib = 0
			AND NOT EXISTS (SELECT 1 FROM vms WHERE vms.host_name = ?)`, name, name)
		if res.Error != nil {
			return res.Error
		}
		if deleted = res.RowsAffected; deleted == 0 {
			return nil
		}
		// The other replicas' host views learn of the delete from this
		// (HostChanges).
		return tx.Exec("INSERT INTO deleted_hosts (name, deleted_at) VALUES (?, ?)", name, now()).Error
	})
	if err != nil {
		if isForeignKey(err) {
			return fmt.Errorf("host %s: %w", name, ErrHostInUse)
		}
		return fmt.Errorf("delete host %s: %w", name, err)
	}
	if deleted == 1 {
		return nil
	}
	if _, err := s.GetHost(ctx, name); err != nil {
		return err
	}
	return fmt.Errorf("host %s: %w", name, ErrHostInUse)
}

// CountVMsOnHost counts the VM rows placed on a host.
func (s *Store) CountVMsOnHost(ctx context.Context, name string) (int64, error) {
	var n int64
	err := s.db.WithContext(ctx).Model(&VM{}).Where("host_name = ?", name).Count(&n).Error
	return n, err
}

// RecordHostSeen stores what the agent just reported and marks the host
// alive. The capacity is recomputed with the host's current ratio and
// reserved memory; the UPDATE is conditional on those so that a concurrent
// PUT that changes them is never overwritten with stale figures.
func (s *Store) RecordHostSeen(ctx context.Context, name string, f HostFacts, capacity CapacityFunc) error {
	if f.Images == nil {
		f.Images = []string{}
	}
	images, err := jsonText(f.Images)
	if err != nil {
		return err
	}
	for range 3 {
		h, err := s.GetHost(ctx, name)
		if err != nil {
			return err
		}
		if h.RetiredAt != nil {
			return fmt.Errorf("record sync of host %s: %w", name, ErrHostRetired)
		}
		c := capacity(f.Total, h.CPUAllocationRatio, h.MemoryReservedMiB)
		t := now()
		res := s.db.WithContext(ctx).Exec(`UPDATE hosts SET alive = TRUE, missed_syncs = 0, last_seen = ?,
			accel = ?, driver = ?, images = ?,
			total_vcpus = ?, total_memory_mib = ?, total_disk_mib = ?,
			cap_vcpus = ?, cap_memory_mib = ?, cap_disk_mib = ?,
			warm_vcpus = ?, warm_memory_mib = ?, warm_disk_mib = ?, isolation = ?,
			agent_release = ?, agent_api_level = ?, agent_refused = '', updated_at = ?
			WHERE name = ? AND cpu_allocation_ratio = ? AND memory_reserved_mib = ? AND retired_at IS NULL`,
			t, f.Accel, f.Driver, images,
			f.Total.VCPUs, f.Total.MemoryMiB, f.Total.DiskMiB,
			c.VCPUs, c.MemoryMiB, c.DiskMiB,
			f.Warm.VCPUs, f.Warm.MemoryMiB, f.Warm.DiskMiB, f.Isolation, f.Release, f.APILevel, t,
			name, h.CPUAllocationRatio, h.MemoryReservedMiB)
		if res.Error != nil {
			return fmt.Errorf("record sync of host %s: %w", name, res.Error)
		}
		if res.RowsAffected == 1 {
			return nil
		}
	}
	return fmt.Errorf("record sync of host %s: its configuration kept changing; the next sync retries", name)
}

// RecordHostRefused marks the host dead at once because its agent is
// outside the skew contract: nothing is placed on it and no spec goes to
// it; why says so with both versions. Its VMs' rows stay as they are. It
// returns whether the host was alive before.
func (s *Store) RecordHostRefused(ctx context.Context, name, release string, level int, why string) (bool, error) {
	h, err := s.GetHost(ctx, name)
	if err != nil {
		return false, err
	}
	res := s.db.WithContext(ctx).Exec(`UPDATE hosts SET alive = FALSE, missed_syncs = missed_syncs + 1,
		agent_release = ?, agent_api_level = ?, agent_refused = ?, updated_at = ? WHERE name = ?`,
		release, level, why, now(), name)
	if res.Error != nil {
		return false, fmt.Errorf("record refused agent of host %s: %w", name, res.Error)
	}
	return h.Alive, nil
}

// RecordHostMissed counts a failed sync and marks the host dead once it
// has missed deadAfter syncs in a row. It returns whether the host is
// still alive.
func (s *Store) RecordHostMissed(ctx context.Context, name string, deadAfter int) (bool, error) {
	res := s.db.WithContext(ctx).Exec(`UPDATE hosts SET missed_syncs = missed_syncs + 1,
		alive = CASE WHEN missed_syncs + 1 >= ? THEN FALSE ELSE alive END, updated_at = ?
		WHERE name = ?`, deadAfter, now(), name)
	if res.Error != nil {
		return false, fmt.Errorf("record missed sync of host %s: %w", name, res.Error)
	}
	h, err := s.GetHost(ctx, name)
	if err != nil {
		return false, err
	}
	return h.Alive, nil
}

// HostsAlive says, for each named host that exists, whether it is alive.
func (s *Store) HostsAlive(ctx context.Context, names []string) (map[string]bool, error) {
	var rows []struct {
		Name  string
		Alive bool
	}
	if len(names) == 0 {
		return map[string]bool{}, nil
	}
	if err := s.db.WithContext(ctx).Model(&Host{}).Select("name", "alive").Where("name IN ?", names).Scan(&rows).Error; err != nil {
		return nil, fmt.Errorf("read host liveness: %w", err)
	}
	out := make(map[string]bool, len(rows))
	for _, r := range rows {
		out[r.Name] = r.Alive
	}
	return out, nil
}
