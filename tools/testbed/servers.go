package testbed

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
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
}

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
	answer := func(client string) []byte {
		b, _ := json.Marshal(Answer{Pod: p.Name, Node: p.Node.Name, Zone: p.Node.Zone, Client: client})
		return b
	}
	for _, port := range tcpPorts {
		l, err := p.NS.Listen("tcp4", ":"+strconv.Itoa(int(port)))
		if err != nil {
			return nil, fmt.Errorf("pod %s: listen tcp %d: %w", p.Name, port, err)
		}
		srv := &http.Server{
			Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", "application/json")
				w.Write(answer(r.RemoteAddr))
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
	for _, port := range udpPorts {
		c, err := p.NS.ListenPacket("udp4", ":"+strconv.Itoa(int(port)))
		if err != nil {
			return nil, fmt.Errorf("pod %s: listen udp %d: %w", p.Name, port, err)
		}
		s.udp = append(s.udp, c)
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			buf := make([]byte, 2048)
			for {
				_, from, err := c.ReadFrom(buf)
				if err != nil {
					if errors.Is(err, net.ErrClosed) {
						return
					}
					continue
				}
				c.WriteTo(answer(from.String()), from)
			}
		}()
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
