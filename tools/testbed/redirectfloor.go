package testbed

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// RedirectFloor is the least a service proxy on a pod veth's tc hook can
// do for one IPv4 UDP flow from the pod to a Service whose backend is on
// another node: a tcx program, first on the pod's host veth ingress, that
// matches the flow's frames (IPv4 without options, UDP, the Service's
// address and port), rewrites the destination to the backend (address,
// port, the IPv4 header and UDP checksums with the kernel's helpers, as a
// proxy does) and the MAC addresses to the node's uplink and the
// backend's node, and sends the frame out of the node's uplink with
// bpf_redirect. No lookup, no state, no choice: whatever a real proxy
// does beyond this is its own cost. BenchmarkE2E measures node_pps
// through it (issue 23) to show the rate no tc-hook proxy can pass on
// this path. Every other frame goes on to the hook's next program
// (TCX_NEXT), so the node's own datapath, if any, still sees it.
type RedirectFloor struct {
	l    link.Link
	prog *ebpf.Program
}

// tcxNext is the tcx verdict that hands a packet to the next program.
const tcxNext = -1

// AttachRedirectFloor attaches a RedirectFloor for datagrams from p to
// target, taking them to backend's address at port. It needs tcx links
// (Linux 6.6). Close takes it off.
func (p *Pod) AttachRedirectFloor(target netip.AddrPort, backend *Pod, port uint16) (*RedirectFloor, error) {
	to := netip.AddrPortFrom(backend.Addr, port)
	if !target.Addr().Is4() || !to.Addr().Is4() {
		return nil, fmt.Errorf("redirect floor %s -> %s: IPv4 only", target, to)
	}
	if backend.Node == p.Node {
		return nil, fmt.Errorf("redirect floor to %s: the backend must be on another node than %s", backend.Name, p.Node.Name)
	}
	src, err := p.Node.NS.HardwareAddr(UplinkName)
	if err != nil {
		return nil, err
	}
	dst, err := backend.Node.NS.HardwareAddr(UplinkName)
	if err != nil {
		return nil, err
	}
	var f *RedirectFloor
	err = p.Node.NS.Do(func() error {
		up, err := net.InterfaceByName(UplinkName)
		if err != nil {
			return err
		}
		veth, err := net.InterfaceByName(p.HostVeth)
		if err != nil {
			return err
		}
		prog, err := redirectFloorProgram(target, to, src, dst, up.Index)
		if err != nil {
			return err
		}
		l, err := link.AttachTCX(link.TCXOptions{Interface: veth.Index, Program: prog, Attach: ebpf.AttachTCXIngress, Anchor: link.Head()})
		if err != nil {
			prog.Close()
			return fmt.Errorf("attach the redirect floor to %s's tcx ingress: %w", p.HostVeth, err)
		}
		f = &RedirectFloor{l: l, prog: prog}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("%s: %w", p.Node.NS.Name, err)
	}
	return f, nil
}

// Close detaches the floor.
func (f *RedirectFloor) Close() error {
	return errors.Join(f.l.Close(), f.prog.Close())
}

// redirectFloorProgram builds the floor's program; ifindex is the uplink's.
func redirectFloorProgram(target, to netip.AddrPort, src, dst net.HardwareAddr, ifindex int) (*ebpf.Program, error) {
	ne32 := func(b []byte) int64 { return int64(int32(binary.NativeEndian.Uint32(b))) }
	ne16 := func(b []byte) int64 { return int64(int16(binary.NativeEndian.Uint16(b))) }
	const (
		skbData    = 76 // offsetof(struct __sk_buff, data)
		skbDataEnd = 80 // offsetof(struct __sk_buff, data_end)
	)
	insns := asm.Instructions{
		asm.Mov.Reg(asm.R6, asm.R1),
		asm.LoadMem(asm.R2, asm.R6, skbData, asm.Word),
		asm.LoadMem(asm.R3, asm.R6, skbDataEnd, asm.Word),
	}
	insns = append(insns, ipv4UDP("next")...)
	insns = append(insns,
		asm.LoadMem(asm.R4, asm.R2, offDaddr, asm.Word),
		asm.JNE.Imm32(asm.R4, be32(target.Addr()), "next"),
		asm.LoadMem(asm.R4, asm.R2, offDport, asm.Half),
		asm.JNE.Imm32(asm.R4, be16(target.Port()), "next"),
		// The rewrite: MAC addresses, destination address and port.
		asm.StoreImm(asm.R2, 0, ne32(dst[0:4]), asm.Word),
		asm.StoreImm(asm.R2, 4, ne16(dst[4:6]), asm.Half),
		asm.StoreImm(asm.R2, 6, ne32(src[0:4]), asm.Word),
		asm.StoreImm(asm.R2, 10, ne16(src[4:6]), asm.Half),
		asm.StoreImm(asm.R2, offDaddr, int64(be32(to.Addr())), asm.Word),
		asm.StoreImm(asm.R2, offDport, int64(be16(to.Port())), asm.Half),
		// The checksums, after the stores: the helpers invalidate the
		// packet pointers. bpf_l3_csum_replace(skb, off, from, to, 4).
		asm.Mov.Reg(asm.R1, asm.R6),
		asm.Mov.Imm(asm.R2, offIPCsum),
		asm.Mov.Imm32(asm.R3, be32(target.Addr())),
		asm.Mov.Imm32(asm.R4, be32(to.Addr())),
		asm.Mov.Imm(asm.R5, 4),
		asm.FnL3CsumReplace.Call(),
		// bpf_l4_csum_replace(skb, off, from, to, BPF_F_PSEUDO_HDR |
		// BPF_F_MARK_MANGLED_0 | 4): the address is in the pseudo-header.
		asm.Mov.Reg(asm.R1, asm.R6),
		asm.Mov.Imm(asm.R2, offUDPCsum),
		asm.Mov.Imm32(asm.R3, be32(target.Addr())),
		asm.Mov.Imm32(asm.R4, be32(to.Addr())),
		asm.Mov.Imm(asm.R5, unix.BPF_F_PSEUDO_HDR|unix.BPF_F_MARK_MANGLED_0|4),
		asm.FnL4CsumReplace.Call(),
		asm.Mov.Reg(asm.R1, asm.R6),
		asm.Mov.Imm(asm.R2, offUDPCsum),
		asm.Mov.Imm32(asm.R3, be16(target.Port())),
		asm.Mov.Imm32(asm.R4, be16(to.Port())),
		asm.Mov.Imm(asm.R5, unix.BPF_F_MARK_MANGLED_0|2),
		asm.FnL4CsumReplace.Call(),
		// bpf_redirect(uplink, 0): out of the uplink.
		asm.Mov.Imm(asm.R1, int32(ifindex)),
		asm.Mov.Imm(asm.R2, 0),
		asm.FnRedirect.Call(),
		asm.Return(),
		asm.Mov.Imm(asm.R0, tcxNext).WithSymbol("next"),
		asm.Return(),
	)
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Name: "testbed_floor", Type: ebpf.SchedCLS, AttachType: ebpf.AttachTCXIngress, Instructions: insns, License: "GPL"})
	if err != nil {
		return nil, fmt.Errorf("load the redirect floor program: %w", err)
	}
	return prog, nil
}
