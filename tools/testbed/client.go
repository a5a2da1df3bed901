package testbed

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	v1 "k8s.io/api/core/v1"
)

// Conn is a long-lived flow from a pod to a service: a TCP connection that
// carries HTTP/1.1 keep-alive requests, or a connected UDP socket. Every
// Ask on it uses the same 5-tuple, so it shows whether the datapath keeps
// a flow on its backend.
type Conn struct {
	proto  v1.Protocol
	target netip.AddrPort
	c      net.Conn
	br     *bufio.Reader
	// last asks the server to close after the next answer.
	last bool
}

// ClientName returns the pod's name.
func (p *Pod) ClientName() string { return p.Name }

// ClientAddr returns the pod's address.
func (p *Pod) ClientAddr() netip.Addr { return p.Addr }

// ClientAddrOf returns the pod's address of family (Pod.AddrOf).
func (p *Pod) ClientAddrOf(family v1.IPFamily) netip.Addr { return p.AddrOf(family) }

// Open opens a flow from the pod to target.
func (p *Pod) Open(ctx context.Context, proto v1.Protocol, target netip.AddrPort) (*Conn, error) {
	return open(ctx, proto, target, p.NS.DialContext)
}

type dialFunc func(ctx context.Context, network, addr string) (net.Conn, error)

// dialHere dials from the namespace of the calling thread.
func dialHere(ctx context.Context, network, addr string) (net.Conn, error) {
	var d net.Dialer
	return d.DialContext(ctx, network, addr)
}

func open(ctx context.Context, proto v1.Protocol, target netip.AddrPort, dial dialFunc) (*Conn, error) {
	network := "tcp"
	if proto == v1.ProtocolUDP {
		network = "udp"
	} else if proto != v1.ProtocolTCP {
		return nil, fmt.Errorf("protocol %q: want TCP or UDP", proto)
	}
	// The target's family, never the other one.
	if target.Addr().Is4() {
		network += "4"
	} else {
		network += "6"
	}
	c, err := dial(ctx, network, target.String())
	if err != nil {
		return nil, err
	}
	return &Conn{proto: proto, target: target, c: c, br: bufio.NewReader(c)}, nil
}

// LocalAddr is the flow's client address.
func (c *Conn) LocalAddr() netip.AddrPort {
	ap, _ := netip.ParseAddrPort(c.c.LocalAddr().String())
	return ap
}

// Close closes the flow.
func (c *Conn) Close() error { return c.c.Close() }

// Ask sends one request on the flow and returns the answer. For UDP the
// socket is connected, so only answers from the service address (correctly
// reverse-NATed ones) are received.
func (c *Conn) Ask(ctx context.Context) (Answer, error) {
	var a Answer
	if dl, ok := ctx.Deadline(); ok {
		c.c.SetDeadline(dl)
	} else {
		c.c.SetDeadline(time.Time{})
	}
	if c.proto == v1.ProtocolUDP {
		if _, err := c.c.Write([]byte("who are you?")); err != nil {
			return a, err
		}
		buf := make([]byte, 2048)
		n, err := c.c.Read(buf)
		if err != nil {
			return a, err
		}
		if err := json.Unmarshal(buf[:n], &a); err != nil {
			return a, fmt.Errorf("bad answer %q: %w", buf[:n], err)
		}
		return a, nil
	}
	connection := "keep-alive"
	if c.last {
		connection = "close"
	}
	if _, err := fmt.Fprintf(c.c, "GET / HTTP/1.1\r\nHost: %s\r\nUser-Agent: topolb-testbed\r\nConnection: %s\r\n\r\n", c.target, connection); err != nil {
		return a, err
	}
	resp, err := http.ReadResponse(c.br, nil)
	if err != nil {
		return a, err
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
	if err != nil {
		return a, err
	}
	if resp.StatusCode != http.StatusOK {
		return a, fmt.Errorf("HTTP %s", resp.Status)
	}
	if err := json.Unmarshal(body, &a); err != nil {
		return a, fmt.Errorf("bad answer %q: %w", body, err)
	}
	return a, nil
}

// Request sends one request from the pod to target on a new flow (a new
// TCP connection, or a new UDP socket) and returns the answer.
func (p *Pod) Request(ctx context.Context, proto v1.Protocol, target netip.AddrPort) (Answer, error) {
	return request(ctx, proto, target, p.NS.DialContext)
}

// request is Request with the given dialer. Over TCP the server closes
// first and the client waits for its FIN, as HTTP/1.0 clients do: the
// TIME_WAIT state stays on the backend, so a client making thousands of
// connections a second does not run out of ephemeral ports.
func request(ctx context.Context, proto v1.Protocol, target netip.AddrPort, dial dialFunc) (Answer, error) {
	c, err := open(ctx, proto, target, dial)
	if err != nil {
		return Answer{}, err
	}
	defer c.Close()
	c.last = true
	a, err := c.Ask(ctx)
	if err == nil && proto == v1.ProtocolTCP {
		// The answer is complete; wait for the server's FIN.
		if _, rerr := io.Copy(io.Discard, c.br); rerr != nil {
			err = fmt.Errorf("after the answer: %w", rerr)
		}
	}
	return a, err
}

// Record is the outcome of one request.
type Record struct {
	Start  time.Time
	Took   time.Duration
	Answer Answer
	Err    error
}

// Load describes a series of requests, each on a new flow.
type Load struct {
	Proto  v1.Protocol
	Target netip.AddrPort
	// Count is the number of requests; 0 sends until the context ends.
	Count int
	// Parallel is the number of requests in flight. Default 16.
	Parallel int
	// Timeout bounds each request. Default 2s.
	Timeout time.Duration
}

// Send runs the load from the pod and returns one record per request, in
// the order they started. Requests that were cut short by ctx ending are
// not recorded.
func (p *Pod) Send(ctx context.Context, l Load) []Record { return send(ctx, p.NS, l) }

// send runs the load from ns; see Pod.Send.
func send(ctx context.Context, ns *NS, l Load) []Record { return sendWith(ctx, ns, l, dialHere) }

// sendWith is send with the given dialer, called on threads inside ns.
func sendWith(ctx context.Context, ns *NS, l Load, dial dialFunc) []Record {
	if l.Parallel <= 0 {
		l.Parallel = 16
	}
	if l.Timeout <= 0 {
		l.Timeout = 2 * time.Second
	}
	var (
		mu   sync.Mutex
		recs []Record
		next atomic.Int64
		wg   sync.WaitGroup
	)
	// Each worker stays on an OS thread inside the namespace for the whole
	// load, so a request costs no namespace switch.
	for w := 0; w < l.Parallel; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ns.Do(func() error {
				for {
					i := next.Add(1)
					if (l.Count > 0 && i > int64(l.Count)) || ended(ctx) {
						return nil
					}
					start := time.Now()
					rctx, cancel := context.WithTimeout(ctx, l.Timeout)
					a, err := request(rctx, l.Proto, l.Target, dial)
					cancel()
					if err != nil && ended(ctx) {
						return nil // cut short by the caller, not a failure
					}
					took := time.Since(start)
					mu.Lock()
					recs = append(recs, Record{Start: start, Took: took, Answer: a, Err: err})
					mu.Unlock()
				}
			})
		}()
	}
	wg.Wait()
	sort.Slice(recs, func(i, j int) bool { return recs[i].Start.Before(recs[j].Start) })
	return recs
}

// ended reports whether ctx is done or past its deadline. The deadline
// check matters: a socket deadline taken from ctx can fire before ctx's own
// timer does, and a request failing that way was cut short by the caller.
func ended(ctx context.Context) bool {
	if ctx.Err() != nil {
		return true
	}
	dl, ok := ctx.Deadline()
	return ok && !time.Now().Before(dl)
}

// Tally sums up records.
type Tally struct {
	// Landed counts answers per backend pod.
	Landed map[string]int
	// Answers holds one answer per backend pod (its node and zone).
	Answers map[string]Answer
	// Failed counts requests without an answer.
	Failed int
	// Errors are the distinct failure messages, at most five.
	Errors []string
	// WrongSource counts answers in which the backend saw a source address
	// other than the client's.
	WrongSource int
	// Sources counts, per backend pod, the source addresses it saw (the
	// client's, or the node's that source-translated the flow).
	Sources map[string]map[netip.Addr]int
}

// Summarize tallies records of requests sent by client (nil: sources are
// not checked).
func Summarize(client Client, recs []Record) Tally {
	t := Tally{Landed: map[string]int{}, Answers: map[string]Answer{}, Sources: map[string]map[netip.Addr]int{}}
	for _, r := range recs {
		if r.Err != nil {
			t.Failed++
			msg := errorClass(r.Err)
			if len(t.Errors) < 5 && !slices.Contains(t.Errors, msg) {
				t.Errors = append(t.Errors, msg)
			}
			continue
		}
		t.Landed[r.Answer.Pod]++
		t.Answers[r.Answer.Pod] = r.Answer
		ap, err := netip.ParseAddrPort(r.Answer.Client)
		if client != nil && (err != nil || ap.Addr() != client.ClientAddrOf(familyOf(ap.Addr()))) {
			t.WrongSource++
		}
		if err == nil {
			if t.Sources[r.Answer.Pod] == nil {
				t.Sources[r.Answer.Pod] = map[netip.Addr]int{}
			}
			t.Sources[r.Answer.Pod][ap.Addr()]++
		}
	}
	return t
}

// familyOf returns the IP family of a.
func familyOf(a netip.Addr) v1.IPFamily {
	if a.Is4() || a.Is4In6() {
		return v1.IPv4Protocol
	}
	return v1.IPv6Protocol
}

// Backends returns the pods that answered, sorted.
func (t Tally) Backends() []string {
	out := make([]string, 0, len(t.Landed))
	for p := range t.Landed {
		out = append(out, p)
	}
	sort.Strings(out)
	return out
}

// errorClass shortens an error for counting: timeouts and refusals are
// named, ephemeral ports are dropped.
func errorClass(err error) string {
	var ne net.Error
	switch {
	case errors.As(err, &ne) && ne.Timeout(), errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	case errors.Is(err, syscall.ECONNREFUSED):
		return "connection refused"
	case errors.Is(err, syscall.ECONNRESET):
		return "connection reset"
	}
	msg := err.Error()
	if i := strings.LastIndex(msg, ": "); i >= 0 {
		msg = msg[i+2:]
	}
	return msg
}
