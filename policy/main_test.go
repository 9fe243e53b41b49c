package policy_test

import (
	"os"
	"testing"

	"github.com/shunt-project/shunt/internal/leakcheck"
)

func TestMain(m *testing.M) { os.Exit(leakcheck.Main(m)) }
