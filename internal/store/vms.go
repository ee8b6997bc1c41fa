package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"gorm.io/gorm"
	"gorm.io/gorm/clause"
)

// VM is a row of vms.
type VM struct {
	ID   string `gorm:"column:id;primaryKey"`
	Name string `gorm:"column:name"`
	// Project owns the VM; its usage counts the VM while it holds capacity.
	Project       string    `gorm:"column:project"`
	HostName      string    `gorm:"column:host_name"`
	Image         string    `gorm:"column:image"`
	Resources     Resources `gorm:"embedded"`
	PowerState    string    `gorm:"column:power_state"`
	ObservedState string    `gorm:"column:observed_state"`
	Reason        string    `gorm:"column:reason"`
	StartedFrom   string    `gorm:"column:started_from"`
	HoldsCapacity bool      `gorm:"column:holds_capacity"`
	ForkID        *string   `gorm:"column:fork_id"`
	// ForkSlot is a fork child's fixed slot (unique per fork).
	ForkSlot *int              `gorm:"column:fork_slot"`
	Labels   map[string]string `gorm:"column:labels;serializer:json"`
	// NICs are the VM's network interfaces; while the VM holds capacity
	// each also has a vm_nics row (its MAC and IPAM address).
	NICs []NIC `gorm:"column:nics;serializer:json"`
	// Placement is the placement explanation as JSON (written by control).
	Placement string `gorm:"column:placement"`
	// PendingVCPUs and PendingMemoryMiB are the shape an unsettled resize
	// applies (resize.go); nil when none is pending.
	PendingVCPUs     *int64     `gorm:"column:pending_vcpus"`
	PendingMemoryMiB *int64     `gorm:"column:pending_memory_mib"`
	ResizeStartedAt  *time.Time `gorm:"column:resize_started_at"`
	// Constraints are the VM's placement constraints as JSON ("" for none).
	Constraints string `gorm:"column:constraints"`
	// Group is the slot the VM holds in group_domains while it holds
	// capacity: its group, spread_by, domain and the cap it was placed
	// under. Empty Group: no slot.
	Group GroupSlot `gorm:"embedded"`
	// Owner is the control replica whose request runs the VM's create or
	// resize (replicas.go); nil for rows written before replica leases.
	Owner *string `gorm:"column:owner_replica"`
	// Guest is the VM's guest configuration (its NoCloud seed); nil for a
	// VM without one. Set at create, never changed.
	Guest *Guest `gorm:"column:guest;serializer:json"`
	// GuestAgent: the VM has the QEMU guest agent channel. Set at create
	// (a fork child: its source's), never changed.
	GuestAgent bool `gorm:"column:guest_agent"`
	// SecureBoot says the VM boots with Secure Boot on (a uefi image).
	SecureBoot bool      `gorm:"column:secure_boot"`
	CreatedAt  time.Time `gorm:"column:created_at"`
	UpdatedAt  time.Time `gorm:"column:updated_at"`
	// ProjectGeneration is the generation of the project that the caller
	// placed the VM by (its host labels); a reservation finds the project
	// at that generation or places nothing (ErrProjectChanged). Zero:
	// any generation. Not a column.
	ProjectGeneration int64 `gorm:"-"`
	// Volumes are the volumes a VM is created with: attached in its
	// reservation's transaction (volumes.go). Not a column.
	Volumes []VMVolume `gorm:"-"`
}

// Guest is a VM's guest configuration as the control plane keeps it (JSON
// in vms.guest and forks.guest). UserData is held in the clear.
type Guest struct {
	UserData          string            `json:"user_data,omitempty"`
	SSHAuthorizedKeys []string          `json:"ssh_authorized_keys,omitempty"`
	MetaData          map[string]string `json:"meta_data,omitempty"`
	NetworkConfig     string            `json:"network_config,omitempty"`
	// Hostname is the effective local-hostname.
	Hostname string `json:"hostname,omitempty"`
}

// guestValue is g as the column stores it: JSON text, NULL for none.
func guestValue(g *Guest) (any, error) {
	if g == nil {
		return nil, nil
	}
	return jsonText(g)
}

// GroupSlot is a VM's place in its group: the domain it counts in.
type GroupSlot struct {
	Name     string `gorm:"column:group_name"`
	SpreadBy string `gorm:"column:spread_by"`
	Domain   string `gorm:"column:spread_domain"`
	// Cap is max_per_domain (0: no cap).
	Cap int `gorm:"column:group_cap"`
}

// TableName is the table of VM.
func (VM) TableName() string { return "vms" }

type vmLabel struct {
	VMID  string `gorm:"column:vm_id;primaryKey"`
	Key   string `gorm:"column:label_key;primaryKey"`
	Value string `gorm:"column:label_value"`
}

func (vmLabel) TableName() string { return "vm_labels" }

// ReserveAndInsertVM is the atomic reservation: one conditional UPDATE adds
// the VM's resources to its host only if they fit, and the VM row (with
// its labels) is inserted in the same transaction (on SQLite, a transaction
// shared with concurrent reservations; see batch.go). A VM of a group also
// takes a slot in its domain (takeGroupSlot) in the same transaction.
// ErrNoRoom when the host (as the database sees it now) cannot take the VM
// or is not alive and schedulable; ErrGroupCap when the VM's group is at
// its cap in the domain; ErrDuplicateName when the name is taken.
func (s *Store) ReserveAndInsertVM(ctx context.Context, vm VM) error {
	t := now()
	if vm.CreatedAt.IsZero() {
		vm.CreatedAt = t
	}
	vm.UpdatedAt, vm.HoldsCapacity = t, true
	if vm.Project == "" {
		vm.Project = DefaultProject
	}
	if vm.Labels == nil {
		vm.Labels = map[string]string{}
	}
	if vm.NICs == nil {
		vm.NICs = []NIC{}
	}
	var err error
	if len(vm.Volumes) > 0 && s.dialect == DialectSQLite {
		err = s.reserveVMWithVolumes(ctx, vm)
		if isDuplicate(err) && !errors.Is(err, ErrAddressTaken) && !errors.Is(err, ErrMACTaken) {
			return fmt.Errorf("vm name %q: %w", vm.Name, ErrDuplicateName)
		}
		if err != nil && !isQuota(err) && !errors.Is(err, ErrNoRoom) && !errors.Is(err, ErrProjectChanged) &&
			!errors.Is(err, ErrGroupCap) && !errors.Is(err, ErrAddressTaken) && !errors.Is(err, ErrMACTaken) &&
			!errors.Is(err, ErrVolumeAttached) && !errors.Is(err, ErrVolumeNotReady) {
			return fmt.Errorf("reserve vm %s on host %s: %w", vm.ID, vm.HostName, err)
		}
		return err
	}
	if s.dialect == DialectPostgres && !sharesCommits(vm) {
		err = s.reserveInOneStatement(ctx, vm)
	} else {
		err = s.batcher.reserve(ctx, vm)
	}
	if s.dialect == DialectPostgres && quotaResource(err) != "" {
		// The project's row refused it, maybe only for what the quota
		// leases of its committers hold: the last word takes them back.
		err = s.reserveReclaiming(ctx, vm)
	}
	if errors.Is(err, ErrNoRoom) && len(vm.Volumes) > 0 {
		// The statement placed nothing: its host, or one of its volumes.
		if verr := s.volumesAttachable(ctx, vm); verr != nil {
			err = verr
		}
	}
	switch {
	case quotaResource(err) != "":
		// The PostgreSQL statement's CHECK: read the figures for the error.
		return quotaError(s.db.WithContext(ctx), vm.Project, quotaResource(err), vmShare(vm))
	case err == nil || errors.Is(err, ErrNoRoom) || isQuota(err) || errors.Is(err, ErrProjectChanged) || errors.Is(err, ErrGroupCap) ||
		errors.Is(err, ErrAddressTaken) || errors.Is(err, ErrMACTaken) || errors.Is(err, ErrVolumeAttached) || errors.Is(err, ErrVolumeNotReady):
		return err
	case pgCode(err) == "23514": // group_domains_cap: the slot's CHECK
		return fmt.Errorf("group %q already has %d VMs in %s %s: %w", vm.Group.Name, vm.Group.Cap, vm.Group.SpreadBy, vm.Group.Domain, ErrGroupCap)
	case isDuplicate(err):
		return fmt.Errorf("vm name %q: %w", vm.Name, ErrDuplicateName)
	case isForeignKey(err):
		return fmt.Errorf("host %s: %w", vm.HostName, ErrNotFound)
	}
	return fmt.Errorf("reserve vm %s on host %s: %w", vm.ID, vm.HostName, err)
}

// reserveOnHostSQL is the conditional UPDATE of a reservation (arguments:
// vcpus, memory, disk, host, then vcpus, memory, disk again).
const reserveOnHostSQL = `UPDATE hosts SET
	alloc_vcpus = alloc_vcpus + ?, alloc_memory_mib = alloc_memory_mib + ?, alloc_disk_mib = alloc_disk_mib + ?
	WHERE name = ? AND alive AND schedulable AND drain_state = ''
	AND alloc_vcpus + ? <= cap_vcpus AND alloc_memory_mib + ? <= cap_memory_mib AND alloc_disk_mib + ? <= cap_disk_mib`

// reserveInOneStatement is the same reservation on PostgreSQL as one
// statement: data-modifying CTEs run the conditional UPDATE, the group
// slot and the VM insert (only if the UPDATE matched) and the label
// inserts atomically, in one round trip instead of four (BEGIN, UPDATE,
// INSERT, COMMIT). A group at its cap fails the statement with the CHECK
// group_domains_cap (SQLSTATE 23514): the slot's upsert locks the group's
// row of that domain, so a racing create of the same group on any replica
// waits and then sees the new count; two never take the last slot.
func (s *Store) reserveInOneStatement(ctx context.Context, vm VM) error {
	query, args, err := reserveStatement(vm, reservation{chargeProject: true})
	if err != nil {
		return err
	}
	// Straight to database/sql, not through gorm: the statement is already
	// SQL with $n placeholders, and gorm's Raw + Scan rebuilt it and
	// rendered it with its arguments for a trace log on every call (a tenth
	// of a placement's CPU).
	sqlDB, err := s.db.DB()
	if err != nil {
		return err
	}
	var placed, project, lease int
	for attempt := 0; ; attempt++ {
		s.statements.Add(1)
		err = sqlDB.QueryRowContext(ctx, query, args...).Scan(&placed, &project, &lease)
		if !retryable(err) || attempt == 4 || ctx.Err() != nil {
			break
		}
	}
	if err != nil {
		// A taken address or MAC (unique indexes of vm_nics) is told
		// apart before ReserveAndInsertVM's other classifications.
		if pgCode(err) == "23505" {
			if c := pgConstraint(err); strings.HasPrefix(c, "vm_nics") {
				return classifyNICError(err, vm.ID, nicOfConstraint(err, vm.NICs))
			}
		}
		return err
	}
	return reservationOutcome(vm, placed, project)
}

// reservationOutcome is the error of a reservation statement that placed
// placed VMs and found the project (at the generation asked) project times.
func reservationOutcome(vm VM, placed, project int) error {
	switch {
	case placed == 1:
		return nil
	case project == 0:
		return fmt.Errorf("project %q (generation %d): %w", vm.Project, vm.ProjectGeneration, ErrProjectChanged)
	}
	return fmt.Errorf("host %s: %w", vm.HostName, ErrNoRoom)
}

// takeGroupSlotSQL counts one more VM of a group in a domain, only while
// the domain is under the cap (arguments: group, spread_by, domain, cap,
// cap, cap). Zero rows affected means the domain is full.
const takeGroupSlotSQL = `INSERT INTO group_domains (group_name, spread_by, domain, vm_count, vm_cap) VALUES (?, ?, ?, 1, ?)
	ON CONFLICT (group_name, spread_by, domain) DO UPDATE SET vm_count = group_domains.vm_count + 1, vm_cap = excluded.vm_cap
	WHERE ? = 0 OR group_domains.vm_count < ?`

// takeGroupSlot takes vm's slot in its group; ErrGroupCap when the domain
// is at the cap. A VM without a group takes none.
func takeGroupSlot(tx *gorm.DB, vm VM) error {
	g := vm.Group
	if g.Name == "" {
		return nil
	}
	res := tx.Exec(takeGroupSlotSQL, g.Name, g.SpreadBy, g.Domain, g.Cap, g.Cap, g.Cap)
	if res.Error != nil {
		return fmt.Errorf("take slot of group %q in %s %s: %w", g.Name, g.SpreadBy, g.Domain, res.Error)
	}
	if res.RowsAffected != 1 {
		return fmt.Errorf("group %q already has %d VMs in %s %s: %w", g.Name, g.Cap, g.SpreadBy, g.Domain, ErrGroupCap)
	}
	return nil
}

// giveGroupSlot gives a group slot back (a release, or the undo of a
// reservation that failed after the slot was taken).
func giveGroupSlot(tx *gorm.DB, g GroupSlot) error {
	if g.Name == "" {
		return nil
	}
	return tx.Exec(`UPDATE group_domains SET vm_count = vm_count - 1
		WHERE group_name = ? AND spread_by = ? AND domain = ? AND vm_count > 0`, g.Name, g.SpreadBy, g.Domain).Error
}

// GroupCounts returns how many VMs of a group hold capacity in each domain
// of one spread (domains with none are left out): the facts the scheduler
// spreads by.
func (s *Store) GroupCounts(ctx context.Context, group, spreadBy string) (map[string]int, error) {
	// Plain rows, not gorm's Scan: a group spread over many domains reads
	// one row per domain on every placement.
	rows, err := s.db.WithContext(ctx).Raw(`SELECT domain, vm_count FROM group_domains
		WHERE group_name = ? AND spread_by = ? AND vm_count > 0`, group, spreadBy).Rows()
	if err != nil {
		return nil, fmt.Errorf("count vms of group %q per domain: %w", group, err)
	}
	defer func() { _ = rows.Close() }()
	out := map[string]int{}
	for rows.Next() {
		var (
			domain string
			n      int
		)
		if err := rows.Scan(&domain, &n); err != nil {
			return nil, fmt.Errorf("count vms of group %q per domain: %w", group, err)
		}
		out[domain] = n
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("count vms of group %q per domain: %w", group, err)
	}
	return out, nil
}

// pgArgs collects the arguments of a PostgreSQL statement and names
// their placeholders ($1, $2, ...).
type pgArgs []any

// add appends the arguments and writes their placeholders to sql, each
// with its cast ("" for none), separated by commas.
func (a *pgArgs) add(sql *strings.Builder, casts []string, vals ...any) {
	for i, v := range vals {
		if i > 0 {
			sql.WriteString(", ")
		}
		*a = append(*a, v)
		sql.WriteByte('$')
		sql.WriteString(strconv.Itoa(len(*a)))
		if i < len(casts) && casts[i] != "" {
			sql.WriteString("::")
			sql.WriteString(casts[i])
		}
	}
}

// reservation says how a reservation statement counts the VM's usage.
type reservation struct {
	// chargeProject adds the usage to the project's row in the statement
	// (a lone reservation), and takes the group slot.
	chargeProject bool
	// leaseHolder, when set, spends the usage from that holder's quota
	// lease (a batched reservation, quota_leases.go): the host is reserved
	// only if the lease covers the VM.
	leaseHolder string
	// Neither: the caller counts the usage (reserveReclaiming).
}

// reserveStatement builds the reservation statement of reserveInOneStatement
// with PostgreSQL's $n placeholders. It returns three columns: how many
// VMs it placed (1 or 0), whether it found the project at the generation
// asked (1 or 0) and, for a leased reservation, whether the lease covered
// the VM (1 or 0; always 1 otherwise).
func reserveStatement(vm VM, how reservation) (string, []any, error) {
	labels, err := jsonText(vm.Labels)
	if err != nil {
		return "", nil, err
	}
	nics, err := jsonText(vm.NICs)
	if err != nil {
		return "", nil, err
	}
	guest, err := guestValue(vm.Guest)
	if err != nil {
		return "", nil, err
	}
	g := vm.Group
	r := vm.Resources
	// The resources are $1-$3, the host $4, the project $5, the project's
	// generation $6 (0: any) and the lease's holder $7; the WHERE, the
	// usage and the VM row reuse them.
	args := make(pgArgs, 0, 32+4*len(vm.NICs)+2*len(vm.Labels))
	args = append(args, r.VCPUs, r.MemoryMiB, r.DiskMiB, vm.HostName, vm.Project, vm.ProjectGeneration, how.leaseHolder)
	var sql strings.Builder
	sql.Grow(2048)
	// project_lock holds the project's row with FOR KEY SHARE: no delete
	// can pass it until the transaction ends, yet it waits for no usage
	// update and blocks none (a FOR NO KEY UPDATE lock). A project changed
	// since the caller read it (another generation) or deleted places
	// nothing: the statement's second column is then 0. Every writer locks
	// the rows in one order: quota leases, host, the project's usage row,
	// group slot. The hot usage row is written only by lone statements; a
	// batch spends from its committer's lease, a row no other batch writes.
	projectLock := " FOR KEY SHARE"
	if how.leaseHolder != "" {
		// A leased reservation needs no lock on the project's row: its
		// lease's row, locked below, keeps a delete of the project out
		// (DeleteProject deletes the leases first), and a lock on the row
		// that every committer's batches share costs PostgreSQL a
		// MultiXact per batch.
		projectLock = ""
	}
	sql.WriteString(`WITH `)
	if len(vm.Volumes) > 0 {
		// The volumes the VM attaches, locked (FOR UPDATE re-checks a row
		// another statement changed meanwhile) and counted only if each can
		// be attached: ready on the VM's host, not read-write elsewhere, and
		// for read-write in no VM at all.
		sql.WriteString(`want_volumes (id, ro) AS (VALUES `)
		for i, v := range vm.Volumes {
			if i > 0 {
				sql.WriteString(", ")
			}
			sql.WriteByte('(')
			args.add(&sql, []string{"text", "boolean"}, v.VolumeID, v.ReadOnly)
			sql.WriteByte(')')
		}
		sql.WriteString(`), volumes_free AS (
		SELECT volumes.id FROM volumes JOIN want_volumes AS want ON want.id = volumes.id
		WHERE volumes.host_name = $4 AND volumes.state = 'ready' AND volumes.rw_vm IS NULL AND (want.ro OR volumes.readers = 0)
		FOR UPDATE OF volumes
	), `)
	}
	sql.WriteString(`project_lock AS (
		SELECT name FROM projects WHERE name = $5::text AND ($6::bigint = 0 OR generation = $6::bigint)` + projectLock + `
	), lease AS (
		SELECT 1 FROM quota_leases WHERE $7::text <> '' AND project = $5::text AND holder = $7::text
			AND vcpus >= $1 AND memory_mib >= $2 AND disk_mib >= $3 AND vms >= 1
		FOR UPDATE
	), reserved AS (
		UPDATE hosts SET
			alloc_vcpus = alloc_vcpus + $1, alloc_memory_mib = alloc_memory_mib + $2, alloc_disk_mib = alloc_disk_mib + $3
		WHERE name = $4 AND alive AND schedulable AND drain_state = ''
			AND alloc_vcpus + $1 <= cap_vcpus AND alloc_memory_mib + $2 <= cap_memory_mib AND alloc_disk_mib + $3 <= cap_disk_mib
			AND EXISTS (SELECT 1 FROM project_lock)
			AND ($7::text = '' OR EXISTS (SELECT 1 FROM lease))`)
	if len(vm.Volumes) > 0 {
		// volumesFree (written before reserved below) locked the volumes
		// first: the host is reserved only if every one can be attached.
		sql.WriteString(` AND (SELECT COUNT(*) FROM volumes_free) = ` + strconv.Itoa(len(vm.Volumes)))
	}
	sql.WriteString(`
		RETURNING name
	)`)
	if len(vm.Volumes) > 0 {
		// Its volumes are taken in the statement, only if the host took the
		// VM; their rows were locked by volumes_free, before the host's.
		sql.WriteString(`, volumes_taken AS (
		UPDATE volumes SET rw_vm = CASE WHEN want.ro THEN volumes.rw_vm ELSE vm_id.id END,
			readers = volumes.readers + CASE WHEN want.ro THEN 1 ELSE 0 END, updated_at = now()
		FROM reserved, want_volumes AS want, (SELECT `)
		args.add(&sql, []string{"text"}, vm.ID)
		sql.WriteString(` AS id) AS vm_id
		WHERE volumes.id = want.id
		RETURNING volumes.id
	)`)
	}
	var usage string // the CTE the VM row also reads, so that it runs before it
	switch {
	case how.chargeProject:
		// Its usage grows only if the host took the VM; past a quota the
		// CHECK projects_<resource>_quota fails the whole statement, the
		// host's share with it.
		usage = "quota"
		sql.WriteString(`, quota AS (
		UPDATE projects SET used_vcpus = used_vcpus + $1, used_memory_mib = used_memory_mib + $2,
			used_disk_mib = used_disk_mib + $3, used_vms = used_vms + 1
		FROM reserved WHERE projects.name = $5::text
		RETURNING 1
	)`)
	case how.leaseHolder != "":
		usage = "spend"
		sql.WriteString(`, spend AS (
		UPDATE quota_leases SET vcpus = vcpus - $1, memory_mib = memory_mib - $2, disk_mib = disk_mib - $3, vms = vms - 1,
			renewed_at = now()
		FROM reserved WHERE project = $5::text AND holder = $7::text
		RETURNING 1
	)`)
	}
	if g.Name != "" && how.chargeProject {
		// The group slot, only if the host took the VM (batched VMs have
		// no group; reserveReclaiming takes the slot after the usage). Past the cap the
		// CHECK group_domains_cap fails the whole statement, so the host's
		// reservation goes with it.
		sql.WriteString(`, slot AS (
		INSERT INTO group_domains (group_name, spread_by, domain, vm_count, vm_cap)
		SELECT `)
		args.add(&sql, []string{"text", "text", "text"}, g.Name, g.SpreadBy, g.Domain)
		sql.WriteString(", 1, ")
		args.add(&sql, []string{"integer"}, g.Cap)
		sql.WriteString(` FROM reserved
		ON CONFLICT (group_name, spread_by, domain) DO UPDATE
			SET vm_count = group_domains.vm_count + 1, vm_cap = excluded.vm_cap
		RETURNING 1
	)`)
	}
	sql.WriteString(`, vm AS (
		INSERT INTO vms (id, name, project, host_name, image, vcpus, memory_mib, disk_mib, power_state, observed_state,
			reason, started_from, holds_capacity, fork_id, fork_slot, labels, nics, placement,
			constraints, group_name, spread_by, spread_domain, group_cap, owner_replica, guest, guest_agent, secure_boot, created_at, updated_at)
		SELECT `)
	args.add(&sql, []string{"text", "text"}, vm.ID, vm.Name)
	sql.WriteString(", $5::text, name, ")
	args.add(&sql, []string{"text"}, vm.Image)
	sql.WriteString(", $1, $2, $3, ")
	args.add(&sql, []string{"text", "text", "text", "text"}, vm.PowerState, vm.ObservedState, vm.Reason, vm.StartedFrom)
	sql.WriteString(", TRUE, ")
	args.add(&sql, []string{"text", "integer", "text", "text", "text", "text", "text", "text", "text", "integer", "text", "text", "boolean", "boolean", "timestamp", "timestamp"},
		vm.ForkID, vm.ForkSlot, labels, nics, vm.Placement,
		vm.Constraints, g.Name, g.SpreadBy, g.Domain, g.Cap, vm.Owner, guest, vm.GuestAgent, vm.SecureBoot, vm.CreatedAt, vm.UpdatedAt)
	// FROM the usage's CTE too: PostgreSQL runs a data-modifying CTE
	// whether or not it is read, but reading it keeps its place in the
	// plan plain (after the host's UPDATE, before the VM's row).
	if usage != "" {
		sql.WriteString(` FROM reserved, ` + usage + `
		RETURNING id
	)`)
	} else {
		sql.WriteString(` FROM reserved
		RETURNING id
	)`)
	}
	if len(vm.NICs) > 0 {
		// The unique indexes of vm_nics arbitrate addresses and MACs: a
		// taken one fails the whole statement, reservation included.
		sql.WriteString(`, nic AS (
		INSERT INTO vm_nics (vm_id, nic_index, network, mac_address, address)
		SELECT vm.id, n.i, n.net, n.mac, n.addr FROM vm, (VALUES `)
		for i, n := range vm.NICs {
			if i > 0 {
				sql.WriteString(", ")
			}
			sql.WriteByte('(')
			args.add(&sql, []string{"integer", "text", "text", "bigint"}, i, n.Network, n.MACAddress, nicAddress(n))
			sql.WriteByte(')')
		}
		sql.WriteString(`) AS n(i, net, mac, addr) RETURNING 1)`)
	}
	if len(vm.Volumes) > 0 {
		sql.WriteString(`, attachment AS (
		INSERT INTO volume_attachments (volume_id, vm_id, read_only, created_at)
		SELECT want.id, vm.id, want.ro, now() FROM vm, want_volumes AS want RETURNING 1)`)
	}
	if len(vm.Labels) > 0 {
		sql.WriteString(`, label AS (
		INSERT INTO vm_labels (vm_id, label_key, label_value)
		SELECT vm.id, l.k, l.v FROM vm, (VALUES `)
		first := true
		for k, v := range vm.Labels {
			if !first {
				sql.WriteString(", ")
			}
			first = false
			sql.WriteByte('(')
			args.add(&sql, []string{"text", "text"}, k, v)
			sql.WriteByte(')')
		}
		sql.WriteString(`) AS l(k, v) RETURNING 1)`)
	}
	sql.WriteString(` SELECT (SELECT COUNT(*) FROM vm), (SELECT COUNT(*) FROM project_lock),
		CASE WHEN $7::text = '' THEN 1 ELSE (SELECT COUNT(*) FROM lease) END`)
	return sql.String(), args, nil
}

func insertLabels(tx *gorm.DB, vmID string, labels map[string]string) error {
	if len(labels) == 0 {
		return nil
	}
	rows := make([]vmLabel, 0, len(labels))
	for k, v := range labels {
		rows = append(rows, vmLabel{VMID: vmID, Key: k, Value: v})
	}
	if err := tx.Create(&rows).Error; err != nil {
		return fmt.Errorf("insert labels of vm %s: %w", vmID, err)
	}
	return nil
}

// nicOfConstraint picks the NIC a PostgreSQL unique violation names in its
// detail ("Key (network, address)=(net, 167772162) already exists"), for
// the error message; the first NIC when it cannot tell.
func nicOfConstraint(err error, nics []NIC) NIC {
	var detail string
	if pg := pgDetail(err); pg != "" {
		detail = pg
	}
	for _, n := range nics {
		if (n.Address != 0 && strings.Contains(detail, fmt.Sprintf("(%s, %d)", n.Network, n.Address))) ||
			strings.Contains(detail, n.MACAddress) {
			return n
		}
	}
	if len(nics) == 0 {
		return NIC{}
	}
	return nics[0]
}

// releaseInTx gives the VM's resources back to its host if it still holds
// them. The conditional UPDATE on holds_capacity makes a release happen
// exactly once, whichever path (delete, missing, failed create) gets there.
// A pending resize ends with it: what the VM held for it goes back too.
func releaseInTx(tx *gorm.DB, vm VM) (bool, error) {
	res := tx.Exec(`UPDATE vms SET holds_capacity = FALSE, pending_vcpus = NULL, pending_memory_mib = NULL,
		resize_started_at = NULL, updated_at = ? WHERE id = ? AND holds_capacity`, now(), vm.ID)
	if res.Error != nil {
		return false, fmt.Errorf("release vm %s: %w", vm.ID, res.Error)
	}
	if res.RowsAffected == 0 {
		return false, nil
	}
	// The host's capacity goes first, then the project's usage, then the
	// group slot: the order in which reservations lock those rows, so the
	// two never deadlock.
	r := vm.held()
	res = tx.Exec(`UPDATE hosts SET alloc_vcpus = alloc_vcpus - ?, alloc_memory_mib = alloc_memory_mib - ?,
		alloc_disk_mib = alloc_disk_mib - ? WHERE name = ?`, r.VCPUs, r.MemoryMiB, r.DiskMiB, vm.HostName)
	if res.Error != nil {
		return false, fmt.Errorf("release vm %s on host %s: %w", vm.ID, vm.HostName, res.Error)
	}
	if err := creditProject(tx, vm.Project, vmShare(vm)); err != nil {
		return false, fmt.Errorf("release vm %s: %w", vm.ID, err)
	}
	if err := giveGroupSlot(tx, vm.Group); err != nil {
		return false, fmt.Errorf("release group slot of vm %s: %w", vm.ID, err)
	}
	// Its addresses and MACs go with its capacity.
	if err := tx.Exec("DELETE FROM vm_nics WHERE vm_id = ?", vm.ID).Error; err != nil {
		return false, fmt.Errorf("release addresses of vm %s: %w", vm.ID, err)
	}
	return true, nil
}

// DeleteVM releases the VM's capacity (if it still holds it) and removes
// the row in one transaction. It returns the deleted row and whether
// capacity was released.
func (s *Store) DeleteVM(ctx context.Context, id string) (VM, bool, error) {
	var (
		vm       VM
		released bool
	)
	err := s.inTx(ctx, func(tx *gorm.DB) error {
		var err error
		if vm, err = s.lockVM(tx, id); err != nil {
			return err
		}
		// Its volumes' rows before its host's: the lock order of volumes.
		if err := detachVolumesInTx(tx, id); err != nil {
			return err
		}
		if released, err = releaseInTx(tx, vm); err != nil {
			return err
		}
		if err := tx.Exec("DELETE FROM vm_labels WHERE vm_id = ?", id).Error; err != nil {
			return fmt.Errorf("delete labels of vm %s: %w", id, err)
		}
		if err := tx.Exec("DELETE FROM vms WHERE id = ?", id).Error; err != nil {
			return fmt.Errorf("delete vm %s: %w", id, err)
		}
		return tombstone(tx, vm)
	})
	return vm, released, err
}

// ReleaseVM marks a VM with a final observed state (missing, error) and
// releases its capacity in one transaction; it reports whether capacity
// was released by this call.
func (s *Store) ReleaseVM(ctx context.Context, id, observedState, reason string) (VM, bool, error) {
	var (
		vm       VM
		released bool
	)
	err := s.inTx(ctx, func(tx *gorm.DB) error {
		var err error
		if vm, err = s.lockVM(tx, id); err != nil {
			return err
		}
		if released, err = releaseInTx(tx, vm); err != nil || !released {
			return err
		}
		return tx.Exec("UPDATE vms SET observed_state = ?, reason = ?, updated_at = ? WHERE id = ?",
			observedState, reason, now(), id).Error
	})
	return vm, released, err
}

// GetVM returns one VM; ErrNotFound when there is none with this id.
func (s *Store) GetVM(ctx context.Context, id string) (VM, error) {
	return getVM(s.db.WithContext(ctx), id)
}

func getVM(db *gorm.DB, id string) (VM, error) {
	return takeVM(db.Where("id = ?", id), id)
}

// lockVM reads VM id in transaction tx and, on PostgreSQL, locks its row
// until tx ends (SELECT ... FOR UPDATE); SQLite transactions are serial
// already (BEGIN IMMEDIATE). Every transaction that moves a VM's capacity
// (release, delete, reclaim) reads the row this way first, so two of them
// never act on the same VM at once: without it a delete that found the VM
// holding nothing could remove it after a reclaim took capacity back,
// leaving the host allocated for ever.
func (s *Store) lockVM(tx *gorm.DB, id string) (VM, error) {
	q := tx.Where("id = ?", id)
	if s.dialect == DialectPostgres {
		q = q.Clauses(clause.Locking{Strength: "UPDATE"})
	}
	return takeVM(q, id)
}

func takeVM(q *gorm.DB, id string) (VM, error) {
	var vm VM
	err := q.Take(&vm).Error
	if errors.Is(err, gorm.ErrRecordNotFound) {
		return VM{}, fmt.Errorf("vm %s: %w", id, ErrNotFound)
	}
	if err != nil {
		return VM{}, fmt.Errorf("read vm %s: %w", id, err)
	}
	return vm, nil
}

// GetVMByName returns the VM of project with this name; ErrNotFound when none.
func (s *Store) GetVMByName(ctx context.Context, project, name string) (VM, error) {
	var vm VM
	err := s.db.WithContext(ctx).Where("project = ? AND name = ?", project, name).Take(&vm).Error
	if errors.Is(err, gorm.ErrRecordNotFound) {
		return VM{}, fmt.Errorf("vm named %q: %w", name, ErrNotFound)
	}
	if err != nil {
		return VM{}, fmt.Errorf("read vm named %q: %w", name, err)
	}
	return vm, nil
}

// VMFilter selects VMs in a list. Empty fields match everything.
type VMFilter struct {
	// Project, when set, is the one project whose VMs are listed.
	Project    string
	Host       string
	Name       string
	LabelKey   string
	LabelValue string
	ForkID     string
	// After is the last id of the previous page.
	After string
	Limit int
}

// ListVMs returns VMs matching f, ordered by id (ids are time-ordered).
func (s *Store) ListVMs(ctx context.Context, f VMFilter) ([]VM, error) {
	q := keysetPage(s.db.WithContext(ctx), "id", f.After, f.Limit)
	if f.Project != "" {
		q = q.Where("project = ?", f.Project)
	}
	if f.Host != "" {
		q = q.Where("host_name = ?", f.Host)
	}
	if f.Name != "" {
		q = q.Where("name = ?", f.Name)
	}
	if f.ForkID != "" {
		q = q.Where("fork_id = ?", f.ForkID)
	}
	if f.LabelKey != "" {
		q = q.Where("id IN (SELECT vm_id FROM vm_labels WHERE label_key = ? AND label_value = ?)", f.LabelKey, f.LabelValue)
	}
	var vms []VM
	if err := q.Find(&vms).Error; err != nil {
		return nil, fmt.Errorf("list vms: %w", err)
	}
	return vms, nil
}

// SetVMState records what the agent says about a VM: its observed state,
// reason and how it started. A VM already marked missing keeps that state.
func (s *Store) SetVMState(ctx context.Context, id, observedState, reason, startedFrom string) error {
	res := s.db.WithContext(ctx).Exec(`UPDATE vms SET observed_state = ?, reason = ?,
		started_from = CASE WHEN ? = '' THEN started_from ELSE ? END, updated_at = ?
		WHERE id = ? AND observed_state <> 'missing'`,
		observedState, reason, startedFrom, startedFrom, now(), id)
	if res.Error != nil {
		return fmt.Errorf("record state of vm %s: %w", id, res.Error)
	}
	return nil
}

// SetVMPower records a new desired power state and what the agent reported.
func (s *Store) SetVMPower(ctx context.Context, id, powerState, observedState, reason string) error {
	return updateVMRow(s.db.WithContext(ctx), "record power state of", id, `UPDATE vms SET power_state = ?, observed_state = ?,
		reason = ?, updated_at = ? WHERE id = ?`, powerState, observedState, reason, now(), id)
}

// updateVMRow runs an UPDATE of VM id's row; ErrNotFound when there is no
// such row. Errors say "<action> vm <id>".
func updateVMRow(db *gorm.DB, action, id, query string, args ...any) error {
	res := db.Exec(query, args...)
	if res.Error != nil {
		return fmt.Errorf("%s vm %s: %w", action, id, res.Error)
	}
	if res.RowsAffected == 0 {
		return fmt.Errorf("vm %s: %w", id, ErrNotFound)
	}
	return nil
}

// SetVMLabels replaces a VM's labels.
func (s *Store) SetVMLabels(ctx context.Context, id string, labels map[string]string) error {
	if labels == nil {
		labels = map[string]string{}
	}
	text, err := jsonText(labels)
	if err != nil {
		return err
	}
	return s.inTx(ctx, func(tx *gorm.DB) error {
		if err := updateVMRow(tx, "update labels of", id, "UPDATE vms SET labels = ?, updated_at = ? WHERE id = ?", text, now(), id); err != nil {
			return err
		}
		if err := tx.Exec("DELETE FROM vm_labels WHERE vm_id = ?", id).Error; err != nil {
			return fmt.Errorf("update labels of vm %s: %w", id, err)
		}
		return insertLabels(tx, id, labels)
	})
}

// SetVMConstraints replaces a VM's stored constraints (JSON, "" for none).
// Its group slot stays: a VM counts where it was placed.
func (s *Store) SetVMConstraints(ctx context.Context, id, constraints string) error {
	return updateVMRow(s.db.WithContext(ctx), "update constraints of", id,
		"UPDATE vms SET constraints = ?, updated_at = ? WHERE id = ?", constraints, now(), id)
}

func jsonText(v any) (string, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return "", fmt.Errorf("encode %T: %w", v, err)
	}
	return string(b), nil
}

// MarkVMCreated records the agent's answer to a create. ErrNotFound when
// the row is gone (deleted while it was being created).
func (s *Store) MarkVMCreated(ctx context.Context, id, observedState, reason, startedFrom string) error {
	return updateVMRow(s.db.WithContext(ctx), "mark created", id, `UPDATE vms SET observed_state = ?, reason = ?,
		started_from = ?, updated_at = ? WHERE id = ?`, observedState, reason, startedFrom, now(), id)
}
