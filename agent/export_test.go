package agent

import "github.com/shunt-project/shunt/bypass"

// WithGuardCheck is o with the guard's check before it starts (guard.Check)
// replaced by check.
func WithGuardCheck(o Options, check func(*bypass.Install) error) Options {
	o.checkGuard = check
	return o
}
