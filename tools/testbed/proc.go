package testbed

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/topolb/topolb/internal/childproc"
)

// Process is a program running in a namespace of the testbed (an agent or
// kube-proxy in a node, a server in a pod), started with `nsenter
// --net=<ns>`, which keeps the mount namespace so the bpffs stays visible
// (`ip netns exec` remounts /sys). Its output is appended to LogPath
// across restarts. The testbed stops it on Close.
type Process struct {
	// Node is the node it runs in; nil for a process in a pod.
	Node    *Node
	LogPath string

	tb     *Testbed
	ns     *NS
	where  string // the node's or pod's name, for messages
	what   string // "agent", "kube-proxy": for messages and the log name
	binary string
	args   func() []string // the command line after the binary

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{} // closed when cmd has exited
	err  error         // cmd's exit status, once done
}

func newNodeProcess(tb *Testbed, n *Node, what, binary string) *Process {
	p := newProcess(tb, n.NS, n.Name, what, binary)
	p.Node = n
	return p
}

func newProcess(tb *Testbed, ns *NS, where, what, binary string) *Process {
	return &Process{
		LogPath: filepath.Join(tb.Dir, "logs", what+"-"+where+".log"),
		tb:      tb,
		ns:      ns,
		where:   where,
		what:    what,
		binary:  binary,
	}
}

// StartProcess starts binary with args in pod's network namespace and
// returns without waiting for it to do anything. Its log is
// logs/<name>-<pod>.log in the state directory; the testbed stops it on
// Close.
func (tb *Testbed) StartProcess(ctx context.Context, pod *Pod, name, binary string, args ...string) (*Process, error) {
	if pod == nil || pod.NS == nil {
		return nil, errors.New("start process: no such pod, or the testbed is not up")
	}
	p := newProcess(tb, pod.NS, pod.Name, name, binary)
	p.args = func() []string { return args }
	tb.mu.Lock()
	closed := tb.closed
	if !closed {
		tb.processes = append(tb.processes, p)
	}
	tb.mu.Unlock()
	if closed {
		return nil, errors.New("testbed closed")
	}
	return p, p.Start(ctx)
}

// Pause stops the process with SIGSTOP: it uses no CPU until Resume, and
// what it set up (pinned programs, netfilter rules) keeps working. A
// benchmark pauses the implementations it is not measuring.
func (p *Process) Pause() error { return p.send(syscall.SIGSTOP) }

// Resume continues a paused process (SIGCONT).
func (p *Process) Resume() error { return p.send(syscall.SIGCONT) }

// send sends sig to the running process.
func (p *Process) send(sig syscall.Signal) error {
	p.mu.Lock()
	cmd := p.cmd
	p.mu.Unlock()
	if cmd == nil || !p.Running() {
		return fmt.Errorf("%s on %s is not running", p.what, p.where)
	}
	if err := cmd.Process.Signal(sig); err != nil {
		return fmt.Errorf("signal %s on %s: %w", p.what, p.where, err)
	}
	return nil
}

// Start starts the process; it must not be running.
func (p *Process) Start(ctx context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done != nil {
		select {
		case <-p.done:
		default:
			return fmt.Errorf("%s on %s is already running", p.what, p.where)
		}
	}
	logf, err := os.OpenFile(p.LogPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("%s log: %w", p.what, err)
	}
	args := p.args()
	fmt.Fprintf(logf, "==== %s start: %s %s\n", time.Now().Format(time.RFC3339Nano), p.binary, strings.Join(args, " "))
	cmd := exec.Command("nsenter", append([]string{"--net=" + p.ns.Path, p.binary}, args...)...)
	cmd.Stdout, cmd.Stderr = logf, logf
	// childproc adds the parent-death signal: never outlive the testbed's
	// process.
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Setpgid: true, // Ctrl-C reaches us, and we stop them in order
	}
	child, err := childproc.Start(cmd)
	if err != nil {
		logf.Close()
		return fmt.Errorf("start %s on %s: %w", p.what, p.where, err)
	}
	p.tb.recordPID(cmd.Process.Pid)
	done := make(chan struct{})
	p.cmd, p.done, p.err = cmd, done, nil
	go func() {
		err := child.Wait()
		logf.Close()
		p.mu.Lock()
		p.err = err
		p.mu.Unlock()
		close(done)
	}()
	p.tb.log.Debug("started", "what", p.what, "where", p.where, "pid", cmd.Process.Pid)
	return nil
}

// doneChan returns the channel closed when the current process exits, nil
// before the first Start.
func (p *Process) doneChan() chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.done
}

// Running reports whether the process is alive.
func (p *Process) Running() bool {
	done := p.doneChan()
	if done == nil {
		return false
	}
	select {
	case <-done:
		return false
	default:
		return true
	}
}

// PID returns the process id of the current (or last) process.
func (p *Process) PID() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil || p.cmd.Process == nil {
		return 0
	}
	return p.cmd.Process.Pid
}

// signal sends sig and waits up to wait for the process to exit.
func (p *Process) signal(sig syscall.Signal, wait time.Duration) (exited bool, err error) {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.mu.Unlock()
	if cmd == nil {
		return true, nil
	}
	select {
	case <-done:
		return true, nil
	default:
	}
	if err := cmd.Process.Signal(sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return false, fmt.Errorf("signal %s on %s: %w", p.what, p.where, err)
	}
	select {
	case <-done:
		return true, nil
	case <-time.After(wait):
		return false, nil
	}
}

// Stop stops the process gracefully (SIGTERM; an agent keeps its datapath
// pinned and forwarding), killing it if it has not exited within 10 s. It
// returns an error if it had to be killed. A paused process is resumed
// first, so it can act on the SIGTERM.
func (p *Process) Stop() error {
	if p.Running() {
		p.send(syscall.SIGCONT) // best effort: it may exit in between
	}
	exited, err := p.signal(syscall.SIGTERM, 10*time.Second)
	if err != nil || exited {
		return err
	}
	if _, err := p.signal(syscall.SIGKILL, 5*time.Second); err != nil {
		return err
	}
	return fmt.Errorf("%s on %s ignored SIGTERM for 10 s and was killed", p.what, p.where)
}

// Kill kills the process with SIGKILL, as a crash would, and waits for it.
func (p *Process) Kill() error {
	exited, err := p.signal(syscall.SIGKILL, 5*time.Second)
	if err == nil && !exited {
		err = fmt.Errorf("%s on %s did not die within 5 s of SIGKILL", p.what, p.where)
	}
	return err
}

// ExitError returns how the last process ended, nil while it runs.
func (p *Process) ExitError() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

// LogTail returns the last n lines of the log.
func (p *Process) LogTail(n int) string {
	f, err := os.Open(p.LogPath)
	if err != nil {
		return ""
	}
	defer f.Close()
	var lines []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		lines = append(lines, sc.Text())
		if len(lines) > n {
			lines = lines[1:]
		}
	}
	return strings.Join(lines, "\n")
}

const processPIDs = "processes.pids"

// recordPID notes the pid of a process started in a node, so RemoveStale
// can kill those a crashed run left behind.
func (tb *Testbed) recordPID(pid int) {
	f, err := os.OpenFile(filepath.Join(tb.Dir, processPIDs), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return
	}
	fmt.Fprintln(f, pid)
	f.Close()
}

// killStrayProcesses kills the recorded processes of a dead testbed whose
// command line still names its state directory (so a recycled pid is left
// alone).
func killStrayProcesses(dir string) {
	data, err := os.ReadFile(filepath.Join(dir, processPIDs))
	if err != nil {
		return
	}
	for _, line := range strings.Fields(string(data)) {
		pid, err := strconv.Atoi(line)
		if err != nil || pid <= 0 {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "cmdline"))
		if err == nil && strings.Contains(string(cmdline), dir+"/") {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}
