package e2e

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/topolb/topolb/tools/testbed"
	"github.com/topolb/topolb/topology"
)

// icmpSpec is two dual-stack nodes, node-a1 (the client, web-a1) behind
// a wire MTU of 1400 (above IPv6's minimum of 1280) and node-b1 (web-b1),
// with no kube-proxy anywhere.
const icmpSpec = `
name: icmp
kubeProxy: none
dualStack: true
zones:
- name: zone-a
  nodes:
  - name: node-a1
    wireMTU: 1400
    pods: [{name: client, role: client}, {name: web-a1}]
- name: zone-b
  nodes:
  - name: node-b1
    pods: [{name: web-b1}]
`

// Ports nothing listens on (deafPort) and the upload sink's (sinkPort) in
// the backend pods.
const (
	deafPort = 5399
	sinkPort = 9000
)

// icmpServices are dual stack: each family has its own decisions.
func icmpServices() []testbed.ServiceSpec {
	deaf := []testbed.PortSpec{{Protocol: v1.ProtocolUDP, Port: 53, TargetPort: deafPort}}
	return []testbed.ServiceSpec{
		{Name: "deaf-local", IPFamilies: bothFamilies, Ports: deaf, Endpoints: []testbed.EndpointSpec{{Pod: "web-a1"}}},
		{Name: "deaf-remote", IPFamilies: bothFamilies, Ports: deaf, Endpoints: []testbed.EndpointSpec{{Pod: "web-b1"}}},
		{Name: "upload", IPFamilies: bothFamilies, Ports: []testbed.PortSpec{{Port: 80, TargetPort: sinkPort}}, Endpoints: []testbed.EndpointSpec{{Pod: "web-b1"}}},
	}
}

// TestICMPFollowsTheFlow checks, with no kube-proxy anywhere and in each
// IP family, that ICMP errors about flows through a Service reach the
// client as errors about the Service: a UDP datagram to a Service whose
// backend port has no listener is refused at once (ICMP or ICMPv6 port
// unreachable), for a backend on the client's node and on another node;
// and a 4 MiB upload from the client pod through a Service to a backend
// on another node completes although the client's node forwards into a
// smaller MTU (1400) than the pod sends (1500): the node's "fragmentation
// needed" (IPv4) or "packet too big" (IPv6, whose routers never fragment)
// must reach the pod about the Service address, or path-MTU discovery
// never shrinks the segments and the upload stalls. A family the datapath
// does not serve to pods, as it says itself, skips with that reason; IPv4
// always runs.
func TestICMPFollowsTheFlow(t *testing.T) {
	requireRoot(t)
	for _, dp := range datapaths {
		t.Run(dp.name, func(t *testing.T) {
			spec, err := testbed.ParseSpec([]byte(icmpSpec))
			if err != nil {
				t.Fatal(err)
			}
			// Services come after the testbed: it would serve their
			// target ports, which must stay deaf or be the sink's.
			spec.Services = nil
			tb := newTestbed(t, spec)
			dp.start(t, tb)
			apply(t, tb, icmpServices())
			stop := serveSink(t, tb.Pod("web-b1"))
			defer stop()
			inEachFamily(t, tb, topology.ScopeInternal, func(t *testing.T, family v1.IPFamily) {
				checkICMPFollows(t, tb, family)
			})
			noChecksumErrors(t, tb)
		})
	}
}

// checkICMPFollows is TestICMPFollowsTheFlow's check in one family.
func checkICMPFollows(t *testing.T, tb *testbed.Testbed, family v1.IPFamily) {
	client := tb.Pod("client")
	for _, svc := range []string{"deaf-local", "deaf-remote"} {
		d := decisionOnOf(t, tb, "node-a1", svc, v1.ProtocolUDP, family)
		if len(d.Backends) != 1 {
			t.Fatalf("%s %s: want one backend: %+v", family, svc, d)
		}
		took, err := refusal(t.Context(), client, v1.ProtocolUDP, d.Frontend)
		if err != nil {
			t.Errorf("%s -> %s (%s): not refused after %s: %v", svc, d.Frontend, d.Backends[0], took, err)
			continue
		}
		t.Logf("%s -> %s (%s on %s): refused after %s", svc, d.Frontend, d.Backends[0], tb.Pod(d.Backends[0]).Node.Name, took)
		if took > time.Second {
			t.Errorf("%s -> %s: refused after %s, want at once", svc, d.Frontend, took)
		}
	}
	d := decisionOnOf(t, tb, "node-a1", "upload", v1.ProtocolTCP, family)
	narrow := client.Node.WireMTU
	if err := upload(t.Context(), client, d.Frontend, 4<<20); err != nil {
		t.Errorf("upload from %s (wire MTU %d) to %s: %v", client.Name, narrow, d.Frontend, err)
	}
	// The pod learnt the narrow MTU for the Service address: the node's
	// error reached it translated (or the upload never needed one, and
	// the check above proves nothing).
	routes, err := client.NS.Netlink().RouteGet(net.IP(d.Frontend.Addr().AsSlice()))
	if err != nil {
		t.Fatalf("route to %s in %s: %v", d.Frontend.Addr(), client.Name, err)
	}
	if len(routes) == 0 || routes[0].MTU == 0 || routes[0].MTU > narrow {
		t.Errorf("%s's route to %s: %+v, want a path MTU of at most %d learnt from the node's error", client.Name, d.Frontend.Addr(), routes, narrow)
	} else {
		t.Logf("%s learnt a path MTU of %d to %s", client.Name, routes[0].MTU, d.Frontend.Addr())
	}
}

// serveSink answers every connection to sinkPort in pod, of either
// family, with the hex sha256 of what it read to the end. The returned
// function stops it.
func serveSink(t *testing.T, pod *testbed.Pod) func() {
	t.Helper()
	l, err := pod.NS.Listen("tcp", fmt.Sprintf(":%d", sinkPort))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				c.SetDeadline(time.Now().Add(30 * time.Second))
				h := sha256.New()
				if _, err := io.Copy(h, c); err == nil {
					io.WriteString(c, hex.EncodeToString(h.Sum(nil)))
				}
			}()
		}
	}()
	return func() {
		l.Close()
		<-done
	}
}

// upload sends n random bytes from client to target (of either family)
// and checks the sink read them all.
func upload(ctx context.Context, client *testbed.Pod, target fmt.Stringer, n int) error {
	payload := make([]byte, n)
	if _, err := rand.Read(payload); err != nil {
		return err
	}
	sum := sha256.Sum256(payload)
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	c, err := client.NS.DialContext(ctx, "tcp", target.String())
	if err != nil {
		return err
	}
	defer c.Close()
	dl, _ := ctx.Deadline()
	c.SetDeadline(dl)
	start := time.Now()
	if _, err := c.Write(payload); err != nil {
		return fmt.Errorf("send: %w", err)
	}
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		return err
	}
	answer, err := io.ReadAll(c)
	if err != nil {
		return fmt.Errorf("after %s, no answer: %w", time.Since(start), err)
	}
	if string(answer) != hex.EncodeToString(sum[:]) {
		return fmt.Errorf("the backend read %q, want the sha256 %x of the %d bytes sent", answer, sum, n)
	}
	return nil
}
