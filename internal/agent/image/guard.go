package image

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strings"
	"sync"
	"syscall"
	"time"
)

// maxRedirects bounds the redirects of one source fetch.
const maxRedirects = 5

// addrClass is a kind of address a source must not lead the agent to
// unless the registration URL itself is on that kind: the agent's own
// services (loopback, its own addresses) and what sits beside a host but is
// not the internet (link-local metadata services, multicast).
type addrClass uint8

const (
	classLoopback addrClass = 1 << iota
	classLinkLocal
	classUnspecified
	classMulticast
	classOwn // an address of one of this host's interfaces
)

func (c addrClass) String() string {
	var names []string
	for _, n := range []struct {
		c    addrClass
		name string
	}{{classLoopback, "loopback"}, {classLinkLocal, "link-local"}, {classUnspecified, "unspecified"},
		{classMulticast, "multicast"}, {classOwn, "this host's own"}} {
		if c&n.c != 0 {
			names = append(names, n.name)
		}
	}
	return strings.Join(names, ", ")
}

// classOf says which guarded kinds ip is of (0: an ordinary address).
func classOf(ip netip.Addr) addrClass {
	ip = ip.Unmap()
	var c addrClass
	switch {
	case ip.IsLoopback():
		c |= classLoopback
	case ip.IsLinkLocalUnicast():
		c |= classLinkLocal
	case ip.IsUnspecified():
		c |= classUnspecified
	case ip.IsMulticast():
		c |= classMulticast
	}
	if isOwnAddress(ip) {
		c |= classOwn
	}
	return c
}

// isOwnAddress says whether ip is an address of one of this host's
// interfaces, read when asked: addresses come and go.
func isOwnAddress(ip netip.Addr) bool {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return false
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok {
			if own, ok := netip.AddrFromSlice(n.IP); ok && own.Unmap() == ip {
				return true
			}
		}
	}
	return false
}

// allowedKey carries, in a fetch's context, the guarded kinds of address
// its registration URL is on: those stay reachable (a source on 127.0.0.1
// may redirect within 127.0.0.1).
type allowedKey struct{}

// sourceAllows is the guarded kinds of address the source URL's host is
// on: the address itself, or every address its name resolves to now.
func sourceAllows(ctx context.Context, u *url.URL) addrClass {
	host := u.Hostname()
	if ip, err := netip.ParseAddr(host); err == nil {
		return classOf(ip)
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	ips, err := net.DefaultResolver.LookupNetIP(ctx, "ip", host)
	if err != nil {
		return 0 // the dial resolves again and fails or meets the guard
	}
	var c addrClass
	for _, ip := range ips {
		c |= classOf(ip)
	}
	return c
}

// errAddressRefused is a connection the guard refused, errRedirect a
// redirect it did not follow.
var (
	errAddressRefused = errors.New("address refused")
	errRedirect       = errors.New("redirect refused")
)

// newSourceClient is the HTTP client of source URLs. It follows at most
// maxRedirects redirects, only to http(s), and checks every address it
// connects to when it connects (after DNS, so a name that changes its
// answer between checks gains nothing): a guarded kind of address the
// registration URL is not on is refused. An operator's proxy
// (HTTP_PROXY, HTTPS_PROXY) is reached as configured.
func newSourceClient() *http.Client {
	t := http.DefaultTransport.(*http.Transport).Clone()
	// A source that takes the request and never answers is cut (the body,
	// once it flows, has its own stall timeout).
	t.ResponseHeaderTimeout = time.Minute
	var proxies sync.Map // host:port of the proxies the environment named
	t.Proxy = func(req *http.Request) (*url.URL, error) {
		p, err := http.ProxyFromEnvironment(req)
		if p != nil {
			proxies.Store(canonicalHostPort(p), true)
		}
		return p, err
	}
	t.DialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
		d := &net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}
		if _, isProxy := proxies.Load(addr); !isProxy {
			allowed, _ := ctx.Value(allowedKey{}).(addrClass)
			d.Control = func(_, address string, _ syscall.RawConn) error {
				ap, err := netip.ParseAddrPort(address)
				if err != nil {
					return fmt.Errorf("connect to %s: %w", address, err)
				}
				if c := classOf(ap.Addr()); c&^allowed != 0 {
					return fmt.Errorf("connect to %s: %w: a %s address, and the source URL is not on one", address, errAddressRefused, c&^allowed)
				}
				return nil
			}
		}
		return d.DialContext(ctx, network, addr)
	}
	return &http.Client{
		Transport: t,
		CheckRedirect: func(req *http.Request, via []*http.Request) error {
			if len(via) > maxRedirects {
				return fmt.Errorf("%w: more than %d redirects", errRedirect, maxRedirects)
			}
			if req.URL.Scheme != "http" && req.URL.Scheme != "https" {
				return fmt.Errorf("%w: a redirect to a %q URL; only http and https are followed", errRedirect, req.URL.Scheme)
			}
			return nil
		},
	}
}

// canonicalHostPort is a proxy URL's host:port as the transport dials it.
func canonicalHostPort(u *url.URL) string {
	port := u.Port()
	if port == "" {
		port = map[string]string{"http": "80", "https": "443", "socks5": "1080", "socks5h": "1080"}[u.Scheme]
	}
	return net.JoinHostPort(u.Hostname(), port)
}
