package main

import (
	"errors"
	"fmt"
	"os"

	"github.com/spf13/cobra"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/host"
)

func newBypassForgetCmd(e *env, g *globals) *cobra.Command {
	var all bool
	c := &cobra.Command{
		Use:   "forget COMMAND | --all",
		Short: "Let readers of a program seen splicing be bypassed again",
		Long: `shunt keeps the readers of every program it has seen calling splice(2)
on a TCP socket on TCP from their first recv ('shunt status' lists them,
and what was learned outlives 'bypass disable --all'). forget drops one
program, by the command name status shows, or all of them, with or without
an install. With --all and no install at --pin-dir, the pinned map of what
was learned is removed too: nothing of shunt is left pinned.`,
		Example: `  shunt bypass forget haproxy
  shunt bypass forget --all`,
		RunE: func(c *cobra.Command, args []string) error {
			if all == (len(args) == 1) || len(args) > 1 {
				return usageError{fmt.Errorf("give one command name or --all (see '%s --help')", c.CommandPath())}
			}
			if err := host.CheckPrivileges(); err != nil {
				return err
			}
			release, err := lockInstall(e, g.pinDir)
			if err != nil {
				return err
			}
			defer release()
			name := ""
			if !all {
				name = args[0]
			}
			n, err := bypass.ForgetAt(g.pinDir, name)
			if errors.Is(err, bypass.ErrUnknownProgram) {
				return usageError{err}
			}
			if err != nil {
				return err
			}
			fmt.Fprintf(e.stdout, "forgot %d program(s): their new connections may be bypassed again\n", n)
			if !all {
				return nil
			}
			// With no install left to use it, the learned map goes too.
			if _, err := os.Stat(bypass.LearnedDir(g.pinDir)); err != nil {
				return nil
			}
			if in, err := bypass.Open(g.pinDir); !errors.Is(err, bypass.ErrNotInstalled) {
				if err == nil {
					in.Close()
				}
				return nil // an install uses it: emptied, it stays
			}
			if err := bypass.RemoveLearned(g.pinDir, false); err != nil {
				return fmt.Errorf("remove %s: %w", bypass.LearnedDir(g.pinDir), err)
			}
			fmt.Fprintf(e.stdout, "removed %s: no install uses it\n", bypass.LearnedDir(g.pinDir))
			return nil
		},
	}
	c.Flags().BoolVar(&all, "all", false, "forget every program")
	return c
}
