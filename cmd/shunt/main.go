// Command shunt makes in-kernel socket redirection (SOCKMAP) something you
// can simply turn on. See README.md.
package main

import (
	"os"

	"github.com/shunt-project/shunt/bench"
)

func main() {
	bench.MaybeRunReapHolder()
	os.Exit(run(os.Args[1:], defaultEnv()))
}
