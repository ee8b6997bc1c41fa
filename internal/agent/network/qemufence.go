package network

import (
	"fmt"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// The fence of QEMU's own sockets. A VM's QEMU reaches the network only
// through descriptors the agent hands it (a tap, passt's end of a socket
// pair); it never opens an IP socket of its own. So a QEMU that a guest
// took over must not be able to either: every packet that a socket of a
// QEMU uid sends is refused, loopback included (a trust-auth PostgreSQL,
// the agent's port, other guests' forwards). The rule sits in a table of
// its own (inet: IPv4 and IPv6), apart from the fences of networks, which
// come and go with their VMs; this one stays while the agent runs QEMU as
// those uids.

var (
	qemuFenceTable = &nftables.Table{Family: nftables.TableFamilyINet, Name: TableName + "-qemu"}
	qemuFenceChain = &nftables.Chain{Name: "output", Table: qemuFenceTable, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookOutput, Priority: nftables.ChainPriorityFilter}
)

// FenceQEMU (re)writes the output rule that refuses every packet of a
// socket owned by a uid in [first, last]. Run again, it replaces the rule.
func FenceQEMU(first, last uint32) error {
	if last < first {
		return fmt.Errorf("fence qemu uids: range %d-%d is empty", first, last)
	}
	c, err := nftConn(-1)
	if err != nil {
		return err
	}
	c.AddTable(qemuFenceTable)
	c.AddChain(qemuFenceChain)
	c.FlushChain(qemuFenceChain)
	c.AddRule(&nftables.Rule{Table: qemuFenceTable, Chain: qemuFenceChain, UserData: []byte("qemu uids"), Exprs: []expr.Any{
		&expr.Meta{Key: expr.MetaKeySKUID, Register: 1},
		// The uid is in host byte order; a range compares bytes, so it is
		// turned big-endian first (as nft does for "meta skuid A-B").
		&expr.Byteorder{SourceRegister: 1, DestRegister: 1, Op: expr.ByteorderHton, Len: 4, Size: 4},
		&expr.Range{Op: expr.CmpOpEq, Register: 1,
			FromData: binaryutil.BigEndian.PutUint32(first), ToData: binaryutil.BigEndian.PutUint32(last)},
		&expr.Counter{},
		// Port unreachable: a connect fails at once (ECONNREFUSED).
		&expr.Reject{Type: unix.NFT_REJECT_ICMPX_UNREACH, Code: unix.NFT_REJECT_ICMPX_PORT_UNREACH},
	}})
	if err := c.Flush(); err != nil {
		return fmt.Errorf("nftables: write table inet %s (qemu's own sockets fenced): %w", qemuFenceTable.Name, err)
	}
	return nil
}
