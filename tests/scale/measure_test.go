package scale

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// countingProxy forwards TCP connections from its listener to the
// apiserver and counts the bytes the apiserver sends back: one per client
// process, so the bytes a watcher receives are told apart without the
// apiserver's help (its metrics are per resource, not per client). TLS
// passes through untouched; the count is of TLS records, a few percent
// above the payload.
type countingProxy struct {
	ln       net.Listener
	upstream string
	down     atomic.Int64 // bytes from the apiserver to the client
	wg       sync.WaitGroup
	mu       sync.Mutex
	conns    []net.Conn
}

// newCountingProxy serves on ln, forwarding to upstream (host:port).
func newCountingProxy(ln net.Listener, upstream string) *countingProxy {
	p := &countingProxy{ln: ln, upstream: upstream}
	p.wg.Add(1)
	go p.accept()
	return p
}

// Addr is the address clients dial.
func (p *countingProxy) Addr() string { return p.ln.Addr().String() }

func (p *countingProxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		u, err := net.Dial("tcp", p.upstream)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, c, u)
		p.mu.Unlock()
		p.wg.Add(2)
		go func() {
			defer p.wg.Done()
			_, _ = io.Copy(u, c)
			closeWrite(u)
		}()
		go func() {
			defer p.wg.Done()
			_, _ = io.Copy(countingWriter{c, &p.down}, u)
			closeWrite(c)
		}()
	}
}

func closeWrite(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.CloseWrite()
		return
	}
	_ = c.Close()
}

// Close stops the listener and every forwarded connection.
func (p *countingProxy) Close() {
	p.ln.Close()
	p.mu.Lock()
	for _, c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

type countingWriter struct {
	w io.Writer
	n *atomic.Int64
}

func (c countingWriter) Write(b []byte) (int, error) {
	n, err := c.w.Write(b)
	c.n.Add(int64(n))
	return n, err
}

// sample is one metric line: its labels and value.
type sample struct {
	labels map[string]string
	value  float64
}

// metrics are the samples of a Prometheus text exposition, by name.
type metrics map[string][]sample

// parseMetrics reads the text format: comments skipped, one sample a line
// (name{label="value",...} value [timestamp]).
func parseMetrics(r io.Reader) (metrics, error) {
	out := metrics{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		name, rest := line, ""
		labels := map[string]string{}
		if i := strings.IndexByte(line, '{'); i >= 0 {
			j := strings.LastIndexByte(line, '}')
			if j < i {
				return nil, fmt.Errorf("metric line %q: unbalanced braces", line)
			}
			name, rest = line[:i], line[j+1:]
			for _, kv := range splitLabels(line[i+1 : j]) {
				k, v, ok := strings.Cut(kv, "=")
				if !ok {
					return nil, fmt.Errorf("metric line %q: label %q", line, kv)
				}
				labels[k] = strings.Trim(v, `"`)
			}
		} else if i := strings.IndexByte(line, ' '); i >= 0 {
			name, rest = line[:i], line[i:]
		}
		fields := strings.Fields(rest)
		if len(fields) == 0 {
			return nil, fmt.Errorf("metric line %q: no value", line)
		}
		v, err := strconv.ParseFloat(fields[0], 64)
		if err != nil {
			return nil, fmt.Errorf("metric line %q: %w", line, err)
		}
		out[name] = append(out[name], sample{labels, v})
	}
	return out, sc.Err()
}

// splitLabels splits `a="x",b="y,z"` at the commas outside quotes.
func splitLabels(s string) []string {
	var out []string
	inQuote, start := false, 0
	for i := 0; i < len(s); i++ {
		switch {
		case s[i] == '\\':
			i++
		case s[i] == '"':
			inQuote = !inQuote
		case s[i] == ',' && !inQuote:
			out = append(out, s[start:i])
			start = i + 1
		}
	}
	if start < len(s) {
		out = append(out, s[start:])
	}
	return out
}

// sum adds the samples of name whose labels hold every pair of match.
func (m metrics) sum(name string, match map[string]string) float64 {
	total := 0.0
	for _, s := range m[name] {
		if matches(s.labels, match) {
			total += s.value
		}
	}
	return total
}

// by adds the samples of name per value of label.
func (m metrics) by(name, label string) map[string]float64 {
	out := map[string]float64{}
	for _, s := range m[name] {
		out[s.labels[label]] += s.value
	}
	return out
}

func matches(labels, match map[string]string) bool {
	for k, v := range match {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// histogram is a cumulative Prometheus histogram: counts by upper bound.
type histogram map[float64]float64

// histogram returns name's buckets (name_bucket, summed over other labels).
func (m metrics) histogram(name string) histogram {
	h := histogram{}
	for _, s := range m[name+"_bucket"] {
		le, err := strconv.ParseFloat(s.labels["le"], 64)
		if err != nil {
			continue
		}
		h[le] += s.value
	}
	return h
}

// minus returns the observations made between before and h.
func (h histogram) minus(before histogram) histogram {
	out := histogram{}
	for le, n := range h {
		out[le] = n - before[le]
	}
	return out
}

// quantile interpolates the q-quantile linearly inside its bucket, as
// Prometheus' histogram_quantile does; NaN without observations.
func (h histogram) quantile(q float64) float64 {
	bounds := make([]float64, 0, len(h))
	for le := range h {
		bounds = append(bounds, le)
	}
	sort.Float64s(bounds)
	if len(bounds) == 0 || h[bounds[len(bounds)-1]] == 0 {
		return math.NaN()
	}
	total := h[bounds[len(bounds)-1]]
	rank := q * total
	prevBound, prevCount := 0.0, 0.0
	for _, le := range bounds {
		if h[le] >= rank {
			if math.IsInf(le, 1) {
				return prevBound // beyond the last bound: its lower edge
			}
			if h[le] == prevCount {
				return le
			}
			return prevBound + (le-prevBound)*(rank-prevCount)/(h[le]-prevCount)
		}
		prevBound, prevCount = le, h[le]
	}
	return prevBound
}

// scrape GETs url's /metrics with client.
func scrape(ctx context.Context, client *http.Client, url string) (metrics, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("scrape %s: %w", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("scrape %s: %s", url, resp.Status)
	}
	m, err := parseMetrics(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("scrape %s: %w", url, err)
	}
	return m, nil
}

// procStat is one process's CPU time so far and resident memory now.
type procStat struct {
	cpu time.Duration // user + system
	rss int64         // bytes
}

// clockTicks is USER_HZ, the unit of /proc/PID/stat's times: 100 on
// every Linux architecture Go supports.
const clockTicks = 100

// readProc reads pid's CPU time (/proc/PID/stat: utime and stime, fields
// 14 and 15) and RSS (/proc/PID/status: VmRSS).
func readProc(pid int) (procStat, error) {
	var st procStat
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return st, fmt.Errorf("read cpu time of %d: %w", pid, err)
	}
	// The command name (field 2) may hold spaces: count from after it.
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return st, fmt.Errorf("parse /proc/%d/stat: no command name", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return st, fmt.Errorf("parse /proc/%d/stat: %d fields", pid, len(f))
	}
	utime, err1 := strconv.ParseInt(f[11], 10, 64) // field 14
	stime, err2 := strconv.ParseInt(f[12], 10, 64) // field 15
	if err := errors.Join(err1, err2); err != nil {
		return st, fmt.Errorf("parse /proc/%d/stat: %w", pid, err)
	}
	st.cpu = time.Duration(utime+stime) * time.Second / clockTicks
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return st, fmt.Errorf("read rss of %d: %w", pid, err)
	}
	for _, line := range strings.Split(string(status), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			if err != nil {
				return st, fmt.Errorf("parse VmRSS of %d: %w", pid, err)
			}
			st.rss = kb << 10
			return st, nil
		}
	}
	return st, fmt.Errorf("no VmRSS for %d", pid)
}
