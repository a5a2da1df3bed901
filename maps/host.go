package maps

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// The socket hooks (bpf/sock_lb.c) balance the node's own processes (host
// network) at connect and sendmsg time and show them the frontend in
// recvmsg and getpeername. They attach to the root of the cgroup v2
// hierarchy, so they see every socket of the machine, and act only on
// sockets of the network namespace the Datapath was loaded for
// (Options.NetNS, else the caller's): its netns cookie is a load-time
// constant of the programs.

// sockHook is one of the socket hooks: its link pin is links/sock_<name>.
type sockHook struct {
	name   string
	attach ebpf.AttachType
	prog   string
}

// sockHooks are the socket hooks: IPv4 sockets, IPv6 sockets to IPv6
// frontends, and dual-stack IPv6 sockets reaching IPv4-mapped addresses
// (their unconnected UDP sends go through the IPv4 sendmsg hook).
var sockHooks = []sockHook{
	{"connect4", ebpf.AttachCGroupInet4Connect, sockProgSockConnect4},
	{"sendmsg4", ebpf.AttachCGroupUDP4Sendmsg, sockProgSockSendmsg4},
	{"recvmsg4", ebpf.AttachCGroupUDP4Recvmsg, sockProgSockRecvmsg4},
	{"getpeername4", ebpf.AttachCgroupInet4GetPeername, sockProgSockGetpeername4},
	{"connect6", ebpf.AttachCGroupInet6Connect, sockProgSockConnect6},
	{"sendmsg6", ebpf.AttachCGroupUDP6Sendmsg, sockProgSockSendmsg6},
	{"recvmsg6", ebpf.AttachCGroupUDP6Recvmsg, sockProgSockRecvmsg6},
	{"getpeername6", ebpf.AttachCgroupInet6GetPeername, sockProgSockGetpeername6},
}

// sockNetnsCookieVar is the programs' network namespace constant.
const sockNetnsCookieVar = "cfg_netns_cookie"

func (d *attacher) sockPin(h sockHook) string {
	return filepath.Join(d.linksDir(), "sock_"+h.name)
}

// loadSockObject loads the socket hooks with the shared maps and this
// Datapath's network namespace cookie.
func (d *attacher) loadSockObject() (*ebpf.Collection, error) {
	spec, err := loadSock()
	if err != nil {
		return nil, err
	}
	sizeMaps(spec, d.opts)
	if err := configure(spec, d.opts, d.compat, d.ctSrcSeed, d.hashSeed); err != nil {
		return nil, err
	}
	var cookie uint64 // without SO_NETNS_COOKIE, 0: the hooks act on no socket
	if d.compat.netnsCookie {
		if err := d.inNetNS(func() error {
			cookie, err = netnsCookie()
			return err
		}); err != nil {
			return nil, err
		}
	}
	v, ok := spec.Variables[sockNetnsCookieVar]
	if !ok {
		return nil, fmt.Errorf("socket hooks: no variable %s", sockNetnsCookieVar)
	}
	if err := v.Set(cookie); err != nil {
		return nil, fmt.Errorf("socket hooks: set %s: %w", sockNetnsCookieVar, err)
	}
	coll, err := ebpf.NewCollectionWithOptions(spec, ebpf.CollectionOptions{MapReplacements: d.sharedMapSet()})
	if err != nil {
		return nil, fmt.Errorf("load socket hooks: %w", err)
	}
	return coll, nil
}

// netnsCookie returns the cookie of the calling thread's network namespace
// (SO_NETNS_COOKIE, Linux 5.14), what bpf_get_netns_cookie returns for its
// sockets.
func netnsCookie() (uint64, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return 0, fmt.Errorf("socket for the netns cookie: %w", err)
	}
	defer unix.Close(fd)
	c, err := unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_NETNS_COOKIE)
	if err != nil {
		return 0, fmt.Errorf("read the netns cookie (SO_NETNS_COOKIE, Linux 5.14): %w", err)
	}
	return c, nil
}

// AttachHost attaches the socket hooks to the cgroup v2 hierarchy whose
// root is cgroupRoot (CgroupRoot finds it) and pins their links under
// PinPath/links as sock_<hook>: from then on the node's own processes
// reach frontends of scope internal (cluster IPs, NodePorts on the node's
// addresses, external and load-balancer IPs) through the same backend
// choice as pods, and see the frontend as their peer. Links pinned by an
// earlier process are updated to these programs when they are attached to
// the same cgroup, and replaced otherwise. cgroupRoot must be the root of
// a cgroup v2 hierarchy: hooks on a sub-cgroup would miss the processes
// outside it.
func (d *attacher) AttachHost(cgroupRoot string) error {
	if err := checkCgroupRoot(cgroupRoot); err != nil {
		return fmt.Errorf("attach socket hooks: %w", err)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.linksReady(); err != nil {
		return err
	}
	var st unix.Stat_t
	if err := unix.Stat(cgroupRoot, &st); err != nil {
		return fmt.Errorf("attach socket hooks: %w", err)
	}
	for _, h := range sockHooks {
		if err := d.attachSock(h, cgroupRoot, st.Ino); err != nil {
			return fmt.Errorf("attach socket hook %s to %s: %w", h.name, cgroupRoot, err)
		}
	}
	d.log.Info("attached socket hooks", "cgroup", cgroupRoot)
	return nil
}

// attachSock attaches one socket hook, or updates the link an earlier
// process pinned when it is attached to the cgroup with id cgroupID (the
// inode number of the cgroup's directory).
func (d *attacher) attachSock(h sockHook, cgroupRoot string, cgroupID uint64) error {
	prog := d.sockColl.Programs[h.prog]
	pin := d.sockPin(h)
	l, err := link.LoadPinnedLink(pin, nil)
	switch {
	case errors.Is(err, os.ErrNotExist):
	case err != nil:
		return fmt.Errorf("load pinned link %s: %w", pin, err)
	default:
		defer l.Close()
		info, err := l.Info()
		if err == nil && info.Cgroup() != nil && info.Cgroup().CgroupId == cgroupID {
			if err := l.Update(prog); err == nil {
				d.log.Info("re-adopted pinned link", "pin", pin)
				return nil
			}
		}
		if err := l.Unpin(); err != nil {
			return fmt.Errorf("unpin stale link %s: %w", pin, err)
		}
	}
	nl, err := link.AttachCgroup(link.CgroupOptions{Path: cgroupRoot, Attach: h.attach, Program: prog})
	if err != nil {
		return err
	}
	defer nl.Close()
	if err := nl.Pin(pin); err != nil {
		return fmt.Errorf("pin link: %w", err)
	}
	return nil
}

// DetachHost detaches the socket hooks and removes their links' pins: the
// node's processes reach frontend addresses untranslated again. Detaching
// hooks that are not attached is not an error.
func (d *attacher) DetachHost() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.detachHost()
}

func (d *attacher) detachHost() error {
	var errs []error
	for _, h := range sockHooks {
		if err := detachPinned(d.sockPin(h)); err != nil {
			errs = append(errs, fmt.Errorf("detach socket hook %s: %w", h.name, err))
		}
	}
	return errors.Join(errs...)
}

// detachPinned detaches the link pinned at pin at once and removes the
// pin. Removing the pin alone would leave the detaching to the kernel's
// deferred release of the link. A missing pin is not an error.
func detachPinned(pin string) error {
	l, err := link.LoadPinnedLink(pin, nil)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("load pinned link %s: %w", pin, err)
	}
	defer l.Close()
	if err := l.Detach(); err != nil && !errors.Is(err, ebpf.ErrNotSupported) {
		return err
	}
	return l.Unpin()
}

// HostAttached reports how many of the socket hooks have a pinned link:
// 0 (detached) or all of them, unless an attach failed half way.
func (d *attacher) HostAttached() (attached, of int, err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, h := range sockHooks {
		_, err := os.Stat(d.sockPin(h))
		switch {
		case err == nil:
			attached++
		case !errors.Is(err, os.ErrNotExist):
			return attached, len(sockHooks), fmt.Errorf("socket hook %s: %w", h.name, err)
		}
	}
	return attached, len(sockHooks), nil
}

// CgroupRoot returns where to attach the socket hooks: the root of the
// cgroup v2 hierarchy at path or, when path is a cgroup v1 layout (a
// hybrid host), at path/unified. An empty path or "auto" looks for the
// cgroup2 mount in /proc/self/mountinfo. In a container with a cgroup
// namespace of its own, the cgroup2 mount is the container's cgroup, not
// the root, and is refused: mount the node's /sys/fs/cgroup (a hostPath)
// and name it.
func CgroupRoot(path string) (string, error) {
	if path == "" || path == "auto" {
		f, err := os.Open("/proc/self/mountinfo")
		if err != nil {
			return "", fmt.Errorf("find the cgroup v2 mount: %w", err)
		}
		defer f.Close()
		mnt, err := cgroup2Mount(f)
		if err != nil {
			return "", err
		}
		if err := checkCgroupRoot(mnt); err != nil {
			return "", err
		}
		return mnt, nil
	}
	if err := checkCgroupRoot(path); err == nil {
		return path, nil
	} else if unified := filepath.Join(path, "unified"); checkCgroupRoot(unified) == nil {
		return unified, nil
	} else {
		return "", err
	}
}

// cgroup2Mount returns the mount point of the first cgroup2 file system in
// a mountinfo listing.
func cgroup2Mount(mountinfo io.Reader) (string, error) {
	sc := bufio.NewScanner(mountinfo)
	for sc.Scan() {
		// ID parent major:minor root mountpoint options [optional...] - fstype source superoptions
		pre, post, ok := strings.Cut(sc.Text(), " - ")
		fields, after := strings.Fields(pre), strings.Fields(post)
		if !ok || len(fields) < 5 || len(after) < 1 {
			continue
		}
		if after[0] == "cgroup2" {
			return unescapeMountinfo(fields[4]), nil
		}
	}
	if err := sc.Err(); err != nil {
		return "", fmt.Errorf("read mountinfo: %w", err)
	}
	return "", errors.New("no cgroup2 file system is mounted (the socket hooks need cgroup v2)")
}

// unescapeMountinfo undoes mountinfo's octal escapes (\040 for a space).
func unescapeMountinfo(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var v byte
			ok := true
			for _, c := range s[i+1 : i+4] {
				if c < '0' || c > '7' {
					ok = false
					break
				}
				v = v*8 + byte(c-'0')
			}
			if ok {
				b.WriteByte(v)
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// cgroupRootIno is the inode number of a cgroup v2 hierarchy's root
// directory (its cgroup id); a cgroup namespace's root has another.
const cgroupRootIno = 1

// checkCgroupRoot refuses a path that is not the root of a cgroup v2
// hierarchy.
func checkCgroupRoot(path string) error {
	var fs unix.Statfs_t
	if err := unix.Statfs(path, &fs); err != nil {
		return fmt.Errorf("cgroup root %s: %w", path, err)
	}
	if uint32(fs.Type) != unix.CGROUP2_SUPER_MAGIC {
		return fmt.Errorf("cgroup root %s is not a cgroup v2 file system", path)
	}
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return fmt.Errorf("cgroup root %s: %w", path, err)
	}
	if st.Ino != cgroupRootIno {
		return fmt.Errorf("cgroup %s is not the root of its hierarchy (a cgroup namespace's, or a sub-cgroup): the socket hooks would miss the node's other processes; mount the node's cgroup2 root and name it", path)
	}
	return nil
}
