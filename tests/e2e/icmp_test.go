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
)

// icmpSpec is two nodes, node-a1 (the client, web-a1) behind a wire MTU
// of 1400 and node-b1 (web-b1), with no kube-proxy anywhere.
const icmpSpec = `
name: icmp
kubeProxy: none
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

func icmpServices() []testbed.ServiceSpec {
	deaf := []testbed.PortSpec{{Protocol: v1.ProtocolUDP, Port: 53, TargetPort: deafPort}}
	return []testbed.ServiceSpec{
		{Name: "deaf-local", Ports: deaf, Endpoints: []testbed.EndpointSpec{{Pod: "web-a1"}}},
		{Name: "deaf-remote", Ports: deaf, Endpoints: []testbed.EndpointSpec{{Pod: "web-b1"}}},
		{Name: "upload", Ports: []testbed.PortSpec{{Port: 80, TargetPort: sinkPort}}, Endpoints: []testbed.EndpointSpec{{Pod: "web-b1"}}},
	}
}

// TestICMPFollowsTheFlow checks, with no kube-proxy anywhere, that ICMP
// errors about flows through a Service reach the client as errors about
// the Service: a UDP datagram to a Service whose backend port has no
// listener is refused at once, for a backend on the client's node and on
// another node; and a 4 MiB upload from the client pod through a Service
// to a backend on another node completes although the client's node
// forwards into a smaller MTU (1400) than the pod sends (1500): the node's
// "fragmentation needed" must reach the pod about the Service address, or
// path-MTU discovery never shrinks the segments and the upload stalls.
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
			client := tb.Pod("client")
			objs, _ := tb.Current()
			ds, _ := tb.Decide(objs, "node-a1")
			for _, svc := range []string{"deaf-local", "deaf-remote"} {
				d := testbed.FindDecision(ds, svc, v1.ProtocolUDP)
				if d == nil || len(d.Backends) != 1 {
					t.Fatalf("%s: want one backend: %+v", svc, d)
				}
				took, err := refusal(t.Context(), client, v1.ProtocolUDP, d.Frontend)
				if err != nil {
					t.Errorf("%s (%s): not refused after %s: %v", svc, d.Backends[0], took, err)
					continue
				}
				t.Logf("%s (%s on %s): refused after %s", svc, d.Backends[0], tb.Pod(d.Backends[0]).Node.Name, took)
				if took > time.Second {
					t.Errorf("%s: refused after %s, want at once", svc, took)
				}
			}

			d := testbed.FindDecision(ds, "upload", v1.ProtocolTCP)
			if d == nil {
				t.Fatal("no decision for upload")
			}
			stop := serveSink(t, tb.Pod("web-b1"))
			defer stop()
			if err := upload(t.Context(), client, d.Frontend, 4<<20); err != nil {
				t.Errorf("upload from %s (wire MTU 1400) to %s: %v", client.Name, d.Frontend, err)
			}
			noChecksumErrors(t, tb)
		})
	}
}

// serveSink answers every connection to sinkPort in pod with the hex
// sha256 of what it read to the end. The returned function stops it.
func serveSink(t *testing.T, pod *testbed.Pod) func() {
	t.Helper()
	l, err := pod.NS.Listen("tcp4", fmt.Sprintf(":%d", sinkPort))
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

// upload sends n random bytes from client to target and checks the sink
// read them all.
func upload(ctx context.Context, client *testbed.Pod, target fmt.Stringer, n int) error {
	payload := make([]byte, n)
	if _, err := rand.Read(payload); err != nil {
		return err
	}
	sum := sha256.Sum256(payload)
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	c, err := client.NS.DialContext(ctx, "tcp4", target.String())
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
