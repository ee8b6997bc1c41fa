package control

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/kvmfleet/terraform-provider-kvm/internal/agentapi"
)

// agentPool keeps one client per agent address for operations (with
// retries: every agent call is idempotent on the id) and one for the host
// monitor (no retries and a short timeout: a missed sync is simply counted).
type agentPool struct {
	token       string
	httpClient  *http.Client
	timeout     time.Duration
	syncTimeout time.Duration
	metrics     *metrics

	mu   sync.Mutex
	ops  map[string]*agentapi.Client
	sync map[string]*agentapi.Client
}

func newAgentPool(token string, hc *http.Client, timeout, syncTimeout time.Duration, m *metrics) *agentPool {
	if hc == nil {
		hc = &http.Client{}
	}
	// An agent never redirects: a redirect would send the next request,
	// and its token, wherever the answer points.
	noRedirects := *hc
	noRedirects.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	hc = &noRedirects
	return &agentPool{token: token, httpClient: hc, timeout: timeout, syncTimeout: syncTimeout, metrics: m,
		ops: map[string]*agentapi.Client{}, sync: map[string]*agentapi.Client{}}
}

// syncTimeout bounds one sync call so that a round of syncs never takes
// much longer than the interval, whatever a dead host does.
func syncTimeout(interval time.Duration) time.Duration {
	return min(max(interval, time.Second), 10*time.Second)
}

func (p *agentPool) client(address string) *agentapi.Client {
	p.mu.Lock()
	defer p.mu.Unlock()
	c, ok := p.ops[address]
	if !ok {
		c = agentapi.NewClient(address, p.token, agentapi.WithHTTPClient(p.httpClient), agentapi.WithTimeout(p.timeout))
		p.ops[address] = c
	}
	return c
}

func (p *agentPool) syncClient(address string) *agentapi.Client {
	p.mu.Lock()
	defer p.mu.Unlock()
	c, ok := p.sync[address]
	if !ok {
		c = agentapi.NewClient(address, p.token, agentapi.WithHTTPClient(p.httpClient),
			agentapi.WithTimeout(p.syncTimeout), agentapi.WithRetries(0))
		p.sync[address] = c
	}
	return c
}

// verify challenges the agent at address without any credentials and
// checks its answer: signed by pinned when the host has a pinned key,
// otherwise with a join proof made with the agent token. It returns the
// key the agent proved. Nothing is sent with the agent token before this
// succeeded for the address.
//
// underlay, when set, is the host's underlay address: the agent proves
// it only when it is its own (--underlay-address).
func (p *agentPool) verify(ctx context.Context, host, address, underlay string, pinned ed25519.PublicKey, timeout time.Duration) (ed25519.PublicKey, error) {
	canonical, err := agentapi.CheckAddress(agentURL(address))
	if err != nil {
		return nil, err
	}
	nonce := make([]byte, 32)
	if _, err := rand.Read(nonce); err != nil {
		return nil, err
	}
	ch := agentapi.IdentityChallenge{Nonce: agentapi.NewNonce(nonce), Host: host, Address: canonical, Underlay: underlay}
	c := agentapi.NewClient(canonical, "", agentapi.WithHTTPClient(p.httpClient), agentapi.WithTimeout(timeout), agentapi.WithRetries(0))
	var proof agentapi.IdentityProof
	if err := p.call("identity", func() (err error) { proof, err = c.Identity(ctx, ch); return err }); err != nil {
		return nil, err
	}
	return agentapi.VerifyIdentity(ch, proof, pinned, p.token)
}

// agentURL is address with the http:// that hosts registered before
// addresses needed a scheme leave out.
func agentURL(address string) string {
	if strings.Contains(address, "://") {
		return address
	}
	return "http://" + address
}

// call runs one metered agent call.
func (p *agentPool) call(op string, fn func() error) error {
	start := time.Now()
	err := fn()
	p.metrics.observeAgent(op, start, err)
	return err
}

func (p *agentPool) info(ctx context.Context, c *agentapi.Client) (agentapi.Info, error) {
	var out agentapi.Info
	err := p.call("info", func() (err error) { out, err = c.Info(ctx); return err })
	return out, err
}

func (p *agentPool) listVMs(ctx context.Context, c *agentapi.Client) ([]agentapi.VM, error) {
	var out []agentapi.VM
	err := p.call("list_vms", func() (err error) { out, err = c.ListVMs(ctx); return err })
	return out, err
}

func (p *agentPool) createVM(ctx context.Context, c *agentapi.Client, id string, spec agentapi.VMSpec) (agentapi.VM, error) {
	var out agentapi.VM
	err := p.call("create_vm", func() (err error) { out, err = c.CreateVM(ctx, id, spec); return err })
	return out, err
}

func (p *agentPool) deleteVM(ctx context.Context, c *agentapi.Client, id string) error {
	return p.call("delete_vm", func() error { return c.DeleteVM(ctx, id) })
}

func (p *agentPool) action(ctx context.Context, c *agentapi.Client, id, action string) (agentapi.VM, error) {
	var out agentapi.VM
	err := p.call(action, func() (err error) { out, err = c.Action(ctx, id, action); return err })
	return out, err
}

func (p *agentPool) resizeVM(ctx context.Context, c *agentapi.Client, id string, shape agentapi.VMShape) (agentapi.VM, error) {
	var out agentapi.VM
	err := p.call("resize_vm", func() (err error) { out, err = c.ResizeVM(ctx, id, shape); return err })
	return out, err
}

func (p *agentPool) getVM(ctx context.Context, c *agentapi.Client, id string) (agentapi.VM, error) {
	var out agentapi.VM
	err := p.call("get_vm", func() (err error) { out, err = c.GetVM(ctx, id); return err })
	return out, err
}

func (p *agentPool) console(ctx context.Context, c *agentapi.Client, id string, n int64) (string, error) {
	var out string
	err := p.call("console", func() (err error) { out, err = c.ConsoleTail(ctx, id, n); return err })
	return out, err
}

func (p *agentPool) guest(ctx context.Context, c *agentapi.Client, id string) (agentapi.GuestStatus, error) {
	var out agentapi.GuestStatus
	err := p.call("guest", func() (err error) { out, err = c.Guest(ctx, id); return err })
	return out, err
}
