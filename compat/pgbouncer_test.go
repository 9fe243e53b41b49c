package compat_test

import (
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/shunt-project/shunt/internal/testenv"
)

// PgBouncer 1.18 in transaction pooling in front of PostgreSQL 15: 8 pgbench
// clients share 2 server connections, so each server connection carries
// many clients' transactions in turn (libevent, non-blocking reads on both
// sides). The balances agree and every transaction is in the history, read
// back through PgBouncer.
func TestPgBouncerInFrontOfPostgreSQL(t *testing.T) {
	bin := "/usr/lib/postgresql/15/bin"
	testenv.NeedProgram(t, bin+"/postgres")
	testenv.NeedProgram(t, "pgbouncer")
	bothWays(t, redirected, 0, func(t *testing.T, e *env) {
		pgPort, _ := startPostgres(t, e)
		port := startPgBouncer(t, e, pgPort)
		direct := []string{"-h", "127.0.0.1", "-p", pgPort, "-U", "postgres"}
		pooled := []string{"-h", "127.0.0.1", "-p", strconv.Itoa(port), "-U", "postgres"}
		e.run(t, append(append([]string{bin + "/pgbench", "-i", "-q", "-s", "1"}, direct...), "postgres")...)
		e.run(t, append(append([]string{bin + "/pgbench", "-n", "-M", "simple", "-c", "8", "-j", "2", "-t", "150"}, pooled...), "postgres")...)
		out := e.run(t, append(append([]string{bin + "/psql", "-At", "-c",
			"select (select sum(abalance) from pgbench_accounts), (select sum(tbalance) from pgbench_tellers), (select sum(bbalance) from pgbench_branches), (select sum(delta) from pgbench_history), (select count(*) from pgbench_history)"},
			pooled...), "postgres")...)
		f := strings.Split(strings.TrimSpace(out), "|")
		if len(f) != 5 || f[0] != f[1] || f[1] != f[2] || f[2] != f[3] || f[4] != "1200" {
			t.Fatalf("balances (accounts|tellers|branches|history|transactions) %q: want the four sums equal and 1200 transactions", out)
		}
	})
}

// startPgBouncer runs PgBouncer (as the postgres user, on serverCPU) in the
// env in transaction pooling, 2 server connections to the PostgreSQL at
// pgPort, and returns its port.
func startPgBouncer(t testing.TB, e *env, pgPort string) int {
	dir, pg := postgresDir(t, "shunt-test-pgbouncer-")
	port := e.freePort(t)
	writeFile(t, filepath.Join(dir, "users.txt"), []byte(`"postgres" ""`+"\n"))
	conf := filepath.Join(dir, "pgbouncer.ini")
	writeFile(t, conf, []byte(fmt.Sprintf(`[databases]
postgres = host=127.0.0.1 port=%s
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = trust
auth_file = %s
pool_mode = transaction
default_pool_size = 2
logfile = %s
`, pgPort, port, filepath.Join(dir, "users.txt"), filepath.Join(dir, "pgbouncer.log"))))
	// PgBouncer refuses to run as root.
	e.start(t, pinned(serverCPU, "setpriv", "--reuid", pg.Uid, "--regid", pg.Gid, "--clear-groups", "pgbouncer", conf)...)
	e.waitListening(t, fmt.Sprintf("127.0.0.1:%d", port))
	return port
}
