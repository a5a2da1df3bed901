package testbed

import (
	"fmt"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
)

// xdpPass is XDP_PASS, what the switch ports' program returns.
const xdpPass = 2

// passXDP attaches an XDP program that passes every frame to ifname in
// ns, through netlink in driver mode, so it stays attached until the
// interface is deleted. A veth takes frames its peer sends with XDP_TX or
// XDP_REDIRECT (topolb's rejects and forwarding on a node's uplink) only
// when it has an XDP program of its own: its receive queues then run in
// NAPI mode. A real NIC's link partner needs nothing of the kind. With a
// program attached, the peer (the node's uplink) sends no GSO packets and
// its MTU is bounded by a page.
func passXDP(ns *NS, ifname string) error {
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name:         "testbed_pass",
		Type:         ebpf.XDP,
		License:      "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, xdpPass), asm.Return()},
	})
	if err != nil {
		return fmt.Errorf("load the switch port's XDP program: %w", err)
	}
	// The kernel keeps the attached program; this descriptor can go.
	defer prog.Close()
	return ns.Do(func() error {
		l, err := netlink.LinkByName(ifname)
		if err != nil {
			return err
		}
		if err := netlink.LinkSetXdpFdWithFlags(l, prog.FD(), nl.XDP_FLAGS_DRV_MODE); err != nil {
			return fmt.Errorf("attach XDP to switch port %s: %w", ifname, err)
		}
		return nil
	})
}
