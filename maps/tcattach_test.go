package maps

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/topolb/topolb/internal/nettest"
)

// inEachTCAttach runs test as one subtest per attach mode, tcx first;
// tcx's skips where the kernel has no tcx links.
func inEachTCAttach(t *testing.T, test func(*testing.T, TCAttach)) {
	for _, mode := range []TCAttach{TCAttachTCX, TCAttachTC} {
		t.Run(string(mode), func(t *testing.T) {
			requireTCAttach(t, mode)
			test(t, mode)
		})
	}
}

// requireTCAttach skips where the kernel cannot attach in mode: tcx links
// need Linux 6.6.
func requireTCAttach(t *testing.T, mode TCAttach) {
	t.Helper()
	if mode != TCAttachTCX {
		return
	}
	tcx, err := probeTCX()
	if err != nil {
		t.Fatal(err)
	}
	if !tcx {
		t.Skip("kernel has no tcx links (Linux 6.6)")
	}
}

// tcxFeature is the tcx links feature of d's kernel report.
func tcxFeature(t *testing.T, d *Datapath) KernelFeature {
	t.Helper()
	for _, f := range d.Kernel().Features {
		if f.Name == featureTCX {
			return f
		}
	}
	t.Fatalf("no %q in the kernel report %+v", featureTCX, d.Kernel())
	return KernelFeature{}
}

func TestParseTCAttach(t *testing.T) {
	for _, c := range []struct {
		in      string
		want    TCAttach
		wantErr bool
	}{
		{"auto", TCAttachAuto, false},
		{"tcx", TCAttachTCX, false},
		{"tc", TCAttachTC, false},
		{"", "", true},
		{"TC", "", true},
		{"clsact", "", true},
	} {
		got, err := ParseTCAttach(c.in)
		if got != c.want || (err != nil) != c.wantErr {
			t.Errorf("ParseTCAttach(%q) = %q, %v; want %q, error %v", c.in, got, err, c.want, c.wantErr)
		}
	}
}

// TestChooseTCAttach: auto takes tcx where the kernel has it and tc
// elsewhere, a forced mode is kept, and tcx forced on a kernel without it
// is an error naming the feature and its release; the choice is the tcx
// feature's path.
func TestChooseTCAttach(t *testing.T) {
	for _, c := range []struct {
		name    string
		want    TCAttach
		tcx     bool
		got     TCAttach
		wantErr bool
	}{
		{"auto with tcx", TCAttachAuto, true, TCAttachTCX, false},
		{"auto without tcx", TCAttachAuto, false, TCAttachTC, false},
		{"tc forced with tcx", TCAttachTC, true, TCAttachTC, false},
		{"tc forced without tcx", TCAttachTC, false, TCAttachTC, false},
		{"tcx forced with tcx", TCAttachTCX, true, TCAttachTCX, false},
		{"tcx forced without tcx", TCAttachTCX, false, "", true},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := KernelReport{Release: "6.1.0-50-amd64", Features: []KernelFeature{
				{Name: "BPF_FIB_LOOKUP_SRC", Since: "6.7", Present: true, Without: "dropped"},
				{Name: featureTCX, Since: "6.6", Present: c.tcx, Without: "clsact"},
			}}
			got, err := r.chooseTCAttach(c.want)
			if got != c.got || (err != nil) != c.wantErr {
				t.Fatalf("chooseTCAttach(%q) = %q, %v; want %q, error %v", c.want, got, err, c.got, c.wantErr)
			}
			if c.wantErr {
				if !errors.Is(err, ErrKernelFeature) || !bytes.Contains([]byte(err.Error()), []byte("tcx links (Linux 6.6)")) {
					t.Errorf("error %v: want ErrKernelFeature naming tcx links (Linux 6.6)", err)
				}
				return
			}
			if r.Features[1].Path != string(c.got) || r.Features[0].Path != "" {
				t.Errorf("paths %q, %q; want \"\", %q", r.Features[0].Path, r.Features[1].Path, c.got)
			}
			if err := r.Err(); err != nil {
				t.Errorf("Err() = %v: tcx has a fallback", err)
			}
		})
	}
}

// foreignFilter is another tool's direct-action cls_bpf filter: a
// program that passes everything on (TC_ACT_UNSPEC: the next filter).
type foreignFilter struct {
	ifname     string
	parent     uint32
	prio       uint16
	handle     uint32
	name       string
	prog       *ebpf.Program
	programsID ebpf.ProgramID
}

// addForeignFilter adds f to ns, with the clsact qdisc where missing.
func addForeignFilter(t *testing.T, ns *nettest.NS, f *foreignFilter) {
	t.Helper()
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name: "other_tool", Type: ebpf.SchedCLS, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, -1), asm.Return()},
	})
	must(t, err)
	t.Cleanup(func() { prog.Close() })
	f.prog = prog
	f.programsID, err = programID(prog)
	must(t, err)
	nl := ns.Netlink()
	l, err := nl.LinkByName(f.ifname)
	must(t, err)
	clsact := &netlink.GenericQdisc{QdiscType: "clsact", QdiscAttrs: netlink.QdiscAttrs{
		LinkIndex: l.Attrs().Index, Parent: netlink.HANDLE_CLSACT, Handle: netlink.MakeHandle(0xffff, 0)}}
	if err := nl.QdiscAdd(clsact); err != nil && !errors.Is(err, unix.EEXIST) {
		t.Fatal(err)
	}
	must(t, nl.FilterAdd(&netlink.BpfFilter{
		FilterAttrs: netlink.FilterAttrs{LinkIndex: l.Attrs().Index, Parent: f.parent, Priority: f.prio,
			Handle: f.handle, Protocol: unix.ETH_P_ALL},
		Fd: prog.FD(), Name: f.name, DirectAction: true,
	}))
}

// present fails the test unless f is still on its interface, running its
// program, and the clsact qdisc with it.
func (f *foreignFilter) present(t *testing.T, ns *nettest.NS, step string) {
	t.Helper()
	nl := ns.Netlink()
	l, err := nl.LinkByName(f.ifname)
	must(t, err)
	fs, err := nl.FilterList(l, f.parent)
	if err != nil {
		t.Fatalf("%s: list filters of %s: %v", step, f.ifname, err)
	}
	for _, x := range fs {
		if bf, ok := x.(*netlink.BpfFilter); ok && bf.Name == f.name && bf.Priority == f.prio &&
			bf.Handle == f.handle && ebpf.ProgramID(bf.Id) == f.programsID {
			return
		}
	}
	t.Errorf("%s: %s's filter %q (priority %d, handle %#x) is gone: %+v", step, f.ifname, f.name, f.prio, f.handle, fs)
}

// topolbFilters lists the filters of topolb's on ifname in ns, as
// "hook:program id".
func topolbFilters(t *testing.T, ns *nettest.NS, ifname string) []string {
	t.Helper()
	nl := ns.Netlink()
	l, err := nl.LinkByName(ifname)
	must(t, err)
	var out []string
	for _, parent := range []uint32{netlink.HANDLE_MIN_INGRESS, netlink.HANDLE_MIN_EGRESS} {
		fs, err := nl.FilterList(l, parent)
		if err != nil && !errors.Is(err, unix.EINVAL) {
			t.Fatalf("list filters of %s: %v", ifname, err)
		}
		for _, x := range fs {
			if bf, ok := x.(*netlink.BpfFilter); ok {
				if h, ok := strings.CutPrefix(bf.Name, tcFilterPrefix); ok {
					out = append(out, fmt.Sprintf("%s:%d", h, bf.Id))
				}
			}
		}
	}
	slices.Sort(out)
	return out
}

// hookPrograms reads which program runs at each tc hook of ifname (link
// or filter), as "hook:program id".
func hookPrograms(t *testing.T, d *Datapath, ns *nettest.NS, ifname string) []string {
	t.Helper()
	var out []string
	must(t, ns.Do(func() error {
		for _, h := range hooks {
			if !tcHook(h) {
				continue
			}
			id, found, err := d.hookProgram(h, ifname)
			if err != nil {
				return err
			}
			if found {
				out = append(out, fmt.Sprintf("%s:%d", h, id))
			}
		}
		return nil
	}))
	return out
}

// wantPrograms is what hookPrograms reads where d attached ifname: its
// own programs at the hooks of a pod or an uplink on the tc path.
func wantPrograms(t *testing.T, d *Datapath, uplink bool) []string {
	t.Helper()
	id := func(p *ebpf.Program) ebpf.ProgramID {
		x, err := programID(p)
		must(t, err)
		return x
	}
	if uplink {
		return []string{fmt.Sprintf("%s:%d", hookUplink, id(d.uplinkLBProg)), fmt.Sprintf("%s:%d", hookUplinkEgress, id(d.tcEgressProg))}
	}
	return []string{fmt.Sprintf("%s:%d", hookTC, id(d.tcProg)), fmt.Sprintf("%s:%d", hookTCEgress, id(d.tcEgressProg))}
}

// echoStream is a TCP connection through a frontend to an echo backend
// that a goroutine keeps talking on, every few milliseconds, until stop.
type echoStream struct {
	conn   net.Conn
	mu     sync.Mutex
	rounds int
	err    error
	stopc  chan struct{}
	done   chan struct{}
}

func serveEcho(t *testing.T, ns *nettest.NS, addr string) {
	l, err := ns.Listen("tcp4", addr)
	must(t, err)
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() { defer c.Close(); io.Copy(c, c) }()
		}
	}()
}

func startEcho(t *testing.T, from *nettest.NS, addr string) *echoStream {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn, err := from.DialContext(ctx, "tcp4", addr)
	must(t, err)
	s := &echoStream{conn: conn, stopc: make(chan struct{}), done: make(chan struct{})}
	t.Cleanup(func() { s.stop(); conn.Close() })
	go s.loop()
	return s
}

func (s *echoStream) loop() {
	defer close(s.done)
	for i := 0; ; i++ {
		select {
		case <-s.stopc:
			return
		case <-time.After(5 * time.Millisecond):
		}
		if err := s.round(i); err != nil {
			s.mu.Lock()
			s.err = err
			s.mu.Unlock()
			return
		}
	}
}

func (s *echoStream) round(i int) error {
	msg := []byte(fmt.Sprintf("round %d", i))
	if err := s.conn.SetDeadline(time.Now().Add(3 * time.Second)); err != nil {
		return err
	}
	if _, err := s.conn.Write(msg); err != nil {
		return fmt.Errorf("round %d: write: %w", i, err)
	}
	buf := make([]byte, len(msg))
	if _, err := io.ReadFull(s.conn, buf); err != nil {
		return fmt.Errorf("round %d: read: %w", i, err)
	}
	if !bytes.Equal(buf, msg) {
		return fmt.Errorf("round %d: echo %q, want %q", i, buf, msg)
	}
	s.mu.Lock()
	s.rounds++
	s.mu.Unlock()
	return nil
}

// alive fails the test if the stream broke, and waits until it has made
// at least three more rounds since it was called.
func (s *echoStream) alive(t *testing.T, step string) {
	t.Helper()
	s.mu.Lock()
	from := s.rounds
	s.mu.Unlock()
	deadline := time.Now().Add(10 * time.Second)
	for {
		s.mu.Lock()
		n, err := s.rounds, s.err
		s.mu.Unlock()
		switch {
		case err != nil:
			t.Fatalf("%s: the TCP stream broke: %v", step, err)
		case n >= from+3:
			return
		case time.Now().After(deadline):
			t.Fatalf("%s: the TCP stream made %d rounds in 10s", step, n-from)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (s *echoStream) stop() {
	select {
	case <-s.stopc:
	default:
		close(s.stopc)
	}
	<-s.done
}

// TestTCAttachLifecycle attaches node1's pods and its uplink (on the tc
// path: every tc hook) in each attach mode while a TCP stream runs
// through the datapath and another tool has its own clsact filters on
// them, and checks the guarantees of both modes: a second agent on the
// pin path is refused and changes nothing; the datapath keeps
// forwarding while no agent runs; a restarted agent adopts what is
// attached and replaces its programs in place (the stream goes on, and
// no flow is balanced again); attaching again with the same programs
// changes nothing; another tool's filter at topolb's place is never
// replaced; Detach and Attached work, and another tool's filters and
// qdisc survive all of it.
func TestTCAttachLifecycle(t *testing.T) {
	requirePrivileges(t)
	inEachTCAttach(t, testTCAttachLifecycle)
}

func testTCAttachLifecycle(t *testing.T, mode TCAttach) {
	tb := newTestbed(t)
	pin := filepath.Join(bpffs(t), "topolb")
	opts := Options{PinPath: pin, NetNS: tb.node1.Path, UplinkPath: UplinkTC, TCAttach: mode,
		MaxFrontends: 1024, MaxBackends: 4096, MaxConntrack: 4096}
	foreign := []*foreignFilter{
		{ifname: "hc", parent: netlink.HANDLE_MIN_INGRESS, prio: 49152, handle: 1, name: "other_tool_in"},
		{ifname: "hc", parent: netlink.HANDLE_MIN_EGRESS, prio: 49152, handle: 1, name: "other_tool_out"},
		{ifname: "w1", parent: netlink.HANDLE_MIN_INGRESS, prio: 2, handle: 1, name: "other_tool_in"},
	}
	for _, f := range foreign {
		addForeignFilter(t, tb.node1, f)
	}
	// hb2 has another tool's filter exactly where topolb's goes.
	squatter := &foreignFilter{ifname: "hb2", parent: netlink.HANDLE_MIN_INGRESS, prio: tcFilterPriority, handle: tcFilterHandle, name: "other_tool"}
	addForeignFilter(t, tb.node1, squatter)
	checkForeign := func(step string) {
		t.Helper()
		for _, f := range append(foreign, squatter) {
			f.present(t, tb.node1, step)
		}
	}
	pods := []string{"hc", "hb1"}
	attachAll := func(d *Datapath) {
		t.Helper()
		for _, ifname := range pods {
			must(t, d.AttachPod(ifname))
		}
		must(t, d.AttachUplink("w1"))
	}
	checkPrograms := func(d *Datapath, step string) {
		t.Helper()
		for _, ifname := range append(slices.Clone(pods), "w1") {
			if got, want := hookPrograms(t, d, tb.node1, ifname), wantPrograms(t, d, ifname == "w1"); !slices.Equal(got, want) {
				t.Errorf("%s: %s runs %v, want %v", step, ifname, got, want)
			}
			filters, want := topolbFilters(t, tb.node1, ifname), 0
			if mode == TCAttachTC {
				want = 2
			}
			if len(filters) != want {
				t.Errorf("%s: %s has topolb filters %v in mode %s", step, ifname, filters, mode)
			}
		}
		if got, err := d.Attached(); err != nil || !slices.Equal(got, []string{"hb1", "hc", "w1"}) {
			t.Errorf("%s: Attached = %v, %v", step, got, err)
		}
	}

	d1, err := Load(opts)
	must(t, err)
	t.Cleanup(func() {
		// Whatever the test left: the pins of this run.
		if d, err := Load(opts); err == nil {
			if err := d.Unpin(); err != nil {
				t.Errorf("Unpin: %v", err)
			}
			d.Close()
		}
	})
	if got := tcxFeature(t, d1).Path; got != string(mode) {
		t.Errorf("tcx links path %q, want %q", got, mode)
	}
	attachAll(d1)
	switch err := d1.AttachPod("hb2"); {
	case mode == TCAttachTCX:
		// A tcx link goes beside any filter; the filter must stay.
		must(t, err)
		must(t, d1.Detach("hb2"))
	case err == nil || !strings.Contains(err.Error(), `"other_tool"`):
		t.Errorf("AttachPod(hb2) over another tool's filter at topolb's place: %v, want an error naming it", err)
	}
	checkPrograms(d1, "attach")
	checkForeign("attach")

	// The backend is b1: hb2, b2's veth, has no topolb program here.
	serveEcho(t, tb.b1, ":7000")
	vip := fe("10.96.0.10:7000", TCP)
	mustSet(t, d1, vip, be("10.1.1.2:7000"))
	s := startEcho(t, tb.client, vip.Addr.String())
	s.alive(t, "attach")
	before, err := d1.Counters()
	must(t, err)

	if d, err := Load(opts); !errors.Is(err, ErrLocked) {
		if d != nil {
			d.Close()
		}
		t.Fatalf("second agent on the pin path: %v, want ErrLocked", err)
	}
	checkPrograms(d1, "second agent refused")

	must(t, d1.Close())
	s.alive(t, "no agent")

	d2, err := Load(opts)
	must(t, err)
	defer func() { d2.Close() }()
	attachAll(d2)
	s.alive(t, "restart")
	checkPrograms(d2, "restart")
	attachAll(d2)
	checkPrograms(d2, "attached again")
	checkForeign("restart")
	after, err := d2.Counters()
	must(t, err)
	if n := after.Stats[StatConntrackCreated] - before.Stats[StatConntrackCreated]; n != 0 {
		t.Errorf("%d flows created across the restart: the stream was balanced again instead of found in conntrack", n)
	}
	if n := after.Frontends[vip].Packets - before.Frontends[vip].Packets; n == 0 {
		t.Error("the stream's packets after the restart did not go through the datapath")
	}

	// The other mode takes over on the same kernel: the stream goes on.
	other := map[TCAttach]TCAttach{TCAttachTC: TCAttachTCX, TCAttachTCX: TCAttachTC}[mode]
	if tcx, err := probeTCX(); err == nil && tcx {
		must(t, d2.Close())
		o := opts
		o.TCAttach = other
		d3, err := Load(o)
		must(t, err)
		attachAll(d3)
		s.alive(t, "switch to "+string(other))
		for _, ifname := range append(slices.Clone(pods), "w1") {
			if got, want := hookPrograms(t, d3, tb.node1, ifname), wantPrograms(t, d3, ifname == "w1"); !slices.Equal(got, want) {
				t.Errorf("switch to %s: %s runs %v, want %v", other, ifname, got, want)
			}
		}
		must(t, d3.Close())
		d2, err = Load(opts)
		must(t, err)
		attachAll(d2)
		s.alive(t, "switch back to "+string(mode))
		checkPrograms(d2, "switch back")
	}

	s.stop()
	for _, ifname := range append(slices.Clone(pods), "w1") {
		must(t, d2.Detach(ifname))
		if got := topolbFilters(t, tb.node1, ifname); len(got) != 0 {
			t.Errorf("detach %s: topolb filters %v left", ifname, got)
		}
	}
	if got, err := d2.Attached(); err != nil || len(got) != 0 {
		t.Errorf("Attached after Detach = %v, %v", got, err)
	}
	must(t, d2.Detach("hc")) // again: nothing to do
	checkForeign("detach")

	// A pod veth deleted before Detach: its entry in tlb_ifaces goes.
	must(t, nettest.Veth(tb.node1, "hgone", tb.b2, "eth1"))
	must(t, d2.AttachPod("hgone"))
	nl := tb.node1.Netlink()
	l, err := nl.LinkByName("hgone")
	must(t, err)
	var v tcIfaceValue
	if err := d2.ifaces.Lookup(uint32(l.Attrs().Index), &v); err != nil {
		t.Fatalf("hgone attached but not in tlb_ifaces: %v", err)
	}
	must(t, nl.LinkDel(l))
	must(t, d2.Detach("hgone"))
	if err := d2.ifaces.Lookup(uint32(l.Attrs().Index), &v); !errors.Is(err, ebpf.ErrKeyNotExist) {
		t.Errorf("hgone deleted, then detached: tlb_ifaces lookup %v, want ErrKeyNotExist", err)
	}
	if got, err := d2.Attached(); err != nil || len(got) != 0 {
		t.Errorf("Attached after hgone's Detach = %v, %v", got, err)
	}
}
