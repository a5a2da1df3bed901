package testbed

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Answer is what a backend pod answers to every HTTP request and UDP
// datagram.
type Answer struct {
	Pod  string `json:"pod"`
	Node string `json:"node"`
	Zone string `json:"zone"`
	// Client is the source address ("ip:port") the backend saw: the
	// client pod's own address, since topolb does not SNAT.
	Client string `json:"client"`
	// Received is the size of the UDP datagram answered (0 for HTTP).
	Received int `json:"received,omitempty"`
	// Pad makes the answer to a datagram larger than bigRequest at least
	// as large as the datagram, so a fragmented request gets a fragmented
	// answer.
	Pad string `json:"pad,omitempty"`
}

// bigRequest is the size of a UDP datagram above which the answer is
// padded (Answer.Pad): over a 1,500-byte MTU's payload.
const bigRequest = 1472

// backendServers are the HTTP and UDP echo servers of one backend pod.
// Their sockets are created inside the pod's namespace and served from
// ordinary goroutines.
type backendServers struct {
	http []*http.Server
	udp  []net.PacketConn
	wg   sync.WaitGroup
}

func serveBackend(p *Pod, tcpPorts, udpPorts []uint16) (_ *backendServers, err error) {
	s := &backendServers{}
	defer func() {
		if err != nil {
			s.close()
		}
	}()
	answer := func(client string, received int) []byte {
		a := Answer{Pod: p.Name, Node: p.Node.Name, Zone: p.Node.Zone, Client: client, Received: received}
		if received > bigRequest {
			a.Pad = strings.Repeat("x", received)
		}
		b, _ := json.Marshal(a)
		return b
	}
	// One socket per family: an IPv6 socket is IPv6-only (Go sets
	// IPV6_V6ONLY for "tcp6"), so IPv4 requests reach the IPv4 one as in
	// an IPv4-only testbed.
	tcpNets, udpNets := []string{"tcp4"}, []string{"udp4"}
	if p.Addr6.IsValid() {
		tcpNets, udpNets = append(tcpNets, "tcp6"), append(udpNets, "udp6")
	}
	for _, port := range tcpPorts {
		for _, network := range tcpNets {
			l, err := p.NS.Listen(network, ":"+strconv.Itoa(int(port)))
			if err != nil {
				return nil, fmt.Errorf("pod %s: listen %s %d: %w", p.Name, network, port, err)
			}
			srv := &http.Server{
				Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					w.Header().Set("Content-Type", "application/json")
					w.Write(answer(r.RemoteAddr, 0))
				}),
				ReadHeaderTimeout: 10 * time.Second,
				IdleTimeout:       5 * time.Minute,
			}
			s.http = append(s.http, srv)
			s.wg.Add(1)
			go func() {
				defer s.wg.Done()
				srv.Serve(l) // returns http.ErrServerClosed on close
			}()
		}
	}
	for _, port := range udpPorts {
		for _, network := range udpNets {
			c, err := p.NS.ListenPacket(network, ":"+strconv.Itoa(int(port)))
			if err != nil {
				return nil, fmt.Errorf("pod %s: listen %s %d: %w", p.Name, network, port, err)
			}
			s.udp = append(s.udp, c)
			s.wg.Add(1)
			go func() {
				defer s.wg.Done()
				buf := make([]byte, 1<<16)
				for {
					n, from, err := c.ReadFrom(buf)
					if err != nil {
						if errors.Is(err, net.ErrClosed) {
							return
						}
						continue
					}
					c.WriteTo(answer(from.String(), n), from)
				}
			}()
		}
	}
	return s, nil
}

func (s *backendServers) close() {
	for _, srv := range s.http {
		srv.Close()
	}
	for _, c := range s.udp {
		c.Close()
	}
	s.wg.Wait()
}
