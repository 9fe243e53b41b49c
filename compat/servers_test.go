package compat_test

import (
	"bufio"
	"crypto/sha256"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shunt-project/shunt/internal/testenv"
)

// path is where a program's bytes must go through shunt.
type path int

const (
	redirected path = iota // less than half the payload crosses IP
	onTCP                  // a reader blocks: its direction stays on TCP
	eitherPath             // paired; how much is redirected depends on timing
)

// bothWays runs fn over plain TCP and then through shunt, each in a fresh
// env, and checks which path fn's bytes took with a witness shunt does not
// write: the IP bytes the namespace received (IpExt InOctets), against the
// payload fn moves (0: what the plain run's IP carried, for a workload
// whose size is not known beforehand). Over plain TCP they carry the whole
// payload; through shunt they must take the path want says.
func bothWays(t *testing.T, want path, payload int64, fn func(t *testing.T, e *env)) {
	measured := payload == 0
	for _, shunt := range []bool{false, true} {
		name := "plain"
		if shunt {
			name = "shunt"
		}
		t.Run(name, func(t *testing.T) {
			e := newEnv(t, shunt)
			before := e.ipInOctets(t)
			fn(t, e)
			viaIP := e.ipInOctets(t) - before
			if measured && !shunt {
				payload = viaIP
			}
			t.Logf("payload %d bytes, IP received %d bytes", payload, viaIP)
			switch {
			case (!shunt || want == onTCP) && viaIP < payload:
				t.Errorf("IP received %d bytes of a %d-byte payload: the witness is blind", viaIP, payload)
			case shunt && want == redirected && viaIP > payload/2:
				t.Errorf("IP received %d bytes of a %d-byte payload: it did not go by redirect", viaIP, payload)
			}
			if !shunt {
				return
			}
			st, err := e.in.Stats()
			if err != nil {
				t.Fatal(err)
			}
			c := st.Counters
			t.Logf("paired %d, directions kept on TCP for a blocking reader %d, sockets back on TCP %d", c.Paired, c.TCPReaders, c.Left)
			switch {
			case c.Paired == 0:
				t.Errorf("no connection was paired: the run compared TCP with TCP")
			case want == onTCP && c.TCPReaders == 0:
				t.Errorf("no direction of a program that needs TCP was kept on it")
			}
		})
	}
}

// ipInOctets reads IpExt InOctets of the env's namespace: every byte of
// every IP packet it received, loopback included.
func (e *env) ipInOctets(t *testing.T) int64 {
	t.Helper()
	var b []byte
	var err error
	// thread-self: /proc/self/net follows the thread group leader's
	// namespace, not this locked thread's.
	e.side.NS.Do(t, func() { b, err = os.ReadFile("/proc/thread-self/net/netstat") })
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(string(b), "\n")
	for i := 0; i+1 < len(lines); i++ {
		names, values := strings.Fields(lines[i]), strings.Fields(lines[i+1])
		if len(names) == 0 || names[0] != "IpExt:" || len(values) != len(names) {
			continue
		}
		for j, n := range names {
			if n == "InOctets" {
				v, err := strconv.ParseInt(values[j], 10, 64)
				if err != nil {
					t.Fatalf("IpExt InOctets %q: %v", values[j], err)
				}
				return v
			}
		}
	}
	t.Fatal("no IpExt InOctets in /proc/net/netstat")
	return 0
}

// serveAndDial starts a server (argv for a free port) in the env and
// returns one client connection to it.
func (e *env) serveAndDial(t *testing.T, argv func(port string) []string) (*net.TCPConn, *bufio.Reader) {
	t.Helper()
	port := e.freePort(t)
	e.start(t, argv(strconv.Itoa(port))...)
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	e.waitListening(t, addr)
	c := e.dial(t, addr)
	return c, bufio.NewReader(c)
}

// dial connects from the env, as a client in its cgroup.
func (e *env) dial(t *testing.T, addr string) *net.TCPConn {
	t.Helper()
	var c net.Conn
	var err error
	e.side.Make(t, func() { c, err = net.DialTimeout("tcp4", addr, 5*time.Second) })
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(60 * time.Second))
	return c.(*net.TCPConn)
}

// Redis 7: SET 200 values of 100 KB, GET them back, compare digests.
func TestRedis(t *testing.T) {
	testenv.NeedProgram(t, "redis-server")
	bothWays(t, redirected, 2*200*100<<10, func(t *testing.T, e *env) {
		c, r := e.serveAndDial(t, redisArgv)
		redisSetGet(t, c, r)
	})
}

// Redis behind a Service: the client dials a virtual address that a DNAT
// on output, shaped like kube-proxy's for a Service whose endpoint is on
// this node, sends to Redis. Both legs are one connection to shunt, paired
// through the translation by its sequence numbers.
func TestRedisThroughServiceDNAT(t *testing.T) {
	testenv.NeedProgram(t, "redis-server")
	testenv.NeedProgram(t, "nft")
	bothWays(t, redirected, 2*200*100<<10, func(t *testing.T, e *env) {
		port := e.freePort(t)
		e.start(t, redisArgv(strconv.Itoa(port))...)
		addr := fmt.Sprintf("127.0.0.1:%d", port)
		e.waitListening(t, addr)
		const vip = "10.96.0.20:6379"
		e.serviceDNAT(t, vip, addr)
		c := e.dial(t, vip)
		redisSetGet(t, c, bufio.NewReader(c))
		if e.in != nil {
			if st, err := e.in.Stats(); err != nil || st.Counters.Translated == 0 {
				t.Errorf("no connection counted as paired through the translation: %+v %v", st.Counters, err)
			}
		}
	})
}

// Redis replication: a replica joins a primary that holds 50,000 keys
// (the full sync: an RDB streamed over the replication connection) while 8
// clients keep writing, and takes the command stream from then on. Once the
// replica has caught up with the primary's replication offset, both hold
// the same data set (DEBUG DIGEST).
func TestRedisReplication(t *testing.T) {
	testenv.NeedProgram(t, "redis-server")
	testenv.NeedProgram(t, "redis-benchmark")
	bothWays(t, redirected, 0, func(t *testing.T, e *env) {
		primary, replica := strconv.Itoa(e.freePort(t)), strconv.Itoa(e.freePort(t))
		// Its own directory each: a replica writes the RDB it received.
		opts := func() []string {
			return []string{"--dir", t.TempDir(), "--enable-debug-command", "yes", "--repl-diskless-sync-delay", "0"}
		}
		e.start(t, append(redisArgv(primary), opts()...)...)
		e.waitListening(t, "127.0.0.1:"+primary)
		e.run(t, "redis-benchmark", "-p", primary, "-t", "set", "-n", "50000", "-d", "1000", "-r", "50000", "-P", "16", "-q")
		e.start(t, append(append(redisArgv(replica), opts()...), "--replicaof", "127.0.0.1", primary)...)
		e.waitListening(t, "127.0.0.1:"+replica)
		e.run(t, "redis-benchmark", "-p", primary, "-t", "set,lpush,incr", "-n", "100000", "-d", "500", "-r", "50000", "-P", "16", "-c", "8", "-q")
		offset := func(port, field string) string {
			out := e.run(t, "redis-cli", "-p", port, "info", "replication")
			for _, l := range strings.Split(out, "\n") {
				if v, ok := strings.CutPrefix(strings.TrimSpace(l), field+":"); ok {
					return v
				}
			}
			return ""
		}
		for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
			want := offset(primary, "master_repl_offset")
			if offset(replica, "master_link_status") == "up" && offset(replica, "slave_repl_offset") == want {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("the replica has not caught up in 30 s: link %q, offset %q of %q", offset(replica, "master_link_status"), offset(replica, "slave_repl_offset"), want)
			}
		}
		p, r := e.run(t, "redis-cli", "-p", primary, "debug", "digest"), e.run(t, "redis-cli", "-p", replica, "debug", "digest")
		if strings.TrimSpace(p) != strings.TrimSpace(r) || strings.Trim(strings.TrimSpace(p), "0") == "" {
			t.Fatalf("data set digests: primary %q, replica %q", p, r)
		}
	})
}

func redisArgv(port string) []string {
	return []string{"redis-server", "--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--protected-mode", "no"}
}

// serviceDNAT gives the env a virtual address vip (on lo, as a Service's
// cluster IP is routable) and DNATs it on output to addr, as kube-proxy's
// nftables mode does for an endpoint on the node.
func (e *env) serviceDNAT(t testing.TB, vip, addr string) {
	t.Helper()
	v, a := netip.MustParseAddrPort(vip), netip.MustParseAddrPort(addr)
	e.run(t, "ip", "addr", "add", v.Addr().String()+"/32", "dev", "lo")
	rules := fmt.Sprintf(`table ip shunt_test_service {
	chain out {
		type nat hook output priority -100;
		ip daddr %s tcp dport %d dnat to %s
	}
}`, v.Addr(), v.Port(), a)
	e.side.NS.Nft(t, rules)
}

// redisSetGet SETs 200 values of 100 KB, GETs them back and compares
// digests.
func redisSetGet(t *testing.T, c *net.TCPConn, r *bufio.Reader) {
	t.Helper()
	const n = 200
	sums := make([][32]byte, n)
	for i := 0; i < n; i++ {
		v := newBlob(100<<10, uint64(i)).data
		sums[i] = sha256.Sum256(v)
		fmt.Fprintf(c, "*3\r\n$3\r\nSET\r\n$%d\r\nk%d\r\n$%d\r\n", len(strconv.Itoa(i))+1, i, len(v))
		c.Write(append(v, '\r', '\n'))
		if line, err := r.ReadString('\n'); err != nil || line != "+OK\r\n" {
			t.Fatalf("SET %d: %q %v", i, line, err)
		}
	}
	for i := 0; i < n; i++ {
		fmt.Fprintf(c, "*2\r\n$3\r\nGET\r\n$%d\r\nk%d\r\n", len(strconv.Itoa(i))+1, i)
		line, err := r.ReadString('\n')
		if err != nil || !strings.HasPrefix(line, "$") {
			t.Fatalf("GET %d: %q %v", i, line, err)
		}
		size, _ := strconv.Atoi(strings.TrimSpace(line[1:]))
		v := make([]byte, size+2)
		if _, err := io.ReadFull(r, v); err != nil || sha256.Sum256(v[:size]) != sums[i] {
			t.Fatalf("GET %d: %d bytes, digest differs (%v)", i, size, err)
		}
	}
}

// memcached 1.6: set 200 values of 50 KB, get them back, compare digests.
func TestMemcached(t *testing.T) {
	testenv.NeedProgram(t, "memcached")
	bothWays(t, redirected, 2*200*50<<10, func(t *testing.T, e *env) {
		c, r := e.serveAndDial(t, func(port string) []string {
			return []string{"memcached", "-l", "127.0.0.1", "-p", port, "-U", "0", "-u", "root", "-m", "64"}
		})
		const n = 200
		sums := make([][32]byte, n)
		for i := 0; i < n; i++ {
			v := newBlob(50<<10, uint64(i)).data
			sums[i] = sha256.Sum256(v)
			fmt.Fprintf(c, "set k%d 0 0 %d\r\n", i, len(v))
			c.Write(append(v, '\r', '\n'))
			if line, err := r.ReadString('\n'); err != nil || line != "STORED\r\n" {
				t.Fatalf("set %d: %q %v", i, line, err)
			}
		}
		for i := 0; i < n; i++ {
			fmt.Fprintf(c, "get k%d\r\n", i)
			line, err := r.ReadString('\n')
			f := strings.Fields(line)
			if err != nil || len(f) != 4 || f[0] != "VALUE" {
				t.Fatalf("get %d: %q %v", i, line, err)
			}
			size, _ := strconv.Atoi(f[3])
			v := make([]byte, size+2+5) // data, CRLF, END CRLF
			if _, err := io.ReadFull(r, v); err != nil || sha256.Sum256(v[:size]) != sums[i] || string(v[size:]) != "\r\nEND\r\n" {
				t.Fatalf("get %d: %d bytes, digest or framing differs (%v)", i, size, err)
			}
		}
	})
}

// curlGet downloads url n times with one curl, which keeps one connection
// open across them when the server allows (HTTP/1.1 keep-alive), and
// returns each download's digest; curlArgs go before the downloads.
func (e *env) curlGet(t *testing.T, url string, n int, curlArgs ...string) [][32]byte {
	t.Helper()
	dir := t.TempDir()
	args := append([]string{"curl", "-sS", "--fail", "--max-time", "60"}, curlArgs...)
	for i := 0; i < n; i++ {
		args = append(args, "-o", filepath.Join(dir, strconv.Itoa(i)), url)
	}
	e.run(t, args...)
	sums := make([][32]byte, n)
	for i := range sums {
		b, err := os.ReadFile(filepath.Join(dir, strconv.Itoa(i)))
		if err != nil {
			t.Fatal(err)
		}
		sums[i] = sha256.Sum256(b)
	}
	return sums
}

// nginx 1.22 (sendfile on and off) and a Python http.server (blocking
// sockets), each serving an 8 MiB file 20 times to one curl (one kept-alive
// connection for nginx; one each for Python's HTTP/1.0).
func TestHTTPServersWithCurl(t *testing.T) {
	testenv.NeedProgram(t, "curl")
	body := newBlob(8<<20, 3)
	for _, srv := range []string{"nginx-sendfile-on", "nginx-sendfile-off", "python-http.server"} {
		t.Run(srv, func(t *testing.T) {
			// Python's http.server reads with blocking recv: its
			// connections go back to TCP, which is the promise for it.
			bothWays(t, map[bool]path{true: onTCP, false: redirected}[srv == "python-http.server"], 20*int64(len(body.data)), func(t *testing.T, e *env) {
				var addr string
				switch srv {
				case "python-http.server":
					testenv.NeedProgram(t, "python3")
					dir := t.TempDir()
					if err := os.WriteFile(filepath.Join(dir, "blob"), body.data, 0o644); err != nil {
						t.Fatal(err)
					}
					port := e.freePort(t)
					e.start(t, "python3", "-m", "http.server", "--bind", "127.0.0.1", "--directory", dir, strconv.Itoa(port))
					addr = fmt.Sprintf("127.0.0.1:%d", port)
					e.waitListening(t, addr)
				default:
					addr = nginxOrigin(t, e, body, srv == "nginx-sendfile-on")
				}
				for i, got := range e.curlGet(t, "http://"+addr+"/blob", 20) {
					if got != body.sum {
						t.Fatalf("download %d: digest differs", i)
					}
				}
			})
		})
	}
}

// PostgreSQL 15 with pgbench: 4 clients run 300 TPC-B transactions each;
// then the balances agree (accounts, tellers, branches and the history)
// and every transaction is in the history.
func TestPostgreSQL(t *testing.T) {
	bin := "/usr/lib/postgresql/15/bin"
	testenv.NeedProgram(t, bin+"/postgres")
	bothWays(t, redirected, 0, func(t *testing.T, e *env) {
		conn := pgbenchCluster(t, e, 1)
		e.run(t, append(append([]string{bin + "/pgbench", "-n", "-c", "4", "-j", "2", "-t", "300"}, conn...), "postgres")...)
		out := e.run(t, append(append([]string{bin + "/psql", "-At", "-c",
			"select (select sum(abalance) from pgbench_accounts), (select sum(tbalance) from pgbench_tellers), (select sum(bbalance) from pgbench_branches), (select sum(delta) from pgbench_history), (select count(*) from pgbench_history)"},
			conn...), "postgres")...)
		f := strings.Split(strings.TrimSpace(out), "|")
		if len(f) != 5 || f[0] != f[1] || f[1] != f[2] || f[2] != f[3] || f[4] != "1200" {
			t.Fatalf("balances (accounts|tellers|branches|history|transactions) %q: want the four sums equal and 1200 transactions", out)
		}
	})
}

// PostgreSQL 15's base backup of a cluster pgbench filled by COPY (5 x
// 100,000 rows sent by the client while the server's backend writes them):
// pg_basebackup takes the data directory through the replication protocol
// with the WAL streamed on a second connection, and pg_verifybackup checks
// every file against the checksums of the backup's manifest. Every row is
// counted back.
func TestPostgreSQLBaseBackup(t *testing.T) {
	bin := "/usr/lib/postgresql/15/bin"
	testenv.NeedProgram(t, bin+"/postgres")
	bothWays(t, eitherPath, 0, func(t *testing.T, e *env) {
		conn := pgbenchCluster(t, e, 5)
		backup := filepath.Join(t.TempDir(), "backup")
		e.run(t, append([]string{bin + "/pg_basebackup", "-D", backup, "-X", "stream", "-c", "fast"}, conn...)...)
		e.run(t, bin+"/pg_verifybackup", "-q", backup)
		out := e.run(t, append(append([]string{bin + "/psql", "-At", "-c", "select count(*) from pgbench_accounts"}, conn...), "postgres")...)
		if got := strings.TrimSpace(out); got != "500000" {
			t.Fatalf("pgbench_accounts has %s rows, want 500000", got)
		}
		if e.in != nil {
			if st, err := e.in.Stats(); err == nil {
				t.Logf("stalls rescued %d", st.Counters.StallsRescued)
			}
		}
	})
}

// pgbenchCluster starts PostgreSQL in the env, fills it with pgbench -i at
// scale (100,000 accounts each, sent by COPY) and returns the options that
// connect to it over TCP.
func pgbenchCluster(t *testing.T, e *env, scale int) []string {
	port, _ := startPostgres(t, e)
	conn := []string{"-h", "127.0.0.1", "-p", port, "-U", "postgres"}
	e.run(t, append(append([]string{"/usr/lib/postgresql/15/bin/pgbench", "-i", "-q", "-s", strconv.Itoa(scale)}, conn...), "postgres")...)
	return conn
}

// run runs a client program in the env's namespace and cgroup and returns
// its output; it fails the test if the program fails.
func (e *env) run(t testing.TB, argv ...string) string {
	t.Helper()
	cmd, done := e.command(t, argv...)
	defer done()
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%v: %v: %s", argv, err, out)
	}
	return string(out)
}

// netcat (OpenBSD's nc): 32 MiB uploaded to `nc -l`, then 32 MiB served by
// `nc -l` and downloaded, over one connection each. nc reads blocking
// sockets after poll: a blocking reader, so its connections go back to TCP,
// which is the promise for it; the bytes must arrive whole either way.
func TestNetcat(t *testing.T) {
	testenv.NeedProgram(t, "nc")
	body := newBlob(32<<20, 5)
	bothWays(t, eitherPath, 2*int64(len(body.data)), func(t *testing.T, e *env) {
		dir := t.TempDir()
		blob := filepath.Join(dir, "blob")
		if err := os.WriteFile(blob, body.data, 0o644); err != nil {
			t.Fatal(err)
		}
		for _, way := range []struct{ name, server, client string }{
			{"upload", "nc -l 127.0.0.1 {port} > {got}", "nc -N 127.0.0.1 {port} < {blob}"},
			{"download", "nc -N -l 127.0.0.1 {port} < {blob}", "nc 127.0.0.1 {port} > {got}"},
		} {
			port := e.freePort(t)
			got := filepath.Join(dir, way.name)
			r := strings.NewReplacer("{port}", strconv.Itoa(port), "{got}", got, "{blob}", blob)
			e.start(t, "sh", "-c", r.Replace(way.server))
			e.waitListenSocket(t, port) // nc -l takes one connection: no probe
			e.run(t, "sh", "-c", r.Replace(way.client))
			// The receiving nc writes its file until the sender's FIN.
			deadline := time.Now().Add(30 * time.Second)
			for {
				b, err := os.ReadFile(got)
				if err == nil && len(b) == len(body.data) {
					if sha256.Sum256(b) != body.sum {
						t.Fatalf("%s: %d bytes arrived, digest differs", way.name, len(b))
					}
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("%s: %d of %d bytes after 30 s (%v)", way.name, len(b), len(body.data), err)
				}
				time.Sleep(20 * time.Millisecond)
			}
		}
	})
}
