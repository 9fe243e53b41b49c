package compat_test

import (
	"bufio"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/bypass/bypasstest"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
)

// env is one namespace and one cgroup with bypass enabled on it (or not:
// the plain run) and a guard watching the install.
type env struct {
	in   *bypass.Install
	side testenv.Side
	cg   host.Cgroup

	mu         sync.Mutex
	guardLines []string // what the guard reported
}

// guardSaid is what the guard has reported so far.
func (e *env) guardSaid() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Clone(e.guardLines)
}

func newEnv(t testing.TB, shunt bool) *env {
	t.Helper()
	if shunt {
		return newEnvWith(t, bypass.Options{})
	}
	testenv.RequireRoot(t)
	e := &env{cg: testenv.MustCgroup(t)}
	e.side = testenv.Side{NS: testenv.MustNetNS(t), CG: e.cg}
	return e
}

// newEnvWith is newEnv with shunt installed with opts.
func newEnvWith(t testing.TB, opts bypass.Options) *env {
	t.Helper()
	e := newEnv(t, false)
	in, err := bypass.Create(bypasstest.MustPinDir(t), opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { in.Close() })
	if _, err := in.Attach(e.cg); err != nil {
		t.Fatal(err)
	}
	bypasstest.RunGuard(t, in, func(line string) {
		t.Logf("guard: %s", line)
		e.mu.Lock()
		e.guardLines = append(e.guardLines, line)
		e.mu.Unlock()
	})
	e.in = in
	return e
}

// logState logs what shunt holds in the env, for a test that failed.
func logState(t testing.TB, e *env) {
	t.Helper()
	if e.in == nil {
		return
	}
	if flows, err := e.in.Flows(); err == nil {
		for _, f := range flows {
			for _, ep := range []*bypass.Endpoint{f.Client, f.Server} {
				if ep != nil {
					t.Logf("held: %+v", *ep)
				}
			}
		}
	}
	if st, err := e.in.Stats(); err == nil {
		t.Logf("counters: %+v", st.Counters)
	}
	// Each socket's TCP state, queues and memory: which end is missing
	// (an end not seen shows as CLOSE-WAIT with nothing queued, a writer
	// stuck as a full Send-Q or its write memory full).
	if out, err := exec.Command("ip", "netns", "exec", e.side.NS.Name, "ss", "-tanpiom", "exclude", "time-wait").CombinedOutput(); err == nil {
		t.Logf("sockets:\n%s", out)
	}
	// What each process of the env sleeps in (the system call's number and
	// arguments, and the kernel function it waits in).
	procs, err := os.ReadFile(filepath.Join(e.cg.Path, "cgroup.procs"))
	if err != nil {
		t.Logf("processes: %v", err)
	}
	for _, pid := range strings.Fields(string(procs)) {
		// A process that exited since has nothing to say.
		comm, err1 := os.ReadFile("/proc/" + pid + "/comm")
		call, err2 := os.ReadFile("/proc/" + pid + "/syscall")
		wchan, err3 := os.ReadFile("/proc/" + pid + "/wchan")
		if err := errors.Join(err1, err2, err3); err != nil {
			t.Logf("process %s: %v", pid, err)
			continue
		}
		t.Logf("process %s (%s): system call %s, waiting in %s", pid, strings.TrimSpace(string(comm)), strings.TrimSpace(string(call)), wchan)
	}
}

// start runs a program in the env's namespace and cgroup until the test
// ends, and returns its pid.
func (e *env) start(t testing.TB, argv ...string) int {
	t.Helper()
	cmd, done := e.command(t, argv...)
	defer done()
	return testenv.Start(t, filepath.Base(argv[0]), cmd).Pid
}

// command makes argv run in the env's namespace and cgroup; done releases
// the cgroup's descriptor once the command has started.
func (e *env) command(t testing.TB, argv ...string) (cmd *exec.Cmd, done func()) {
	t.Helper()
	cg, err := os.Open(e.cg.Path)
	if err != nil {
		t.Fatal(err)
	}
	cmd = exec.Command("ip", append([]string{"netns", "exec", e.side.NS.Name}, argv...)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(cg.Fd())}
	return cmd, func() { cg.Close() }
}

// listenerIn opens a listener in the env's namespace and cgroup.
func (e *env) listen(t testing.TB) *net.TCPListener {
	return testenv.Listen(t, e.side, "tcp4", "127.0.0.1:0")
}

// freePort picks a port for a program to listen on in the namespace.
func (e *env) freePort(t testing.TB) int {
	ln := e.listen(t)
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	return port
}

// startupWait is how long a program gets to listen after it starts: under
// qemu without KVM php-fpm had not listened (nor logged a line) after 10 s
// in one CI run on 6.1.
const startupWait = 30 * time.Second

// waitListening waits until something accepts on addr in the namespace.
func (e *env) waitListening(t testing.TB, addr string) {
	t.Helper()
	deadline := time.Now().Add(startupWait)
	for {
		var c net.Conn
		var err error
		e.side.NS.Do(t, func() { c, err = net.DialTimeout("tcp4", addr, 200*time.Millisecond) })
		if err == nil {
			c.Close()
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("nothing listens on %s after %v", addr, startupWait)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitListenSocket waits until a TCP socket listens on port in the
// namespace, without connecting to it (a program that accepts once would
// take the probe for its client).
func (e *env) waitListenSocket(t testing.TB, port int) {
	t.Helper()
	want := fmt.Sprintf(":%04X 00000000:0000 0A ", port)
	for deadline := time.Now().Add(startupWait); ; time.Sleep(20 * time.Millisecond) {
		var b []byte
		var err error
		e.side.NS.Do(t, func() { b, err = os.ReadFile("/proc/thread-self/net/tcp") })
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(b), want) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("nothing listens on port %d after %v", port, startupWait)
		}
	}
}

// blob is a payload and its digest.
type blob struct {
	data []byte
	sum  [32]byte
}

func newBlob(size int, seed uint64) blob {
	r := rand.New(rand.NewPCG(seed, seed^0x5eed))
	b := make([]byte, size)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return blob{data: b, sum: sha256.Sum256(b)}
}

// httpOrigin serves every request on the listener with the blob as an
// HTTP/1.0 response (then closes), reading the request with plain recv.
func httpOrigin(t *testing.T, ln *net.TCPListener, body blob) {
	testenv.Serve(ln, func(c *net.TCPConn) {
		c.SetDeadline(time.Now().Add(30 * time.Second))
		buf := make([]byte, 4096)
		var req []byte
		for !strings.Contains(string(req), "\r\n\r\n") {
			n, err := c.Read(buf)
			if err != nil {
				return
			}
			req = append(req, buf[:n]...)
		}
		fmt.Fprintf(c, "HTTP/1.0 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n", len(body.data))
		c.Write(body.data)
	})
}

// outcome of one download.
type outcome int

// tally counts downloads by outcome.
type tally [4]int

func (n tally) String() string {
	return fmt.Sprintf("%d intact, %d wrong, %d reset, %d hung", n[intact], n[wrong], n[reset], n[hung])
}

const (
	intact outcome = iota
	wrong          // bytes missing, extra or changed: never acceptable
	reset          // ended with an error (a connection the guard reset)
	hung           // no end within the deadline: never acceptable
)

// dialFor connects to addr from the env, for deadline from now.
func (e *env) dialFor(t *testing.T, addr string, deadline time.Duration) (net.Conn, error) {
	var c net.Conn
	var err error
	e.side.Make(t, func() { c, err = net.DialTimeout("tcp4", addr, 5*time.Second) })
	if err != nil {
		return nil, err
	}
	c.SetDeadline(time.Now().Add(deadline))
	return c, nil
}

// download fetches addr's blob over HTTP/1.0 from the env.
func (e *env) download(t *testing.T, addr string, body blob, deadline time.Duration) (outcome, string) {
	c, err := e.dialFor(t, addr, deadline)
	if err != nil {
		return reset, err.Error()
	}
	defer c.Close()
	if _, err := io.WriteString(c, "GET /blob HTTP/1.0\r\nHost: compat\r\n\r\n"); err != nil {
		return reset, err.Error()
	}
	got, err := io.ReadAll(c)
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		// While the connection is still open: which end waits.
		logState(t, e)
		return hung, fmt.Sprintf("no end after %v (%d bytes)", deadline, len(got))
	}
	if err != nil {
		return reset, err.Error()
	}
	i := strings.Index(string(got), "\r\n\r\n")
	if i < 0 {
		if len(got) == 0 {
			return reset, "closed before a response"
		}
		return wrong, fmt.Sprintf("no HTTP header in %d bytes", len(got))
	}
	got = got[i+4:]
	switch {
	case sha256.Sum256(got) == body.sum:
		return intact, ""
	case len(got) < len(body.data) && string(got) == string(body.data[:len(got)]):
		// Every byte right, and fewer than Content-Length said: the
		// client knows the response was cut short.
		return reset, fmt.Sprintf("cut short at %d of %d bytes (Content-Length tells)", len(got), len(body.data))
	}
	return wrong, fmt.Sprintf("body of %d bytes differs from the %d sent", len(got), len(body.data))
}

// smallSize is the size of an nginx origin's /small: the start of its blob.
const smallSize = 2048

// keptAliveAfter fetches addr's /small small times, then its blob n times,
// over one HTTP/1.1 connection from the env, and says how that ended (at
// the first fetch that did not end intact). A proxy in between reads the
// small responses whole with recv, whatever its splice mode: the
// connection's sockets are proven recv readers before the first large one.
func (e *env) keptAliveAfter(t *testing.T, addr string, body blob, small, n int, deadline time.Duration) (outcome, string) {
	c, err := e.dialFor(t, addr, deadline)
	if err != nil {
		return reset, err.Error()
	}
	defer c.Close()
	r := bufio.NewReader(c)
	for i := 0; i < small+n; i++ {
		path, want := "/blob", body
		if i < small {
			path = "/small"
			want = blob{data: body.data[:smallSize], sum: sha256.Sum256(body.data[:smallSize])}
		}
		if _, err := io.WriteString(c, "GET "+path+" HTTP/1.1\r\nHost: compat\r\n\r\n"); err != nil {
			return reset, fmt.Sprintf("fetch %d: %v", i, err)
		}
		resp, err := http.ReadResponse(r, nil)
		if err != nil {
			return e.ended(t, err, fmt.Sprintf("fetch %d: no response", i))
		}
		got, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			return e.ended(t, err, fmt.Sprintf("fetch %d: %d of %d bytes", i, len(got), len(want.data)))
		}
		if sha256.Sum256(got) != want.sum {
			return wrong, fmt.Sprintf("fetch %d: body of %d bytes differs from the %d sent", i, len(got), len(want.data))
		}
	}
	return intact, ""
}

// ended tells a read that hit the deadline (hung: the state is logged
// while the connection is still open) from one that failed.
func (e *env) ended(t *testing.T, err error, what string) (outcome, string) {
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		logState(t, e)
		return hung, what + ": no end before the deadline"
	}
	return reset, fmt.Sprintf("%s: %v", what, err)
}
