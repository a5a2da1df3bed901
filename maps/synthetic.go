package maps

import (
	"errors"
	"fmt"
	"net/netip"
	"time"

	"golang.org/x/sys/unix"
)

// syntheticClients is where FillConntrack's clients come from: the
// shared address space (RFC 6598), which no test or testbed uses.
var syntheticClients = netip.MustParsePrefix("100.64.0.0/10")

// FillConntrack writes flows established TCP flows into the IPv4
// established conntrack table, as the datapath would have created them:
// a forward entry (client → frontend, translated to a backend, holding
// the backend's id and generation) and a reply entry (backend → client)
// each, alive for lifetime. They are spread round-robin over the members
// of the programmed IPv4 TCP frontends, from clients in 100.64.0.0/10.
// It is for benchmarks that measure the agent beside a busy node's table
// (make bench-agent): no packet matches the flows, and the sweep deletes
// them once they expire. It returns how many flows it wrote; ErrMapFull
// when the table filled first.
func (d *upkeep) FillConntrack(flows int, lifetime time.Duration) (int, error) {
	type target struct {
		fe      netip.AddrPort
		be      netip.AddrPort
		id, gen uint32
		svc     uint32
	}
	d.mu.Lock()
	if d.closed() {
		d.mu.Unlock()
		return 0, ErrClosed
	}
	var targets []target
	for fe, s := range d.fes {
		if fe.Proto != TCP || !fe.Addr.Addr().Is4() {
			continue
		}
		for _, m := range s.members {
			targets = append(targets, target{fe.Addr, m.be.Addr, m.id, m.gen, s.id})
		}
	}
	now, err := d.compat.now()
	table := d.conntrack
	d.mu.Unlock()
	if err != nil {
		return 0, fmt.Errorf("fill conntrack: %w", err)
	}
	if len(targets) == 0 {
		return 0, errors.New("fill conntrack: no IPv4 TCP frontend has a backend")
	}
	expires := now + uint64(lifetime.Nanoseconds())
	base := syntheticClients.Addr().As4()
	const batch = 4096
	keys := make([]tcCtKey, 0, batch)
	vals := make([]tcCtValue, 0, batch)
	written := 0
	flush := func() error {
		if len(keys) == 0 {
			return nil
		}
		// The kernel takes no BPF_NOEXIST for a batch: the keys are
		// distinct by construction (one client port per flow).
		n, err := table.BatchUpdate(keys, vals, nil)
		written += n / 2
		keys, vals = keys[:0], vals[:0]
		if errors.Is(err, unix.E2BIG) || errors.Is(err, unix.ENOSPC) {
			return fmt.Errorf("fill conntrack: %w: %w", ErrMapFull, err)
		}
		if err != nil {
			return fmt.Errorf("fill conntrack: %w", err)
		}
		return nil
	}
	flags := uint8(tcCtFlagCT_F_ASSURED | tcCtFlagCT_F_REPLIED)
	for i := range flows {
		t := targets[i%len(targets)]
		// One client address per 60,000 flows, ports from 1,024 up.
		c := base
		host := uint32(i / 60_000)
		c[1] |= byte(host >> 16 & 0x3f)
		c[2], c[3] = byte(host>>8), byte(host)
		client := netip.AddrPortFrom(netip.AddrFrom4(c), uint16(1024+i%60_000))
		fwd := tcCtKey{Saddr: be32(client.Addr()), Daddr: be32(t.fe.Addr()), Sport: be16(client.Port()), Dport: be16(t.fe.Port()), Proto: uint8(TCP)}
		rev := tcCtKey{Saddr: be32(t.be.Addr()), Daddr: be32(client.Addr()), Sport: be16(t.be.Port()), Dport: be16(client.Port()), Proto: uint8(TCP)}
		v := tcCtValue{State: uint8(tcCtStateCT_TCP_ESTABLISHED), BackendId: t.id, BackendGen: t.gen, Expires: expires, Flags: flags, SvcId: t.svc}
		fv, rv := v, v
		fv.Addr, fv.Port, fv.Dir, fv.Packets, fv.Bytes = be32(t.be.Addr()), be16(t.be.Port()), uint8(tcCtDirCT_FORWARD), 10, 1000
		rv.Addr, rv.Port, rv.Dir = be32(t.fe.Addr()), be16(t.fe.Port()), uint8(tcCtDirCT_REVERSE)
		keys, vals = append(keys, fwd, rev), append(vals, fv, rv)
		if len(keys) >= batch {
			if err := flush(); err != nil {
				return written, err
			}
		}
	}
	return written, flush()
}
