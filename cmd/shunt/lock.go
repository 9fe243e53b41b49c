package main

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/shunt-project/shunt/internal/runlock"
)

// installLockWait bounds how long a command waits for another one that
// changes the same install.
const installLockWait = 30 * time.Second

// lockInstall serializes the commands that change the install at pinDir
// (enable, disable, forget), so two users of one machine cannot interleave
// them.
func lockInstall(e *env, pinDir string) (release func(), err error) {
	release, err = runlock.Lock("install", pinDir, installLockWait, func() {
		fmt.Fprintf(e.stderr, "shunt: waiting for another shunt command changing %s\n", pinDir)
	})
	if errors.Is(err, runlock.ErrHeld) {
		who := "another shunt command"
		if h := runlock.Holders("install", pinDir); len(h) > 0 {
			who = strings.Join(h, ", ")
		}
		return nil, fmt.Errorf("%s has held the lock on %s for %v (%s): try again when it is done", who, pinDir, installLockWait, runlock.Path("install", pinDir))
	}
	return release, err
}
