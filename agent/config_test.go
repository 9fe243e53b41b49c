package agent_test

import (
	"strings"
	"testing"

	"github.com/shunt-project/shunt/agent"
)

// A configuration path that names a device or an endless file is refused
// once past agent.MaxConfigSize, not read into memory (the agent's config
// and policy.file grew without bound before).
func TestEndlessConfigRefused(t *testing.T) {
	_, err := agent.LoadConfig("/dev/zero", agent.ConfigEnv{CgroupRoot: "/sys/fs/cgroup"})
	if err == nil || !strings.Contains(err.Error(), "config /dev/zero: more than 1 MiB") {
		t.Fatalf("LoadConfig(/dev/zero): %v", err)
	}
}
