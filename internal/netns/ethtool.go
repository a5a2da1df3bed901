package netns

import (
	"fmt"
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ethtool value commands for transmit checksum offload and GRO
// (include/uapi/linux/ethtool.h).
const (
	ethtoolGTXCSUM = 0x16
	ethtoolSTXCSUM = 0x17
	ethtoolSGRO    = 0x2c
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
	err := ns.Do(func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		var ifr ifreqData
		copy(ifr.name[:unix.IFNAMSIZ-1], ifname)
		ifr.data = unsafe.Pointer(&v)
		_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.SIOCETHTOOL, uintptr(unsafe.Pointer(&ifr)))
		runtime.KeepAlive(&v)
		if errno != 0 {
			return errno
		}
		return nil
	})
	return v.data, err
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
