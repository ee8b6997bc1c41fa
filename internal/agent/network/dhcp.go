package network

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"time"

	"github.com/insomniacslk/dhcp/dhcpv4"
	"github.com/insomniacslk/dhcp/dhcpv4/nclient4"
	"github.com/insomniacslk/dhcp/dhcpv4/server4"
	"github.com/mdlayher/packet"
	"golang.org/x/sys/unix"
)

// leaseTime is the lease a guest gets. The lease is static (the address is
// the control plane's): a guest renews it, while the agent runs, at half.
const leaseTime = 24 * time.Hour

// Lease is one static DHCP lease: the address served to one MAC on one tap.
type Lease struct {
	NetNS    string // the named network namespace of the tap ("" for the agent's own)
	Tap      string
	MAC      string
	Address  netip.Prefix // the address and the network's prefix length
	Router   netip.Addr   // invalid: none
	Hostname string
	MTU      int // the interface MTU (option 26); 0: none sent
}

// responder serves one Lease on one tap. It listens with packet sockets on
// the tap itself, not on a bridge: frames a guest sends through a tap that
// is a bridge port reach the bridge's stack, not the tap's, but every
// ETH_P_ALL packet socket of the tap sees them first. So a lease is answered
// only on its own tap (the operator's LAN and other guests never see this
// server), and a tap in a child's namespace works the same.
type responder struct {
	lease Lease
	srv   *server4.Server
	done  chan struct{}
}

// dualConn reads every IP packet of the tap (ETH_P_ALL, as a bridge port
// needs) and writes IP packets (ETH_P_IP, the ethertype of the frames).
type dualConn struct {
	net.PacketConn // reads
	write          net.PacketConn
}

func (c dualConn) WriteTo(b []byte, addr net.Addr) (int, error) { return c.write.WriteTo(b, addr) }

func (c dualConn) Close() error { return errors.Join(c.PacketConn.Close(), c.write.Close()) }

// startResponder serves l on its tap. The caller runs it in the tap's
// network namespace: the sockets stay bound there.
func startResponder(log *slog.Logger, l Lease) (*responder, error) {
	ifc, err := net.InterfaceByName(l.Tap)
	if err != nil {
		return nil, fmt.Errorf("dhcp on tap %s: %w", l.Tap, err)
	}
	all, err := packet.Listen(ifc, packet.Datagram, unix.ETH_P_ALL, nil)
	if err != nil {
		return nil, fmt.Errorf("dhcp on tap %s: listen: %w", l.Tap, err)
	}
	ip, err := packet.Listen(ifc, packet.Datagram, unix.ETH_P_IP, nil)
	if err != nil {
		_ = all.Close()
		return nil, fmt.Errorf("dhcp on tap %s: listen: %w", l.Tap, err)
	}
	server := net.IPv4zero
	if l.Router.IsValid() {
		server = net.IP(l.Router.AsSlice())
	}
	conn := dualConn{
		PacketConn: nclient4.NewBroadcastUDPConn(all, &net.UDPAddr{Port: dhcpv4.ServerPort}),
		write:      nclient4.NewBroadcastUDPConn(ip, &net.UDPAddr{IP: server, Port: dhcpv4.ServerPort}),
	}
	r := &responder{lease: l, done: make(chan struct{})}
	srv, err := server4.NewServer(l.Tap, nil, r.handle(log, server), server4.WithConn(conn))
	if err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("dhcp on tap %s: %w", l.Tap, err)
	}
	r.srv = srv
	go func() {
		defer close(r.done)
		_ = srv.Serve() // ends when stop closes the conn
	}()
	return r, nil
}

func (r *responder) stop() {
	_ = r.srv.Close()
	<-r.done
}

// handle answers DISCOVER with an OFFER and REQUEST with an ACK of the one
// lease, or a NAK when the guest asks for another address.
func (r *responder) handle(log *slog.Logger, server net.IP) server4.Handler {
	l := r.lease
	mask := net.CIDRMask(l.Address.Bits(), 32)
	addr := net.IP(l.Address.Addr().AsSlice())
	return func(conn net.PacketConn, _ net.Addr, m *dhcpv4.DHCPv4) {
		if m.OpCode != dhcpv4.OpcodeBootRequest || m.ClientHWAddr.String() != l.MAC {
			return
		}
		var typ dhcpv4.MessageType
		switch m.MessageType() {
		case dhcpv4.MessageTypeDiscover:
			typ = dhcpv4.MessageTypeOffer
		case dhcpv4.MessageTypeRequest:
			typ = dhcpv4.MessageTypeAck
			want := m.RequestedIPAddress()
			if want == nil || want.IsUnspecified() {
				want = m.ClientIPAddr
			}
			if want != nil && !want.IsUnspecified() && !want.Equal(addr) {
				typ = dhcpv4.MessageTypeNak
			}
		default:
			return
		}
		mods := []dhcpv4.Modifier{dhcpv4.WithMessageType(typ), dhcpv4.WithServerIP(server),
			dhcpv4.WithOption(dhcpv4.OptServerIdentifier(server))}
		if typ != dhcpv4.MessageTypeNak {
			mods = append(mods, dhcpv4.WithYourIP(addr), dhcpv4.WithNetmask(mask),
				dhcpv4.WithLeaseTime(uint32(leaseTime.Seconds())))
			if l.Router.IsValid() {
				mods = append(mods, dhcpv4.WithRouter(net.IP(l.Router.AsSlice())))
			}
			if l.Hostname != "" {
				mods = append(mods, dhcpv4.WithOption(dhcpv4.OptHostName(l.Hostname)))
			}
			if l.MTU > 0 {
				mods = append(mods, dhcpv4.WithOption(dhcpv4.OptGeneric(dhcpv4.OptionInterfaceMTU,
					[]byte{byte(l.MTU >> 8), byte(l.MTU)})))
			}
		}
		resp, err := dhcpv4.NewReplyFromRequest(m, mods...)
		if err != nil {
			log.Warn("dhcp: build reply", "tap", l.Tap, "mac", l.MAC, "err", err)
			return
		}
		to := &net.UDPAddr{IP: net.IPv4bcast, Port: dhcpv4.ClientPort}
		if _, err := conn.WriteTo(resp.ToBytes(), to); err != nil {
			log.Warn("dhcp: send reply", "tap", l.Tap, "mac", l.MAC, "err", err)
			return
		}
		log.Debug("dhcp: answered", "tap", l.Tap, "mac", l.MAC, "type", typ.String(), "address", l.Address)
	}
}
