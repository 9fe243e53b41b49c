// Package lab builds throwaway network setups on this host: named network
// namespaces joined by veth, and cgroups to run socket owners in. The
// benchmarks, the demo and the tests (through testenv) use it; everything it
// makes has a caller-chosen prefix and a Close that removes it.
package lab

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os/exec"
	"strings"
)

// Name returns prefix followed by random hex, e.g. shunt-test-1a2b3c4d.
func Name(prefix string) string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

func ip(args ...string) error {
	out, err := exec.Command("ip", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}
