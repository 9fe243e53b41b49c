package splice_test

import (
	"os"
	"testing"

	"github.com/shunt-project/shunt/internal/leakcheck"
	"github.com/shunt-project/shunt/splice"
)

func TestMain(m *testing.M) { os.Exit(leakcheck.Main(m, splice.CloseDefault)) }
