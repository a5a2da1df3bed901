package netns

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ethtool value commands for transmit checksum offload and GRO, and the
// commands that read a driver's statistics
// (include/uapi/linux/ethtool.h).
const (
	ethtoolGTXCSUM   = 0x16
	ethtoolSTXCSUM   = 0x17
	ethtoolGSTRINGS  = 0x1b
	ethtoolGSTATS    = 0x1d
	ethtoolSGRO      = 0x2c
	ethtoolGSSETINFO = 0x37
	// ethSSStats is the string set of the statistics' names (ETH_SS_STATS).
	ethSSStats = 1
	// ethGStringLen is the length of one name (ETH_GSTRING_LEN).
	ethGStringLen = 32
)

// ethtoolValue is struct ethtool_value.
type ethtoolValue struct {
	cmd  uint32
	data uint32
}

// ifreqData is struct ifreq with its ifr_data member, padded to the
// union's size.
type ifreqData struct {
	name [unix.IFNAMSIZ]byte
	data unsafe.Pointer
	_    [24 - unsafe.Sizeof(uintptr(0))]byte
}

// ethtool issues one SIOCETHTOOL value command on ifname inside the
// namespace and returns the value the kernel wrote back.
func (ns *NS) ethtool(ifname string, cmd, data uint32) (uint32, error) {
	v := ethtoolValue{cmd: cmd, data: data}
	err := ns.ethtoolIoctl(ifname, unsafe.Pointer(&v))
	runtime.KeepAlive(&v)
	return v.data, err
}

// ethtoolIoctl issues one SIOCETHTOOL command on ifname inside the
// namespace; data is the command's structure, which the kernel reads and
// writes back.
func (ns *NS) ethtoolIoctl(ifname string, data unsafe.Pointer) error {
	return ns.Do(func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		var ifr ifreqData
		copy(ifr.name[:unix.IFNAMSIZ-1], ifname)
		ifr.data = data
		_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.SIOCETHTOOL, uintptr(unsafe.Pointer(&ifr)))
		if errno != 0 {
			return errno
		}
		return nil
	})
}

// ethtoolBuf issues the SIOCETHTOOL command whose structure is buf (the
// command first), which the kernel writes back into.
func (ns *NS) ethtoolBuf(ifname string, buf []byte) error {
	err := ns.ethtoolIoctl(ifname, unsafe.Pointer(&buf[0]))
	runtime.KeepAlive(buf)
	return err
}

// NICStats reads the driver statistics of ifname, as `ethtool -S IFNAME`
// shows them (ETHTOOL_GSSET_INFO, ETHTOOL_GSTRINGS, ETHTOOL_GSTATS), by
// name. A veth's count its receive queues' XDP verdicts
// (rx_queue_N_xdp_tx, rx_queue_N_xdp_redirect, ...). A driver without
// statistics gives an empty map.
func (ns *NS) NICStats(ifname string) (map[string]uint64, error) {
	fail := func(what string, err error) (map[string]uint64, error) {
		return nil, fmt.Errorf("%s: %s of %s: %w", ns.Name, what, ifname, err)
	}
	// struct ethtool_sset_info with room for one set's count.
	info := make([]byte, 20)
	binary.NativeEndian.PutUint32(info[0:], ethtoolGSSETINFO)
	binary.NativeEndian.PutUint64(info[8:], 1<<ethSSStats)
	if err := ns.ethtoolBuf(ifname, info); err != nil {
		return fail("statistics count", err)
	}
	stats := map[string]uint64{}
	if binary.NativeEndian.Uint64(info[8:]) == 0 {
		return stats, nil
	}
	n := int(binary.NativeEndian.Uint32(info[16:]))
	// struct ethtool_gstrings, then struct ethtool_stats.
	names := make([]byte, 12+n*ethGStringLen)
	binary.NativeEndian.PutUint32(names[0:], ethtoolGSTRINGS)
	binary.NativeEndian.PutUint32(names[4:], ethSSStats)
	binary.NativeEndian.PutUint32(names[8:], uint32(n))
	if err := ns.ethtoolBuf(ifname, names); err != nil {
		return fail("statistics names", err)
	}
	values := make([]byte, 8+n*8)
	binary.NativeEndian.PutUint32(values[0:], ethtoolGSTATS)
	binary.NativeEndian.PutUint32(values[4:], uint32(n))
	if err := ns.ethtoolBuf(ifname, values); err != nil {
		return fail("statistics", err)
	}
	if got := int(binary.NativeEndian.Uint32(values[4:])); got != n {
		return fail("statistics", fmt.Errorf("%d values for %d names", got, n))
	}
	for i := range n {
		name := names[12+i*ethGStringLen : 12+(i+1)*ethGStringLen]
		if end := bytes.IndexByte(name, 0); end >= 0 {
			name = name[:end]
		}
		stats[string(name)] = binary.NativeEndian.Uint64(values[8+i*8:])
	}
	return stats, nil
}

// SetTxChecksum switches transmit checksum offload of ifname, as `ethtool
// -K IFNAME tx on|off` does (ETHTOOL_STXCSUM). Off, the kernel finishes
// checksums in software before a packet leaves, as a real NIC puts them on
// the wire, so the receiver verifies what a datapath wrote.
func (ns *NS) SetTxChecksum(ifname string, on bool) error {
	return ns.setFlag(ifname, ethtoolSTXCSUM, "tx checksum offload", on)
}

// setFlag issues the ethtool set command cmd with on as 1 or 0; what
// names the setting in the error.
func (ns *NS) setFlag(ifname string, cmd uint32, what string, on bool) error {
	var data uint32
	if on {
		data = 1
	}
	if _, err := ns.ethtool(ifname, cmd, data); err != nil {
		return fmt.Errorf("%s: set %s of %s to %v: %w", ns.Name, what, ifname, on, err)
	}
	return nil
}

// TxChecksum reports whether transmit checksum offload is on for ifname
// (ETHTOOL_GTXCSUM).
func (ns *NS) TxChecksum(ifname string) (bool, error) {
	v, err := ns.ethtool(ifname, ethtoolGTXCSUM, 0)
	if err != nil {
		return false, fmt.Errorf("%s: get tx checksum offload of %s: %w", ns.Name, ifname, err)
	}
	return v != 0, nil
}

// SetGRO switches generic receive offload of ifname, as `ethtool -K
// IFNAME gro on|off` does (ETHTOOL_SGRO). On a veth it also starts a NAPI
// instance.
func (ns *NS) SetGRO(ifname string, on bool) error {
	return ns.setFlag(ifname, ethtoolSGRO, "GRO", on)
}
