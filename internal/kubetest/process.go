package kubetest

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"

	"github.com/topolb/topolb/internal/childproc"
)

// process is one child (etcd or kube-apiserver) whose output goes to a log
// file. It is killed if the Go program dies without stopping it.
type process struct {
	name    string
	logPath string
	logFrom int64 // size of the log when this run started
	cmd     *exec.Cmd
	done    chan struct{} // closed once the child has exited
	err     error         // the child's exit status; valid after done
}

// startProcess starts bin with args, appending its output to logPath.
func startProcess(name, bin string, args []string, logPath string) (*process, error) {
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open %s log: %w", name, err)
	}
	fi, err := logFile.Stat()
	if err != nil {
		logFile.Close()
		return nil, fmt.Errorf("stat %s log: %w", name, err)
	}
	p := &process{name: name, logPath: logPath, logFrom: fi.Size(), done: make(chan struct{})}
	cmd := exec.Command(bin, args...)
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	child, err := childproc.Start(cmd)
	if err != nil {
		logFile.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p.cmd = cmd
	go func() {
		p.err = child.Wait()
		logFile.Close()
		close(p.done)
	}()
	return p, nil
}

// exited reports whether the child has exited.
func (p *process) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// stop sends SIGTERM, waits up to grace for the child to exit, then kills it.
// A child that had already exited on its own is reported with its log tail.
func (p *process) stop(grace time.Duration) error {
	if p.exited() {
		if p.err != nil {
			return fmt.Errorf("%s had exited: %w\n%s", p.name, p.err, p.logTail())
		}
		return nil
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		return nil
	case <-time.After(grace):
	}
	_ = p.cmd.Process.Kill()
	<-p.done
	return nil
}

// logTail returns the last lines of the child's log, for error messages.
func (p *process) logTail() string {
	return tailFile(p.logPath, 30)
}

func tailFile(path string, lines int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	b = bytes.TrimRight(b, "\n")
	all := strings.Split(string(b), "\n")
	if len(all) > lines {
		all = all[len(all)-lines:]
	}
	return strings.Join(all, "\n")
}

// addrInUse reports whether this run of the child logged that it could not
// bind its port.
func (p *process) addrInUse() bool {
	f, err := os.Open(p.logPath)
	if err != nil {
		return false
	}
	defer f.Close()
	b, _ := io.ReadAll(io.NewSectionReader(f, p.logFrom, 1<<30))
	return bytes.Contains(b, []byte("address already in use"))
}

// freePort returns a TCP port that was free on addr a moment ago. Callers
// retry with another port if the child then fails to bind it.
func freePort(addr netip.Addr) (uint16, error) {
	l, err := net.Listen("tcp", netip.AddrPortFrom(addr, 0).String())
	if err != nil {
		return 0, fmt.Errorf("find a free port on %s: %w", addr, err)
	}
	defer l.Close()
	ap, err := netip.ParseAddrPort(l.Addr().String())
	if err != nil {
		return 0, fmt.Errorf("find a free port on %s: %w", addr, err)
	}
	return ap.Port(), nil
}

// errExited is returned by waits when the child exits before it is ready.
var errExited = errors.New("exited before it was ready")
