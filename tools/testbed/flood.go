package testbed

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"golang.org/x/sys/unix"

	"github.com/topolb/topolb/internal/netns"
)

// xdpMD mirrors struct xdp_md, the context of an XDP test run.
type xdpMD struct {
	Data, DataEnd, DataMeta, IngressIfindex, RxQueueIndex, EgressIfindex uint32
}

// FloodResult is the outcome of FloodUDP.
type FloodResult struct {
	// Sent is the number of frames injected, as the injecting program
	// counted them: at least the count asked for (a test run interrupted
	// by a signal is run again, and frames injected twice).
	Sent int
	// Took is the time the kernel took to take them through the stack.
	Took time.Duration
	// PPS is Sent / Took.
	PPS float64
	// CPU is the CPU time the flood took: the injecting thread's during
	// the test run, in which the kernel takes every frame through its
	// whole path, the softirqs it raises included (charged to the thread
	// they run in, on kernels without CONFIG_IRQ_TIME_ACCOUNTING), plus
	// the ksoftirqd threads' meanwhile (the softirqs deferred to them).
	// Unlike the machine's busy time, other processes' work is not in it.
	CPU time.Duration
	// Arrived is the number of datagrams the sink counted (CountArrivals
	// only).
	Arrived uint64
	// Stray is the number of datagrams a WireSink counted at its stray
	// address (WireSink.CountArrivals only).
	Stray uint64
	// WireDrops is the number of frames the node's uplink and its switch
	// port dropped (WireSink.CountArrivals only): the kernel's losses on
	// the way to the sink, which say where missing datagrams went.
	WireDrops uint64
}

// CountArrivals runs flood and sets the result's Arrived to how much the
// sink namespace's UDP NoPorts counters of both families grew (Udp
// NoPorts and Udp6NoPorts): the flood's target must lead to a port
// nothing listens on in sink. Frames still in flight when the
// flood returns are waited for (settle). A failed read, or a counter that
// went down, is an error: a check built on it must never see a made-up
// count.
func CountArrivals(sink *NS, flood func() (FloodResult, error)) (FloodResult, error) {
	before, after, res, err := arrivals(sink.UDPNoPortsOfBoth, flood)
	if err != nil {
		return res, fmt.Errorf("count arrivals in %s: %w", sink.Name, err)
	}
	if res.Arrived, err = netns.Growth(before, after); err != nil {
		return res, fmt.Errorf("count arrivals in %s: %w", sink.Name, err)
	}
	return res, nil
}

// arrivals reads a counter, runs flood and reads the counter again once it
// has settled.
func arrivals[T comparable](read func() (T, error), flood func() (FloodResult, error)) (before, after T, res FloodResult, err error) {
	if before, err = read(); err != nil {
		return before, after, res, err
	}
	if res, err = flood(); err != nil {
		return before, after, res, err
	}
	after, err = settle(read)
	return before, after, res, err
}

// settle reads a counter until it has stopped changing for 100 ms (at
// most 2 s: a flood's frames still in flight) and returns its last value.
func settle[T comparable](read func() (T, error)) (T, error) {
	const still, limit = 100 * time.Millisecond, 2 * time.Second
	last, err := read()
	if err != nil {
		return last, err
	}
	lastChange, deadline := time.Now(), time.Now().Add(limit)
	for time.Since(lastChange) < still && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
		now, err := read()
		if err != nil {
			return last, err
		}
		if now != last {
			last, lastChange = now, time.Now()
		}
	}
	return last, nil
}

// floodSourcePort is the source port of every flooded datagram.
const floodSourcePort = 40000

// FloodUDP sends count copies of one UDP datagram from pod p to target into
// p's node, as if the node had received them on the pod's veth: an XDP
// program that writes the datagram and returns XDP_PASS is run with
// BPF_PROG_RUN in live-frame mode
// (BPF_F_TEST_XDP_LIVE_FRAMES), so the kernel builds a packet from each
// frame and hands it to the node's stack (tc ingress, netfilter, routing,
// forwarding onto the wire), all inside the one system call. No pktgen
// module is needed. The frames carry valid checksums. Whether they arrived
// is up to the caller to check (CountArrivals: the receiving pod's UDP
// NoPorts counter when nothing listens on the target port). The datagram
// is of target's family, from p's address of that family.
func (p *Pod) FloodUDP(target netip.AddrPort, count int) (FloodResult, error) {
	host := iface{p.Node.NS, p.HostVeth}
	return floodUDP(injection{at: host, action: xdpPass, src: iface{p.NS, PodIfName}, dst: host},
		netip.AddrPortFrom(p.AddrOf(familyOf(target.Addr())), floodSourcePort), target, count)
}

// XDP actions of the flood's program.
const (
	xdpDrop = 1
	xdpPass = 2
	xdpTX   = 3
)

// iface is an interface of a namespace.
type iface struct {
	ns   *NS
	name string
}

// injection is where a flood's frames enter: the live-frame test run has
// at as its ingress interface and ends each frame with action, xdpPass
// (the frame is received by at, into its namespace's stack) or xdpTX (the
// frame is sent out of at, received by its veth peer as a frame from the
// wire; the peer needs a NAPI instance, napiForXDP). The frames carry
// src's MAC address as source and dst's as destination.
type injection struct {
	at       iface
	action   int32
	src, dst iface
}

// floodUDP injects count datagrams from from to target at in, both of
// one family.
func floodUDP(in injection, from, target netip.AddrPort, count int) (FloodResult, error) {
	if !from.Addr().IsValid() || from.Addr().Is4() != target.Addr().Is4() {
		return FloodResult{}, fmt.Errorf("flood %s -> %s: want a source of the target's family", from, target)
	}
	srcMAC, err := in.src.ns.HardwareAddr(in.src.name)
	if err != nil {
		return FloodResult{}, err
	}
	dstMAC, err := in.dst.ns.HardwareAddr(in.dst.name)
	if err != nil {
		return FloodResult{}, err
	}
	var res FloodResult
	err = in.at.ns.Do(func() error {
		dev, err := net.InterfaceByName(in.at.name)
		if err != nil {
			return err
		}
		frame := udpFrame(srcMAC, dstMAC, from, target, []byte("flood"))
		prog, runs, err := rewriteProgram(frame, in.action)
		if err != nil {
			return err
		}
		defer prog.Close()
		defer runs.Close()
		soft, err := softirqdTime()
		if err != nil {
			return err
		}
		thread := threadTime()
		start := time.Now()
		_, err = prog.Run(&ebpf.RunOptions{
			Data:    frame,
			Repeat:  uint32(count),
			Flags:   unix.BPF_F_TEST_XDP_LIVE_FRAMES,
			Context: &xdpMD{DataEnd: uint32(len(frame)), IngressIfindex: uint32(dev.Index)},
		})
		res = FloodResult{Took: time.Since(start), CPU: threadTime() - thread}
		if err != nil {
			return err
		}
		softAfter, err := softirqdTime()
		if err != nil {
			return err
		}
		res.CPU += softAfter - soft
		// A signal (the Go runtime's preemption) interrupts the test run
		// with EINTR, and cilium/ebpf runs it again from the start: the
		// program's own count is the number of frames injected.
		var key uint32
		var n uint64
		if err := runs.Lookup(&key, &n); err != nil {
			return fmt.Errorf("read the flood's frame count: %w", err)
		}
		res.Sent = int(n)
		return err
	})
	if err != nil {
		if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.EOPNOTSUPP) {
			return res, fmt.Errorf("live-frame test runs unsupported (Linux 5.18+): %w", err)
		}
		return res, fmt.Errorf("live-frame flood from %s: %w", from.Addr(), err)
	}
	res.PPS = float64(res.Sent) / res.Took.Seconds()
	return res, nil
}

// threadTime is the calling thread's CPU time so far.
func threadTime() time.Duration {
	var ts unix.Timespec
	// Cannot fail: the clock exists and ts is valid.
	_ = unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts)
	return time.Duration(ts.Nano())
}

// softirqdTime is the CPU time of the ksoftirqd threads so far (the first
// field of /proc/<pid>/schedstat, in ns).
func softirqdTime() (time.Duration, error) {
	comms, err := filepath.Glob("/proc/[0-9]*/comm")
	if err != nil {
		return 0, err
	}
	var total time.Duration
	found := false
	for _, c := range comms {
		name, err := os.ReadFile(c)
		if err != nil || !strings.HasPrefix(string(name), "ksoftirqd/") {
			continue // a process that exited, or another
		}
		stat, err := os.ReadFile(filepath.Join(filepath.Dir(c), "schedstat"))
		if err != nil {
			return 0, fmt.Errorf("ksoftirqd's CPU time: %w", err)
		}
		fields := strings.Fields(string(stat))
		if len(fields) == 0 {
			return 0, fmt.Errorf("ksoftirqd's CPU time: empty %s", filepath.Join(filepath.Dir(c), "schedstat"))
		}
		ns, err := strconv.ParseInt(fields[0], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("ksoftirqd's CPU time in %q: %w", stat, err)
		}
		total += time.Duration(ns)
		found = true
	}
	if !found {
		return 0, errors.New("no ksoftirqd thread in /proc")
	}
	return total, nil
}

// rewriteProgram returns an XDP program that writes frame over the packet
// and ends with action, and the one-element array in which it counts
// its runs. Live-frame mode recycles its pages without restoring them, and
// the stack rewrites the frames it forwards (DNAT, the next hop's MAC
// address), so each run restores the original bytes first.
func rewriteProgram(frame []byte, action int32) (*ebpf.Program, *ebpf.Map, error) {
	runs, err := ebpf.NewMap(&ebpf.MapSpec{Name: "testbed_runs", Type: ebpf.Array, KeySize: 4, ValueSize: 8, MaxEntries: 1})
	if err != nil {
		return nil, nil, fmt.Errorf("create the flood's run counter: %w", err)
	}
	insns := asm.Instructions{
		// runs[0] += 1, atomically.
		asm.Mov.Reg(asm.R6, asm.R1),
		asm.StoreImm(asm.RFP, -4, 0, asm.Word),
		asm.LoadMapPtr(asm.R1, runs.FD()),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, -4),
		asm.FnMapLookupElem.Call(),
		asm.JEq.Imm(asm.R0, 0, "write"),
		asm.Mov.Imm(asm.R1, 1),
		asm.StoreXAdd(asm.R0, asm.R1, asm.DWord),
		asm.Mov.Reg(asm.R1, asm.R6).WithSymbol("write"),
		asm.LoadMem(asm.R2, asm.R1, 0, asm.Word), // data
		asm.LoadMem(asm.R3, asm.R1, 4, asm.Word), // data_end
		asm.Mov.Reg(asm.R4, asm.R2),
		asm.Add.Imm(asm.R4, int32(len(frame))),
		asm.JGT.Reg(asm.R4, asm.R3, "short"),
	}
	i := 0
	for ; i+4 <= len(frame); i += 4 {
		insns = append(insns, asm.StoreImm(asm.R2, int16(i), int64(int32(binary.NativeEndian.Uint32(frame[i:]))), asm.Word))
	}
	for ; i < len(frame); i++ {
		insns = append(insns, asm.StoreImm(asm.R2, int16(i), int64(frame[i]), asm.Byte))
	}
	insns = append(insns,
		asm.Mov.Imm(asm.R0, action),
		asm.Return(),
		asm.Mov.Imm(asm.R0, xdpDrop).WithSymbol("short"), // shorter than the frame: never, the test run's own data
		asm.Return(),
	)
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Name: "testbed_flood", Type: ebpf.XDP, Instructions: insns, License: "GPL"})
	if err != nil {
		runs.Close()
		return nil, nil, fmt.Errorf("load flood program: %w", err)
	}
	return prog, runs, nil
}

// udpFrame builds Ethernet + IPv4 or IPv6 (from's family, to's too) +
// UDP with valid checksums.
func udpFrame(src, dst net.HardwareAddr, from, to netip.AddrPort, payload []byte) []byte {
	ipLen, etherType := 20, uint16(0x0800)
	if from.Addr().Is6() {
		ipLen, etherType = 40, 0x86dd
	}
	udpLen := 8 + len(payload)
	f := make([]byte, 14+ipLen+udpLen)
	copy(f[0:6], dst)
	copy(f[6:12], src)
	binary.BigEndian.PutUint16(f[12:14], etherType)
	ip := f[14 : 14+ipLen]
	s, d := from.Addr().AsSlice(), to.Addr().AsSlice()
	if ipLen == 20 {
		ip[0] = 0x45
		binary.BigEndian.PutUint16(ip[2:4], uint16(20+udpLen))
		binary.BigEndian.PutUint16(ip[6:8], 0x4000) // DF
		ip[8] = 64
		ip[9] = unix.IPPROTO_UDP
		copy(ip[12:16], s)
		copy(ip[16:20], d)
		binary.BigEndian.PutUint16(ip[10:12], checksum(ip, 0))
	} else {
		ip[0] = 0x60
		binary.BigEndian.PutUint16(ip[4:6], uint16(udpLen))
		ip[6] = unix.IPPROTO_UDP
		ip[7] = 64 // hop limit
		copy(ip[8:24], s)
		copy(ip[24:40], d)
	}
	udp := f[14+ipLen:]
	binary.BigEndian.PutUint16(udp[0:2], from.Port())
	binary.BigEndian.PutUint16(udp[2:4], to.Port())
	binary.BigEndian.PutUint16(udp[4:6], uint16(udpLen))
	copy(udp[8:], payload)
	// Pseudo-header: addresses, protocol, UDP length (RFC 768, RFC 8200
	// 8.1: the same sum over 16-byte addresses).
	var pseudo uint32
	for i := 0; i < len(s); i += 2 {
		pseudo += uint32(binary.BigEndian.Uint16(s[i:])) + uint32(binary.BigEndian.Uint16(d[i:]))
	}
	pseudo += unix.IPPROTO_UDP + uint32(udpLen)
	c := checksum(udp, pseudo)
	if c == 0 {
		c = 0xffff
	}
	binary.BigEndian.PutUint16(udp[6:8], c)
	return f
}

// checksum is the Internet checksum of b, starting from sum.
func checksum(b []byte, sum uint32) uint16 {
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(binary.BigEndian.Uint16(b[i:]))
	}
	if len(b)%2 == 1 {
		sum += uint32(b[len(b)-1]) << 8
	}
	for sum > 0xffff {
		sum = sum>>16 + sum&0xffff
	}
	return ^uint16(sum)
}
