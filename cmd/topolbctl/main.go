// Command topolbctl is the operator CLI of topolb: it explains routing
// decisions, simulates the EndpointSlice controller's hints, and shows the
// agent's live state.
package main

import (
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/spf13/cobra"

	"github.com/topolb/topolb/internal/logging"
)

// exitError carries a process exit code through cobra.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

// usageError marks bad input: exit code 2.
func usageError(err error) error { return &exitError{code: 2, err: err} }

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// run executes topolbctl with args, writing output to stdout and warnings
// and errors to stderr, and returns the process exit code: 0 on success, 2
// for bad input (usage errors, malformed manifests), 1 otherwise. Tests call
// it in-process.
func run(args []string, stdout, stderr io.Writer) int {
	root := newRootCommand()
	if args == nil {
		args = []string{} // cobra reads os.Args when args is nil
	}
	root.SetArgs(args)
	root.SetOut(stdout)
	root.SetErr(stderr)
	if err := root.Execute(); err != nil {
		fmt.Fprintln(stderr, "error:", err)
		var ee *exitError
		if errors.As(err, &ee) {
			return ee.code
		}
		return 1
	}
	return 0
}

func newRootCommand() *cobra.Command {
	root := &cobra.Command{
		Use:           "topolbctl",
		Short:         "Explain and inspect topolb's topology-aware load balancing",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError(err) })
	logs := logging.AddFlags(root.PersistentFlags())
	root.PersistentFlags().Lookup("v").Usage = "log verbosity, klog's as in Kubernetes components and kubectl (6 and up: the API requests)"
	root.PersistentPreRunE = func(*cobra.Command, []string) error {
		if _, err := logs.Apply(); err != nil {
			return usageError(err)
		}
		return nil
	}
	root.AddCommand(newExplainCommand())
	for _, add := range extraCommands {
		root.AddCommand(add())
	}
	return root
}

// extraCommands are registered by other files of this package.
var extraCommands []func() *cobra.Command
