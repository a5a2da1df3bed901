// Package childproc starts the processes tests run (agents, apiservers,
// kube-proxies) so that they never outlive the test binary.
package childproc

import (
	"os/exec"
	"runtime"
	"syscall"
)

// Child is a started command. Its Wait replaces exec.Cmd's: the command is
// waited for on the thread that started it (see Start), and Wait returns
// that result, to any number of callers.
type Child struct {
	*exec.Cmd
	done chan struct{}
	err  error
}

// Start starts cmd with SIGKILL as its parent-death signal, keeping the
// other fields of cmd.SysProcAttr.
//
// The kernel sends the parent-death signal when the thread that forked the
// child exits, not when the process does, and the Go runtime retires a
// thread when a goroutine locked to it (a setns into a test namespace)
// returns without unlocking: a child started from an arbitrary goroutine
// can be killed at any moment, before it wrote a line. So the child is
// started and waited for by a goroutine locked to its own thread, which
// lives exactly as long as the child.
func Start(cmd *exec.Cmd) (*Child, error) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
	c := &Child{Cmd: cmd, done: make(chan struct{})}
	started := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		defer close(c.done)
		if err := cmd.Start(); err != nil {
			c.err = err
			started <- err
			return
		}
		started <- nil
		c.err = cmd.Wait()
	}()
	if err := <-started; err != nil {
		return nil, err
	}
	return c, nil
}

// Exited reports whether the child has exited (and Wait would return at
// once).
func (c *Child) Exited() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

// Wait waits for the child to exit and returns exec.Cmd.Wait's result.
func (c *Child) Wait() error {
	<-c.done
	return c.err
}

// Done is closed when the child has exited.
func (c *Child) Done() <-chan struct{} { return c.done }

// Run starts cmd as Start does and waits for it.
func Run(cmd *exec.Cmd) error {
	c, err := Start(cmd)
	if err != nil {
		return err
	}
	return c.Wait()
}
