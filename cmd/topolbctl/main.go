// Command topolbctl is the operator CLI of topolb: it explains routing
// decisions, simulates the EndpointSlice controller's hints, and shows the
// agent's live state.
package main

import (
	"errors"
	"fmt"
	"os"

	"github.com/spf13/cobra"
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
	root := newRootCommand()
	if err := root.Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		var ee *exitError
		if errors.As(err, &ee) {
			os.Exit(ee.code)
		}
		os.Exit(1)
	}
}

func newRootCommand() *cobra.Command {
	root := &cobra.Command{
		Use:           "topolbctl",
		Short:         "Explain and inspect topolb's topology-aware load balancing",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(newExplainCommand())
	for _, add := range extraCommands {
		root.AddCommand(add())
	}
	return root
}

// extraCommands are registered by other files of this package.
var extraCommands []func() *cobra.Command
