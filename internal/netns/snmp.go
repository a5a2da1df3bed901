package netns

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"strconv"
	"strings"
)

// SNMP holds the counters of /proc/net/snmp by protocol ("Ip", "Tcp",
// "Udp", ...) and counter name ("InCsumErrors", "NoPorts", ...), and
// IPv6's of /proc/net/snmp6 the same way ("Udp6" "NoPorts" for
// Udp6NoPorts). TCP's counters are both families' (Tcp); UDP has one set
// per family (Udp, Udp6).
type SNMP map[string]map[string]uint64

// ParseSNMP reads the header/value line pairs of /proc/net/snmp. A value
// line without a header line before it, a header and value line of
// different lengths, or a value that is not a number is an error.
func ParseSNMP(r io.Reader) (SNMP, error) {
	out := SNMP{}
	sc := bufio.NewScanner(r)
	var header []string
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) == 0 {
			continue
		}
		if header == nil || header[0] != fields[0] {
			header = fields
			continue
		}
		proto := strings.TrimSuffix(fields[0], ":")
		if len(fields) != len(header) {
			return nil, fmt.Errorf("snmp %s: %d values for %d names", proto, len(fields)-1, len(header)-1)
		}
		m := make(map[string]uint64, len(fields)-1)
		for i := 1; i < len(fields); i++ {
			// Most counters are unsigned; a few (Tcp MaxConn) are -1.
			v, err := strconv.ParseInt(fields[i], 10, 64)
			if err != nil {
				return nil, fmt.Errorf("snmp %s %s: %w", proto, header[i], err)
			}
			m[header[i]] = uint64(v)
		}
		out[proto] = m
		header = nil
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read snmp: %w", err)
	}
	return out, nil
}

// ParseSNMP6 reads the "name value" lines of /proc/net/snmp6, each
// name a protocol up to its first "6" and a counter ("Udp6NoPorts" is
// Udp6 NoPorts). A line of another shape or a value that is not a number
// is an error.
func ParseSNMP6(r io.Reader) (SNMP, error) {
	out := SNMP{}
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) == 0 {
			continue
		}
		i := strings.IndexByte(fields[0], '6')
		if len(fields) != 2 || i < 1 || i == len(fields[0])-1 {
			return nil, fmt.Errorf("snmp6: line %q: want a protocol's counter and its value", sc.Text())
		}
		proto, name := fields[0][:i+1], fields[0][i+1:]
		v, err := strconv.ParseUint(fields[1], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("snmp6 %s %s: %w", proto, name, err)
		}
		if out[proto] == nil {
			out[proto] = map[string]uint64{}
		}
		out[proto][name] = v
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read snmp6: %w", err)
	}
	return out, nil
}

// Counter returns one counter; a missing one is an error, never 0.
func (s SNMP) Counter(proto, name string) (uint64, error) {
	v, ok := s[proto][name]
	if !ok {
		return 0, fmt.Errorf("snmp has no counter %s %s", proto, name)
	}
	return v, nil
}

// SNMP reads /proc/net/snmp and /proc/net/snmp6 as seen from inside the
// namespace (without snmp6 on a kernel without IPv6).
func (ns *NS) SNMP() (SNMP, error) {
	var s SNMP
	err := ns.Do(func() error {
		// thread-self, not self: the namespace is the calling thread's.
		var err error
		if s, err = parseFile("/proc/thread-self/net/snmp", ParseSNMP); err != nil {
			return err
		}
		s6, err := parseFile("/proc/thread-self/net/snmp6", ParseSNMP6)
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		maps.Copy(s, s6)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("%s: read snmp counters: %w", ns.Name, err)
	}
	return s, nil
}

// parseFile parses the file at path with parse.
func parseFile(path string, parse func(io.Reader) (SNMP, error)) (SNMP, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return parse(f)
}

// counter reads one SNMP counter of the namespace.
func (ns *NS) counter(proto, name string) (uint64, error) {
	s, err := ns.SNMP()
	if err != nil {
		return 0, err
	}
	v, err := s.Counter(proto, name)
	if err != nil {
		return 0, fmt.Errorf("%s: %w", ns.Name, err)
	}
	return v, nil
}

// ChecksumErrors are a namespace's receive checksum error counters, as
// `nstat` shows them (Udp InCsumErrors, Udp6InCsumErrors, Tcp
// InCsumErrors, the last of both families). A datapath that writes a
// wrong checksum makes them grow when the senders on its path have
// transmit checksum offload off.
type ChecksumErrors struct {
	UDP uint64
	// UDP6 is IPv6's (0 on a kernel without IPv6).
	UDP6 uint64
	TCP  uint64
}

// ChecksumErrors reads the namespace's receive checksum error counters.
func (ns *NS) ChecksumErrors() (ChecksumErrors, error) {
	s, err := ns.SNMP()
	if err != nil {
		return ChecksumErrors{}, err
	}
	var c ChecksumErrors
	if c.UDP, err = s.Counter("Udp", "InCsumErrors"); err != nil {
		return ChecksumErrors{}, fmt.Errorf("%s: %w", ns.Name, err)
	}
	if c.TCP, err = s.Counter("Tcp", "InCsumErrors"); err != nil {
		return ChecksumErrors{}, fmt.Errorf("%s: %w", ns.Name, err)
	}
	if _, ipv6 := s["Udp6"]; ipv6 {
		if c.UDP6, err = s.Counter("Udp6", "InCsumErrors"); err != nil {
			return ChecksumErrors{}, fmt.Errorf("%s: %w", ns.Name, err)
		}
	}
	return c, nil
}

// UDPNoPorts reads the namespace's Udp NoPorts counter: datagrams that
// arrived for a port nothing listens on.
func (ns *NS) UDPNoPorts() (uint64, error) { return ns.counter("Udp", "NoPorts") }

// UDPNoPortsOfBoth is UDPNoPorts over both families: Udp NoPorts plus
// Udp6NoPorts (the first alone on a kernel without IPv6).
func (ns *NS) UDPNoPortsOfBoth() (uint64, error) {
	s, err := ns.SNMP()
	if err != nil {
		return 0, err
	}
	n, err := s.Counter("Udp", "NoPorts")
	if err != nil {
		return 0, fmt.Errorf("%s: %w", ns.Name, err)
	}
	if _, ipv6 := s["Udp6"]; !ipv6 {
		return n, nil
	}
	n6, err := s.Counter("Udp6", "NoPorts")
	if err != nil {
		return 0, fmt.Errorf("%s: %w", ns.Name, err)
	}
	return n + n6, nil
}

// Growth returns after - before for a counter read twice. A counter that
// went down (it wrapped, or the two reads are of different namespaces) is
// an error, never a huge unsigned difference.
func Growth(before, after uint64) (uint64, error) {
	if after < before {
		return 0, fmt.Errorf("counter went down from %d to %d", before, after)
	}
	return after - before, nil
}
