package compat_test

import (
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shunt-project/shunt/internal/testenv"
)

// BenchmarkPrograms measures real programs' own benchmark clients against
// their servers over plain TCP and through shunt, interleaved (plain,
// shunt, plain, shunt ...), server on CPU 1 and client on CPU 0 in every
// mode, and reports the median of each mode and their ratio. A benchmark,
// not a test: `make compat-bench` runs it (docs/COMPATIBILITY.md).
// SHUNT_COMPAT_ROUNDS sets the rounds (5); SHUNT_COMPAT_AA=1 runs plain TCP
// in both columns, an A/A run that shows how far this machine's noise
// alone moves the ratio. A program that offers a unix socket is measured
// over it too, in the same rounds: the floor a TCP bypass can approach.
func BenchmarkPrograms(b *testing.B) {
	rounds := 5
	if v, err := strconv.Atoi(os.Getenv("SHUNT_COMPAT_ROUNDS")); err == nil && v > 0 {
		rounds = v
	}
	// SHUNT_COMPAT_AA=1 runs the plain mode twice: the A/A spread.
	second := os.Getenv("SHUNT_COMPAT_AA") != "1"
	for _, p := range benchPrograms {
		b.Run(p.name, func(b *testing.B) {
			testenv.NeedProgram(b, p.needs)
			const plainMode, shuntMode, unixMode = 0, 1, 2
			modes := []int{plainMode, shuntMode}
			if p.unix != nil {
				modes = append(modes, unixMode)
			}
			var got [3][]float64
			for r := 0; r < rounds; r++ {
				order := slices.Clone(modes)
				if r%2 == 1 && p.unix != nil {
					slices.Reverse(order)
				}
				for _, m := range order {
					if m == unixMode {
						got[m] = append(got[m], p.unix(b, newEnv(b, false)))
						continue
					}
					e := newEnv(b, m == shuntMode && second)
					got[m] = append(got[m], p.run(b, e))
					if e.in != nil && r == 0 {
						// What shunt did with the program's connections.
						if st, err := e.in.Stats(); err == nil {
							c := st.Counters
							b.Logf("round 0: %d paired, %d directions kept for their reader, %d left unpaired for their port's reader, %d for their client process's, %d stalls rescued", c.Paired, c.TCPReaders, c.ReaderPort, c.ReaderClient, c.StallsRescued)
						}
					}
				}
			}
			plain, shunt := median(got[plainMode]), median(got[shuntMode])
			b.ReportMetric(plain, "plain-"+p.unit)
			b.ReportMetric(shunt, "shunt-"+p.unit)
			b.ReportMetric(shunt/plain, "ratio")
			b.Logf("| %s | %s | %s | %s | %.2f | %s | %s |", p.name, p.unit, rounded(plain), rounded(shunt), shunt/plain, rounded(got[plainMode]...), rounded(got[shuntMode]...))
			if p.unix != nil {
				unix := median(got[unixMode])
				b.ReportMetric(unix, "unix-"+p.unit)
				b.ReportMetric(shunt/unix, "shunt/unix")
				b.Logf("unix socket: | %s | %s | %s | %s | %.2f | %s |", p.name, p.unit, rounded(unix), rounded(shunt), shunt/unix, rounded(got[unixMode]...))
			}
		})
	}
}

// rounded prints numbers as the tables show them: whole above 100 (rates),
// two decimals below (milliseconds).
func rounded(v ...float64) string {
	s := make([]string, len(v))
	for i, x := range v {
		prec := 0
		if x < 100 {
			prec = 2
		}
		s[i] = strconv.FormatFloat(x, 'f', prec, 64)
	}
	return strings.Join(s, " ")
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

// pinned runs argv on one CPU.
func pinned(cpu int, argv ...string) []string {
	return append([]string{"taskset", "-c", strconv.Itoa(cpu)}, argv...)
}

const serverCPU, clientCPU = 1, 0

var benchPrograms = []struct {
	name, needs, unit string
	run               func(b *testing.B, e *env) float64
	// unix, for a program that offers a unix socket: the same client and
	// server over it.
	unix func(b *testing.B, e *env) float64
}{
	{"redis-benchmark", "redis-server", "req/s", func(b *testing.B, e *env) float64 {
		return redisBenchmark(b, e, redisDirect)
	}, func(b *testing.B, e *env) float64 {
		return redisBenchmark(b, e, redisUnix)
	}},
	{"pgbench-select", "/usr/lib/postgresql/15/bin/pgbench", "tps", func(b *testing.B, e *env) float64 {
		return pgbenchSelect(b, e, false)
	}, func(b *testing.B, e *env) float64 {
		return pgbenchSelect(b, e, true)
	}},
	// The same select-only load through PgBouncer (transaction pooling, 2
	// server connections for the 8 clients), both on serverCPU.
	{"pgbouncer-pgbench-select", "pgbouncer", "tps", func(b *testing.B, e *env) float64 {
		pgPort, _ := startPostgres(b, e)
		bin := "/usr/lib/postgresql/15/bin"
		e.run(b, bin+"/pgbench", "-i", "-q", "-s", "1", "-h", "127.0.0.1", "-p", pgPort, "-U", "postgres", "postgres")
		port := strconv.Itoa(startPgBouncer(b, e, pgPort))
		out := e.run(b, pinned(clientCPU, bin+"/pgbench", "-n", "-S", "-M", "simple", "-c", "8", "-j", "1", "-T", "5", "-h", "127.0.0.1", "-p", port, "-U", "postgres", "postgres")...)
		v, _ := number(b, out, `tps = ([0-9.]+)`, "pgbench's tps")
		return v
	}, nil},
	{"nginx-wrk-1KB", "wrk", "req/s", func(b *testing.B, e *env) float64 {
		addr := nginxOriginPinned(b, e, newBlob(1<<10, 1))
		return wrkRate(b, e, "http://"+addr+"/blob", 20)
	}, nil},
	{"nginx-wrk-1MB", "wrk", "req/s", func(b *testing.B, e *env) float64 {
		addr := nginxOriginPinned(b, e, newBlob(1<<20, 1))
		return wrkRate(b, e, "http://"+addr+"/blob", 4)
	}, nil},
	{"nginx-wrk-1MB-p99", "wrk", "ms", func(b *testing.B, e *env) float64 {
		return wrkP99(b, e, nginxOriginPinned(b, e, newBlob(1<<20, 1)))
	}, nil},
	// The same with connections that last the whole run: nginx closes one
	// after 1,000 requests by default, and each new connection's first
	// response comes by TCP (docs/COMPATIBILITY.md, "The 1 MiB p99").
	{"nginx-wrk-1MB-p99-kept", "wrk", "ms", func(b *testing.B, e *env) float64 {
		return wrkP99(b, e, nginxOriginWith(b, e, newBlob(1<<20, 1), nginxSetup{sendfile: true, cpu: serverCPU, keepaliveRequests: 1 << 30}))
	}, nil},
	{"memcaslap", "memcaslap", "ops/s", func(b *testing.B, e *env) float64 {
		port := strconv.Itoa(e.freePort(b))
		e.start(b, pinned(serverCPU, "memcached", "-l", "127.0.0.1", "-p", port, "-U", "0", "-u", "root", "-m", "64", "-t", "1")...)
		e.waitListening(b, "127.0.0.1:"+port)
		out := e.run(b, pinned(clientCPU, "memcaslap", "-s", "127.0.0.1:"+port, "-T", "1", "-c", "16", "-t", "5s", "-X", "100")...)
		v, _ := number(b, out, `TPS: ([0-9]+)`, "memcaslap's TPS")
		return v
	}, nil},
	// memcslap (libmemcached's) takes a socket path where memcaslap takes
	// only host:port: the same gets over TCP and over the unix socket.
	{"memcslap-get", "memcslap", "gets/s", func(b *testing.B, e *env) float64 {
		return memcslapGets(b, e, false)
	}, func(b *testing.B, e *env) float64 {
		return memcslapGets(b, e, true)
	}},
	{"mariadb-sysbench-read-only", "sysbench", "tps", func(b *testing.B, e *env) float64 {
		return sysbenchReadOnly(b, e, false)
	}, func(b *testing.B, e *env) float64 {
		return sysbenchReadOnly(b, e, true)
	}},
	// nginx as a proxy (http, kept-alive upstream connections) in front of
	// an nginx origin, both on serverCPU.
	{"nginx-proxy-wrk-1KB", "nginx", "req/s", func(b *testing.B, e *env) float64 {
		origin := nginxOriginPinned(b, e, newBlob(1<<10, 1))
		return wrkRate(b, e, "http://"+nginxProxy(b, e, "http-keepalive", origin, serverCPU)+"/blob", 20)
	}, nil},
	{"nginx-proxy-wrk-1MB", "nginx", "req/s", func(b *testing.B, e *env) float64 {
		origin := nginxOriginPinned(b, e, newBlob(1<<20, 1))
		return wrkRate(b, e, "http://"+nginxProxy(b, e, "http-keepalive", origin, serverCPU)+"/blob", 4)
	}, nil},
	{"nginx-stream-wrk-1KB", "nginx", "req/s", func(b *testing.B, e *env) float64 {
		origin := nginxOriginPinned(b, e, newBlob(1<<10, 1))
		return wrkRate(b, e, "http://"+nginxProxy(b, e, "stream", origin, serverCPU)+"/blob", 20)
	}, nil},
	// gunicorn's sync workers read with blocking recv, so shunt keeps
	// their connections on TCP (docs/TRANSPARENCY.md), and they close each
	// connection after one response: what a program kept on TCP pays.
	{"gunicorn-sync-wrk-1KB", "gunicorn", "req/s", func(b *testing.B, e *env) float64 {
		return wrkRate(b, e, "http://"+gunicornSync(b, e, 1<<10)+"/", 20)
	}, nil},
	// tinyproxy reads its upstream connections (a new one per request)
	// with blocking calls: what a client process kept on TCP pays (ab
	// through it to an nginx origin, both on serverCPU).
	{"tinyproxy-ab-1KB", "tinyproxy", "req/s", func(b *testing.B, e *env) float64 {
		origin := nginxOriginPinned(b, e, newBlob(1<<10, 1))
		return abProxyRate(b, e, tinyproxyPinned(b, e), "http://"+origin+"/blob")
	}, nil},
	// PHP behind nginx over FastCGI (a connection per request), php-fpm's
	// workers and nginx on serverCPU: php-fpm's blocking readers keep its
	// connections on TCP, wrk's to nginx are bypassed; php-fpm's unix
	// socket is its floor.
	{"nginx-php-fpm-wrk-1KB", phpFPMBinary, "req/s", func(b *testing.B, e *env) float64 {
		return nginxPHPRate(b, e, fmt.Sprintf("127.0.0.1:%d", e.freePort(b)))
	}, func(b *testing.B, e *env) float64 {
		return nginxPHPRate(b, e, filepath.Join(b.TempDir(), "php-fpm.sock"))
	}},
	{"haproxy-wrk-1KB", "haproxy", "req/s", func(b *testing.B, e *env) float64 {
		origin := nginxOriginPinned(b, e, newBlob(1<<10, 1))
		port := e.freePort(b)
		e.start(b, pinned(serverCPU, "haproxy", "-db", "-f", haproxyConf(b, "http", "", port, origin))...)
		addr := fmt.Sprintf("127.0.0.1:%d", port)
		e.waitListening(b, addr)
		return wrkRate(b, e, "http://"+addr+"/blob", 20)
	}, nil},
}

// nginxPHPRate runs php-fpm listening on listen (host:port or a socket
// path) behind nginx, both on serverCPU, and returns wrk's rate for a PHP
// page of 1 KiB.
func nginxPHPRate(b *testing.B, e *env, listen string) float64 {
	fpm := phpFPM(b, e, listen, newBlob(1<<10, 1), serverCPU)
	return wrkRate(b, e, "http://"+nginxFastCGI(b, e, fpm, serverCPU)+"/blob", 20)
}

// wrkP99 runs wrk with 4 connections for 5 s and returns its 99th
// percentile latency in milliseconds.
func wrkP99(b *testing.B, e *env, addr string) float64 {
	out := e.run(b, pinned(clientCPU, "wrk", "-t", "1", "-c", "4", "-d", "5s", "--latency", "http://"+addr+"/blob")...)
	// "     99%   43.21ms" in the latency distribution
	v, m := number(b, out, `(?m)^\s+99%\s+([0-9.]+)(us|ms|s)\s*$`, "wrk's 99th percentile")
	return v * map[string]float64{"us": 1e-3, "ms": 1, "s": 1e3}[m[2]]
}

// wrkRate runs wrk on clientCPU for 5 s with conns connections and returns
// its requests per second.
func wrkRate(b *testing.B, e *env, url string, conns int) float64 {
	out := e.run(b, pinned(clientCPU, "wrk", "-t", "1", "-c", strconv.Itoa(conns), "-d", "5s", url)...)
	v, _ := number(b, out, `Requests/sec:\s+([0-9.]+)`, "wrk's rate")
	return v
}

// abProxyRate runs ApacheBench on clientCPU through the HTTP proxy at
// proxy (host:port) for url, 10 at a time, and returns requests per second.
func abProxyRate(b *testing.B, e *env, proxy, url string) float64 {
	out := e.run(b, pinned(clientCPU, "ab", "-q", "-X", proxy, "-n", "20000", "-c", "10", url)...)
	v, _ := number(b, out, `Requests per second:\s+([0-9.]+)`, "ab's rate")
	return v
}

// tinyproxyPinned runs tinyproxy on serverCPU and returns where it listens.
func tinyproxyPinned(b *testing.B, e *env) string {
	dir := b.TempDir()
	port := e.freePort(b)
	conf := filepath.Join(dir, "tinyproxy.conf")
	writeFile(b, conf, []byte(fmt.Sprintf("Listen 127.0.0.1\nPort %d\nAllow 127.0.0.1\nTimeout 60\nMaxClients 64\nLogLevel Critical\nLogFile %q\n",
		port, filepath.Join(dir, "tinyproxy.log"))))
	e.start(b, pinned(serverCPU, "tinyproxy", "-d", "-c", conf)...)
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	e.waitListening(b, addr)
	return addr
}

// number finds re in a benchmark client's output and returns its first
// group as a number, and the whole match; the benchmark fails without it.
func number(b *testing.B, out, re, what string) (float64, []string) {
	m := regexp.MustCompile(re).FindStringSubmatch(out)
	if m == nil {
		b.Fatalf("no %s in the output: %q", what, out)
	}
	v, err := strconv.ParseFloat(m[1], 64)
	if err != nil {
		b.Fatalf("%s %q is not a number", what, m[1])
	}
	return v, m
}

// memcslapGets runs memcached (one thread, serverCPU) and memcslap's get
// test (8 threads on non-blocking connections, each loading then getting
// 20,000 keys) over TCP or, overUnix, memcached's unix socket, and returns
// gets per second.
func memcslapGets(b *testing.B, e *env, overUnix bool) float64 {
	argv := []string{"memcached", "-u", "root", "-m", "64", "-t", "1"}
	server := ""
	if overUnix {
		server = filepath.Join(b.TempDir(), "memcached.sock")
		argv = append(argv, "-s", server)
		e.start(b, pinned(serverCPU, argv...)...)
		waitSocketFile(b, server)
	} else {
		port := strconv.Itoa(e.freePort(b))
		server = "127.0.0.1:" + port
		e.start(b, pinned(serverCPU, append(argv, "-l", "127.0.0.1", "-p", port, "-U", "0")...)...)
		e.waitListening(b, server)
	}
	out := e.run(b, pinned(clientCPU, "memcslap", "-s", server, "-n", "-N", "-c", "8", "-e", "20000", "-t", "get")...)
	// "Time to get           78157 keys by    8 threads:     1.126 seconds."
	_, m := number(b, out, `Time to get\s+([0-9]+) keys by\s+[0-9]+ threads:\s+([0-9.]+) seconds`, "memcslap's get time")
	keys, _ := strconv.ParseFloat(m[1], 64)
	secs, err := strconv.ParseFloat(m[2], 64)
	if err != nil || secs <= 0 {
		b.Fatalf("memcslap's get time %q is not a time", m[2])
	}
	return keys / secs
}

// sysbenchReadOnly runs MariaDB (serverCPU) with a fresh data directory and
// sysbench's oltp_read_only (8 threads, 5 s, one table of 10,000 rows) over
// TCP or, overUnix, its unix socket, and returns transactions per second.
func sysbenchReadOnly(b *testing.B, e *env, overUnix bool) float64 {
	port, sock := startMariaDB(b, e)
	conn := []string{"--mysql-host=127.0.0.1", "--mysql-port=" + port}
	if overUnix {
		conn = []string{"--mysql-socket=" + sock}
	}
	common := append([]string{"--db-driver=mysql", "--mysql-user=root", "--mysql-db=sbtest", "--tables=1", "--table-size=10000"}, conn...)
	e.run(b, append([]string{"sysbench", "oltp_read_only"}, append(common, "prepare")...)...)
	out := e.run(b, pinned(clientCPU, append([]string{"sysbench", "oltp_read_only"}, append(common, "--threads=8", "--time=5", "run")...)...)...)
	// "    transactions:                        12345  (2468.80 per sec.)"
	v, _ := number(b, out, `transactions:\s+[0-9]+\s+\(([0-9.]+) per sec\.\)`, "sysbench's transactions per second")
	return v
}

// startMariaDB runs MariaDB on serverCPU with a fresh data directory, no
// grant tables (root without a password) and a database sbtest, and
// returns its TCP port and unix socket.
func startMariaDB(t testing.TB, e *env) (port, sock string) {
	dir, err := os.MkdirTemp("", "shunt-test-mariadb-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	data := filepath.Join(dir, "data")
	install := exec.Command("mariadb-install-db", "--no-defaults", "--datadir="+data, "--user=root", "--skip-test-db", "--auth-root-authentication-method=normal")
	if out, err := install.CombinedOutput(); err != nil {
		t.Fatalf("mariadb-install-db: %v: %s", err, out)
	}
	port = strconv.Itoa(e.freePort(t))
	sock = filepath.Join(dir, "mariadb.sock")
	e.start(t, pinned(serverCPU, "mariadbd", "--no-defaults", "--user=root", "--datadir="+data, "--socket="+sock,
		"--port="+port, "--bind-address=127.0.0.1", "--skip-grant-tables", "--skip-log-bin", "--innodb-buffer-pool-size=128M",
		"--pid-file="+filepath.Join(dir, "mariadb.pid"), "--log-error="+filepath.Join(dir, "error.log"))...)
	e.waitListening(t, "127.0.0.1:"+port)
	e.run(t, "mariadb", "--no-defaults", "--socket="+sock, "-u", "root", "-e", "CREATE DATABASE sbtest")
	return port, sock
}

// waitSocketFile waits up to startupWait for a server to make its unix socket.
func waitSocketFile(t testing.TB, path string) {
	for deadline := time.Now().Add(startupWait); ; time.Sleep(20 * time.Millisecond) {
		if fi, err := os.Stat(path); err == nil && fi.Mode()&os.ModeSocket != 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no unix socket at %s after %v", path, startupWait)
		}
	}
}

// pgbenchSelect runs pgbench's select-only load (8 clients, 5 s) against
// PostgreSQL over TCP or, overUnix, its unix socket, and returns its tps.
func pgbenchSelect(b *testing.B, e *env, overUnix bool) float64 {
	port, sockDir := startPostgres(b, e)
	host := "127.0.0.1"
	if overUnix {
		host = sockDir
	}
	bin := "/usr/lib/postgresql/15/bin"
	conn := []string{"-h", host, "-p", port, "-U", "postgres", "postgres"}
	e.run(b, append([]string{bin + "/pgbench", "-i", "-q", "-s", "1"}, conn...)...)
	out := e.run(b, pinned(clientCPU, append([]string{bin + "/pgbench", "-n", "-S", "-c", "8", "-j", "1", "-T", "5"}, conn...)...)...)
	v, _ := number(b, out, `tps = ([0-9.]+)`, "pgbench's tps")
	return v
}

// postgresDir makes a directory the postgres user owns, under /tmp (the
// test's temporary ones are closed to other users), removed when the test
// ends.
func postgresDir(t testing.TB, prefix string) (string, *user.User) {
	pg, err := user.Lookup("postgres")
	if err != nil {
		t.Fatalf("no postgres user: %v (the postgresql package makes it)", err)
	}
	dir, err := os.MkdirTemp("", prefix)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	uid, _ := strconv.Atoi(pg.Uid)
	gid, _ := strconv.Atoi(pg.Gid)
	if err := os.Chown(dir, uid, gid); err != nil {
		t.Fatal(err)
	}
	return dir, pg
}

// startPostgres runs PostgreSQL 15 (as the postgres user, on serverCPU) in
// the env with a fresh cluster and returns its port and the directory of
// its unix socket.
func startPostgres(t testing.TB, e *env) (port, sockDir string) {
	bin := "/usr/lib/postgresql/15/bin"
	dir, pg := postgresDir(t, "shunt-test-pg-")
	uid, _ := strconv.Atoi(pg.Uid)
	gid, _ := strconv.Atoi(pg.Gid)
	initdb := exec.Command(bin+"/initdb", "-D", filepath.Join(dir, "data"), "-A", "trust", "-U", "postgres")
	initdb.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}}
	if out, err := initdb.CombinedOutput(); err != nil {
		t.Fatalf("initdb: %v: %s", err, out)
	}
	port = strconv.Itoa(e.freePort(t))
	e.start(t, pinned(serverCPU, "setpriv", "--reuid", pg.Uid, "--regid", pg.Gid, "--clear-groups", bin+"/postgres", "-D", filepath.Join(dir, "data"),
		"-k", dir, "-p", port, "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off")...)
	e.waitListening(t, "127.0.0.1:"+port)
	// PostgreSQL listens before it takes connections ("the database
	// system is starting up"): wait for pg_isready to say it accepts.
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		cmd, done := e.command(t, bin+"/pg_isready", "-q", "-h", "127.0.0.1", "-p", port, "-U", "postgres")
		err := cmd.Run()
		done()
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("PostgreSQL on port %s does not accept connections after 30 s: pg_isready: %v", port, err)
		}
	}
	return port, dir
}

// nginxOriginPinned is nginxOrigin with nginx on serverCPU.
func nginxOriginPinned(t testing.TB, e *env, body blob) string {
	return nginxOriginWith(t, e, body, nginxSetup{sendfile: true, cpu: serverCPU})
}

// gunicornSync runs gunicorn with two sync workers on serverCPU, serving
// size bytes for every request, and returns where it listens.
func gunicornSync(t testing.TB, e *env, size int) string {
	t.Helper()
	dir := t.TempDir()
	app := fmt.Sprintf(`body = b"x" * %d

def app(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]
`, size)
	if err := os.WriteFile(filepath.Join(dir, "app.py"), []byte(app), 0o644); err != nil {
		t.Fatal(err)
	}
	addr := fmt.Sprintf("127.0.0.1:%d", e.freePort(t))
	e.start(t, pinned(serverCPU, "gunicorn", "--chdir", dir, "--workers", "2", "--worker-class", "sync", "--bind", addr, "--log-level", "warning", "app:app")...)
	e.waitListening(t, addr)
	return addr
}

// redisPath is how redis-benchmark reaches Redis.
type redisPath int

const (
	redisDirect  redisPath = iota // Redis's TCP address
	redisService                  // a Service's virtual address that a DNAT on output sends to Redis (kube-proxy's shape for an endpoint on the node)
	redisUnix                     // Redis's unix socket
)

// redisBenchmark starts Redis on serverCPU and returns redis-benchmark's
// mean of its SET and GET rates (50 connections, 100 B values).
func redisBenchmark(b *testing.B, e *env, path redisPath) float64 {
	port := e.freePort(b)
	argv := redisArgv(strconv.Itoa(port))
	sock := filepath.Join(b.TempDir(), "redis.sock")
	if path == redisUnix {
		argv = append(argv, "--unixsocket", sock, "--unixsocketperm", "700")
	}
	e.start(b, pinned(serverCPU, argv...)...)
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	e.waitListening(b, addr)
	target := []string{"-h", "127.0.0.1", "-p", strconv.Itoa(port)}
	switch path {
	case redisService:
		const vip = "10.96.0.20:6379"
		e.serviceDNAT(b, vip, addr)
		target = []string{"-h", "10.96.0.20", "-p", "6379"}
	case redisUnix:
		target = []string{"-s", sock}
	}
	out := e.run(b, pinned(clientCPU, append(append([]string{"redis-benchmark"}, target...), "-q", "--csv", "-n", "200000", "-c", "50", "-d", "100", "-t", "set,get")...)...)
	// "SET","123456.79",...
	var sum float64
	var n int
	for _, line := range strings.Split(out, "\n") {
		f := strings.Split(line, ",")
		if len(f) > 1 && (f[0] == `"SET"` || f[0] == `"GET"`) {
			v, err := strconv.ParseFloat(strings.Trim(f[1], `"`), 64)
			if err != nil {
				b.Fatalf("redis-benchmark said %q", line)
			}
			sum += v
			n++
		}
	}
	if n != 2 {
		b.Fatalf("redis-benchmark printed no SET and GET rates: %q", out)
	}
	return sum / 2
}

// BenchmarkRedisThroughService: Redis reached through a Service (DNAT)
// against Redis reached directly, each plain and through shunt, the four
// modes interleaved in alternating order each round. Shunt pairs the
// Service's connections by their sequence numbers; the gain should be the
// direct one's. SHUNT_COMPAT_ROUNDS rounds (default 5); as root.
func BenchmarkRedisThroughService(b *testing.B) {
	testenv.NeedProgram(b, "redis-server")
	testenv.NeedProgram(b, "nft")
	rounds := 5
	if v, err := strconv.Atoi(os.Getenv("SHUNT_COMPAT_ROUNDS")); err == nil && v > 0 {
		rounds = v
	}
	type mode struct {
		name  string
		shunt bool
		path  redisPath
	}
	modes := []mode{{"plain-direct", false, redisDirect}, {"plain-service", false, redisService}, {"shunt-direct", true, redisDirect}, {"shunt-service", true, redisService}}
	got := map[string][]float64{}
	for r := 0; r < rounds; r++ {
		order := slices.Clone(modes)
		if r%2 == 1 {
			slices.Reverse(order)
		}
		for _, m := range order {
			e := newEnv(b, m.shunt)
			got[m.name] = append(got[m.name], redisBenchmark(b, e, m.path))
			if e.in != nil && m.path == redisService && r == 0 {
				if st, err := e.in.Stats(); err == nil {
					b.Logf("round 0, %s: %d paired, %d through address translation", m.name, st.Counters.Paired, st.Counters.Translated)
				}
			}
		}
	}
	med := map[string]float64{}
	for _, m := range modes {
		med[m.name] = median(got[m.name])
		b.ReportMetric(med[m.name], m.name+"-req/s")
		b.Logf("%s: median %s req/s (rounds: %s)", m.name, rounded(med[m.name]), rounded(got[m.name]...))
	}
	// Each round's own ratio too: this VM's rate drifts between rounds by
	// more than shunt changes it within one.
	gain := func(path string) (float64, []float64) {
		var r []float64
		for i := range got["plain-"+path] {
			r = append(r, got["shunt-"+path][i]/got["plain-"+path][i])
		}
		return median(r), r
	}
	direct, dr := gain("direct")
	service, sr := gain("service")
	b.ReportMetric(direct, "direct-gain")
	b.ReportMetric(service, "service-gain")
	b.Logf("shunt/plain, median of each round's ratio: direct %.2f (%s), through the Service %.2f (%s); of the medians: %.2f, %.2f",
		direct, rounded(dr...), service, rounded(sr...), med["shunt-direct"]/med["plain-direct"], med["shunt-service"]/med["plain-service"])
}
