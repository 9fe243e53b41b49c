// Command shunt makes in-kernel socket redirection (SOCKMAP) something you
// can simply turn on. See README.md.
package main

import "os"

func main() {
	os.Exit(run(os.Args[1:], defaultEnv()))
}
