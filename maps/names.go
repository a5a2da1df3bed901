package maps

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// tlb_names records, per frontend, the name of what it serves as the
// caller gave it (Service.Name; the agent: the Service port), so that a
// reader of the pinned maps (OpenPinned, `topolbctl maps`) can name
// frontends while no agent runs. No program reads it: user space creates
// it beside the shared maps, outside the layout fingerprint, and replaces a
// pinned one of another shape (names are derived; the agent writes them
// again). It holds at most one entry per frontend (MaxFrontends), allocated
// as used (BPF_F_NO_PREALLOC), under the frontend's tlb_services key.

// namesMap is the pin name of the names record.
const namesMap = "tlb_names"

// MaxNameLen bounds Service.Name: a Kubernetes namespace and name (63
// bytes each) and a port name (15) with their separators fit.
const MaxNameLen = 159

// nameValue is a tlb_names value: the name, NUL-padded.
type nameValue struct {
	Name [MaxNameLen + 1]byte
}

// namesSpec is tlb_names for a datapath of maxFrontends frontends.
func namesSpec(maxFrontends uint32) *ebpf.MapSpec {
	return &ebpf.MapSpec{
		Name: namesMap, Type: ebpf.Hash, KeySize: uint32(binary.Size(tcSvcKey{})), ValueSize: MaxNameLen + 1,
		MaxEntries: maxFrontends, Flags: unix.BPF_F_NO_PREALLOC, Pinning: ebpf.PinByName,
	}
}

// loadNames opens the names record pinned at pinPath, creating and
// pinning it when there is none, and replacing one of another shape.
func loadNames(pinPath string, maxFrontends uint32) (*ebpf.Map, error) {
	spec := namesSpec(maxFrontends)
	opts := ebpf.MapOptions{PinPath: pinPath}
	m, err := ebpf.NewMapWithOptions(spec, opts)
	if errors.Is(err, ebpf.ErrMapIncompatible) {
		if rerr := os.Remove(filepath.Join(pinPath, namesMap)); rerr != nil {
			return nil, fmt.Errorf("replace %s of another shape: %w", namesMap, rerr)
		}
		m, err = ebpf.NewMapWithOptions(spec, opts)
	}
	if err != nil {
		return nil, fmt.Errorf("load %s: %w", namesMap, err)
	}
	return m, nil
}

// encodeName validates a Service.Name and converts it to its value.
func encodeName(name string) (nameValue, error) {
	var v nameValue
	switch {
	case len(name) > MaxNameLen:
		return v, fmt.Errorf("name %.40q...: longer than %d bytes", name, MaxNameLen)
	case strings.IndexByte(name, 0) >= 0:
		return v, fmt.Errorf("name %q: contains NUL", name)
	}
	copy(v.Name[:], name)
	return v, nil
}

// decodeName is the inverse of encodeName.
func decodeName(v nameValue) string {
	s := string(v.Name[:])
	if i := strings.IndexByte(s, 0); i >= 0 {
		s = s[:i]
	}
	return s
}

// putName records s's name, or deletes the record when the name is
// empty; nothing is written when the record already says name.
func (t *txn) putName(s *service, name string) error {
	if s.name == name {
		return nil
	}
	var err error
	if name == "" {
		err = t.del(t.d.names, "names", s.key)
	} else {
		var v nameValue
		if v, err = encodeName(name); err == nil {
			err = t.put(t.d.names, "names", s.key, v)
		}
	}
	if err != nil {
		return fmt.Errorf("record the name of %s: %w", s.fe, err)
	}
	s.name = name
	return nil
}

// readNames reads every name of a tlb_names map.
func readNames(m *ebpf.Map) (map[tcSvcKey]string, error) {
	out := map[tcSvcKey]string{}
	var (
		k tcSvcKey
		v nameValue
	)
	it := m.Iterate()
	for it.Next(&k, &v) {
		out[k] = decodeName(v)
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read %s: %w", namesMap, err)
	}
	return out, nil
}

// adoptNames gives the adopted frontends their recorded names and
// deletes the records of frontends that are gone.
func (d *Datapath) adoptNames(t *txn) error {
	names, err := readNames(d.names)
	if err != nil {
		return err
	}
	for key, name := range names {
		if s := d.fes[frontend(key)]; s != nil {
			s.name = name
			continue
		}
		if err := t.del(d.names, "names", key); err != nil {
			return err
		}
	}
	return nil
}
