package maps

import (
	"bufio"
	"context"
	"math/rand/v2"
	"net/netip"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestRealTrafficBlindReset: a live TCP connection through a Service
// survives a blind reset and a spoofed SYN, each with a random sequence
// number, sent from a raw socket in the client's namespace with the
// connection's own addresses and ports (what an off-path attacker spoofs).
// The backend then stays silent for longer than a closing flow lives
// (CT_TIMEOUT_TCP_CLOSING) and answers: the answer must arrive. Before
// the window check, the reset closed the flow, which then expired, and
// the late answer went out untranslated (the client's kernel reset it).
func TestRealTrafficBlindReset(t *testing.T) {
	requirePrivileges(t)
	pin := filepath.Join(bpffs(t), "topolb")
	tb := newTestbed(t)
	d := tb.attachNode1(t, pin)
	const vip = "10.96.0.10:80"
	mustSet(t, d, fe(vip, TCP), Backend{Addr: netip.MustParseAddrPort("10.1.1.2:8080"), NodeLocal: true, ZoneLocal: true})

	// b1 echoes each line; "later" it answers after a closing flow's
	// lifetime of silence.
	ln, err := tb.b1.Listen("tcp", ":8080")
	must(t, err)
	t.Cleanup(func() { ln.Close() })
	quiet := TimeoutTCPClosing + 2*time.Second
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		r := bufio.NewReader(c)
		for {
			line, err := r.ReadString('\n')
			if err != nil {
				return
			}
			if line == "later\n" {
				time.Sleep(quiet)
				line = "late\n"
			}
			if _, err := c.Write([]byte(line)); err != nil {
				return
			}
		}
	}()

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn, err := tb.client.DialContext(ctx, "tcp", vip)
	must(t, err)
	defer conn.Close()
	r := bufio.NewReader(conn)
	exchange := func(send, want string, wait time.Duration) {
		t.Helper()
		must(t, conn.SetDeadline(time.Now().Add(wait)))
		if _, err := conn.Write([]byte(send + "\n")); err != nil {
			t.Fatalf("send %q: %v", send, err)
		}
		got, err := r.ReadString('\n')
		if err != nil {
			t.Fatalf("answer to %q: %v", send, err)
		}
		if got != want+"\n" {
			t.Fatalf("answer to %q: %q, want %q", send, got, want)
		}
	}
	exchange("hello", "hello", 3*time.Second)

	client := conn.LocalAddr().String()
	key := ctKey(client, vip, protoTCP)
	fwd := readCT(t, d, key)
	if fwd.State != uint8(tcCtStateCT_TCP_ESTABLISHED) || fwd.TcpNext == 0 {
		t.Fatalf("flow before the attack: state %d, tcp_next %d; want established with a sequence number", fwd.State, fwd.TcpNext)
	}
	// A random sequence number, drawn again in the rare case it falls in
	// the window (probability 2^-13): the test is about the blind case.
	blindSeq := func() uint32 {
		for {
			seq := rand.Uint32()
			if seq-(fwd.TcpNext-windowBytes) > 2*windowBytes {
				return seq
			}
		}
	}
	before := counterOf(t, d, StatConntrackTCPIgnored)
	// The SYN first: before the window check, a SYN to an established
	// flow whose backend is active changed nothing, the reset closed it.
	for _, f := range []frame{
		tcpFrame(client, vip, tcpSYN, "").withSeq(blindSeq(), 0),
		tcpFrame(client, vip, tcpRST, "").withSeq(blindSeq(), 0),
	} {
		sendRaw(t, tb.client.Do, f)
	}
	// The injected segments pass the datapath before the next exchange.
	exchange("again", "again", 3*time.Second)
	if got := counterOf(t, d, StatConntrackTCPIgnored) - before; got != 2 {
		t.Errorf("%s counted %d, want 2 (the reset and the SYN)", StatConntrackTCPIgnored, got)
	}
	if v := readCT(t, d, key); v.State != uint8(tcCtStateCT_TCP_ESTABLISHED) || v.Flags&uint8(tcCtFlagCT_F_ASSURED) == 0 {
		t.Errorf("flow after the attack: state %d, flags %#x; want established and assured", v.State, v.Flags)
	}
	exchange("later", "late", quiet+5*time.Second)
	tb.noChecksumErrors(t)
}

// windowBytes is CT_TCP_WINDOW (bpf/consts.h).
const windowBytes = uint32(tcCtTcpLimitCT_TCP_WINDOW)

// counterOf reads stat s of d.
func counterOf(t *testing.T, d *Datapath, s Stat) uint64 {
	t.Helper()
	c, err := d.Counters()
	must(t, err)
	return c.Stats[s]
}

// sendRaw sends f's IPv4 packet (its Ethernet header left off) from a raw
// socket (IP_HDRINCL) in the namespace that do runs in: a packet with
// whatever addresses f has, as a spoofing sender makes them.
func sendRaw(t *testing.T, do func(func() error) error, f frame) {
	t.Helper()
	pkt := f.bytes()[14:]
	dst := f.dst.Addr().As4()
	err := do(func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW, unix.IPPROTO_RAW)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		return unix.Sendto(fd, pkt, 0, &unix.SockaddrInet4{Addr: dst})
	})
	if err != nil {
		t.Fatalf("raw send of %s -> %s: %v", f.src, f.dst, err)
	}
}
