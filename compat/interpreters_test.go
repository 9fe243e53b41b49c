package compat_test

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/shunt-project/shunt/internal/testenv"
)

// spliceScript reads a 4-byte header with recv, then echoes the rest of
// the connection with splice(2) through a pipe, as a proxy that splices
// after reading its header does.
const spliceScript = `import os, socket, sys
l = socket.create_server(("127.0.0.1", int(sys.argv[1])))
while True:
    c, _ = l.accept()
    c.settimeout(10)
    head = c.recv(4)
    c.setblocking(True)
    r, w = os.pipe()
    while True:
        n = os.splice(c.fileno(), w, 65536)
        if n == 0:
            break
        while n:
            n -= os.splice(r, c.fileno(), n)
    c.close()
`

// echoScript is an event-loop style echo server: sockets with a timeout
// read without blocking, as asyncio and most Python servers do.
const echoScript = `import socket, sys
l = socket.create_server(("127.0.0.1", int(sys.argv[1])))
while True:
    c, _ = l.accept()
    c.settimeout(10)
    while True:
        b = c.recv(65536)
        if not b:
            break
        c.sendall(b)
    c.close()
`

// One Python script that splices must not keep every other Python program
// on TCP: shunt learns a program by its command line, not by the
// interpreter's name. The event-loop echo server started after the splicer
// was learned stays bypassed; a second copy of the splicing script is
// known as learned from its first recv.
func TestSplicingScriptLeavesOtherScriptsBypassed(t *testing.T) {
	testenv.NeedProgram(t, "python3")
	e := newEnv(t, true)
	dir := t.TempDir()
	splicer, echo := filepath.Join(dir, "splicer.py"), filepath.Join(dir, "echo.py")
	for path, text := range map[string]string{splicer: spliceScript, echo: echoScript} {
		if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	spliceRound := func(addr string) {
		t.Helper()
		// The splicer may be caught and reset on its first connection
		// (redirected bytes queued before it spliced): that is the one
		// failure learning allows.
		if err := echoOnce(t, e, addr, "HEAD", strings.Repeat("spliced ", 4096)); err != nil {
			t.Logf("splicer's connection: %v", err)
		}
	}

	port := e.freePort(t)
	pid := e.start(t, "python3", splicer, fmt.Sprint(port))
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	e.waitListening(t, addr)
	spliceRound(addr)
	progs, err := e.in.SplicePrograms()
	if err != nil {
		t.Fatal(err)
	}
	if len(progs) != 1 || progs[0].Command != "python3" || !strings.Contains(progs[0].CommandLine, filepath.Base(splicer)) || progs[0].ByName || !slices.Contains(progs[0].PIDs, pid) {
		t.Fatalf("learned %+v: want python3 %s, pid %d, by command line", progs, splicer, pid)
	}

	echoPort := e.freePort(t)
	e.start(t, "python3", echo, fmt.Sprint(echoPort))
	echoAddr := fmt.Sprintf("127.0.0.1:%d", echoPort)
	e.waitListening(t, echoAddr)
	before, err := e.in.Stats()
	if err != nil {
		t.Fatal(err)
	}
	c := e.dial(t, echoAddr)
	c.SetDeadline(time.Now().Add(20 * time.Second))
	for i := 0; i < 20; i++ {
		msg := fmt.Sprintf("message %d %s", i, strings.Repeat("x", 1000))
		if _, err := io.WriteString(c, msg); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, len(msg))
		if _, err := io.ReadFull(c, got); err != nil || string(got) != msg {
			t.Fatalf("echo %d: %q, %v", i, got, err)
		}
	}
	after, err := e.in.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if n := after.Counters.LearnedReaders - before.Counters.LearnedReaders; n != 0 {
		t.Errorf("%d readers of the echo script were kept on TCP as a learned splicer's", n)
	}
	flows, err := e.in.Flows()
	if err != nil {
		t.Fatal(err)
	}
	bypassed := false
	for _, f := range flows {
		if f.Client != nil && f.Server != nil && f.Client.Addr.String() == c.LocalAddr().String() {
			bypassed = f.Client.TxBytes > 0 && f.Server.TxBytes > 0
			t.Logf("echo connection: %d bytes redirected up, %d down; readers %s/%s", f.Client.TxBytes, f.Server.TxBytes, f.Client.Reader, f.Server.Reader)
		}
	}
	if !bypassed {
		t.Errorf("the echo script's connection is not bypassed both ways (flows %+v)", flows)
	}
	c.Close()

	// The splicing script again, as a second process: learned already.
	port2 := e.freePort(t)
	e.start(t, "python3", splicer, fmt.Sprint(port2))
	addr2 := fmt.Sprintf("127.0.0.1:%d", port2)
	e.waitListening(t, addr2)
	if err := echoOnce(t, e, addr2, "HEAD", strings.Repeat("spliced ", 4096)); err != nil {
		t.Errorf("the learned splicer's connection: %v", err)
	}
	last, err := e.in.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if last.Counters.LearnedReaders == after.Counters.LearnedReaders {
		t.Errorf("the second copy of the splicing script was not known as learned (counters %+v)", last.Counters)
	}
}

// echoOnce sends head and body to a server that echoes what follows its
// header, and checks body comes back.
func echoOnce(t *testing.T, e *env, addr, head, body string) error {
	var c net.Conn
	var err error
	e.side.Make(t, func() { c, err = net.DialTimeout("tcp4", addr, 5*time.Second) })
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, head+body); err != nil {
		return err
	}
	got := make([]byte, len(body))
	if _, err := io.ReadFull(c, got); err != nil {
		return err
	}
	if string(got) != body {
		return fmt.Errorf("echo differs")
	}
	return nil
}

// javaOrigin is an HTTP/1.1 server on the JDK's own com.sun.net.httpserver
// (blocking streams over its worker threads) that serves the file
// args[1] at /blob on 127.0.0.1:args[0].
const javaOrigin = `import com.sun.net.httpserver.HttpServer;
import java.io.OutputStream;
import java.net.InetSocketAddress;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.concurrent.Executors;

public class Origin {
    public static void main(String[] args) throws Exception {
        byte[] blob = Files.readAllBytes(Path.of(args[1]));
        HttpServer s = HttpServer.create(new InetSocketAddress("127.0.0.1", Integer.parseInt(args[0])), 64);
        s.createContext("/blob", ex -> {
            ex.sendResponseHeaders(200, blob.length);
            try (OutputStream o = ex.getResponseBody()) {
                o.write(blob);
            }
        });
        s.setExecutor(Executors.newFixedThreadPool(4));
        s.start();
    }
}
`

// nodeProxy forwards every request on 127.0.0.1:argv[2] to the origin on
// 127.0.0.1:argv[3] over kept-alive upstream connections, piping both
// bodies (libuv's event loop: non-blocking reads until EAGAIN).
const nodeProxy = `const http = require('http');
const [port, upstream] = process.argv.slice(2).map(Number);
const agent = new http.Agent({ keepAlive: true, maxSockets: 4 });
http.createServer((req, res) => {
  const up = http.request({ host: '127.0.0.1', port: upstream, path: req.url, method: req.method, headers: req.headers, agent }, (ur) => {
    res.writeHead(ur.statusCode, ur.headers);
    ur.pipe(res);
  });
  up.on('error', (e) => { res.writeHead(502); res.end(String(e)); });
  req.pipe(up);
}).listen(port, '127.0.0.1');
`

// Node's http module as a reverse proxy in front of a Java origin (the
// JDK's HTTP server): two runtimes no other test names, an event loop that
// reads until EAGAIN and a server that reads with blocking streams. 10
// downloads of 4 MiB through the proxy on one kept-alive client connection,
// then 10 straight from the origin: every one intact; the client's side of
// the proxy bypassed, the origin's ports on TCP once Java was seen blocking.
func TestNodeProxyInFrontOfJava(t *testing.T) {
	testenv.NeedProgram(t, "node")
	testenv.NeedProgram(t, "java")
	testenv.NeedProgram(t, "curl")
	body := newBlob(4<<20, 17)
	dir := t.TempDir()
	for name, text := range map[string]string{"Origin.java": javaOrigin, "proxy.js": nodeProxy} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	blobFile := filepath.Join(dir, "blob")
	if err := os.WriteFile(blobFile, body.data, 0o644); err != nil {
		t.Fatal(err)
	}
	bothWays(t, eitherPath, 0, func(t *testing.T, e *env) {
		originPort, proxyPort := e.freePort(t), e.freePort(t)
		// The JDK runs a single source file without javac.
		e.start(t, "java", filepath.Join(dir, "Origin.java"), fmt.Sprint(originPort), blobFile)
		e.start(t, "node", filepath.Join(dir, "proxy.js"), fmt.Sprint(proxyPort), fmt.Sprint(originPort))
		for _, port := range []int{originPort, proxyPort} {
			e.waitListening(t, fmt.Sprintf("127.0.0.1:%d", port))
		}
		for _, port := range []int{proxyPort, originPort} {
			for i, got := range e.curlGet(t, fmt.Sprintf("http://127.0.0.1:%d/blob", port), 10) {
				if got != body.sum {
					t.Fatalf("download %d from port %d: digest differs", i, port)
				}
			}
		}
	})
}

// javaPoller is a Java program that answers itself over loopback and
// reads each answer the way old Java code does: InputStream.available()
// in a loop, sleeping a millisecond while told 0, reading exactly what it
// was told. Its sockets have a read timeout, so the JDK reads without
// blocking (the connection can be bypassed). args[0] answers of args[1]
// bytes; exit 1 when an answer does not come within 10 s or differs.
const javaPoller = `import java.io.*;
import java.net.*;

public class Poller {
    public static void main(String[] args) throws Exception {
        int rounds = Integer.parseInt(args[0]), size = Integer.parseInt(args[1]);
        ServerSocket ss = new ServerSocket(0, 50, InetAddress.getLoopbackAddress());
        Thread server = new Thread(() -> {
            try (Socket s = ss.accept()) {
                s.setSoTimeout(30000);
                OutputStream out = s.getOutputStream();
                InputStream in = s.getInputStream();
                byte[] answer = new byte[size];
                for (int r = 0; r < rounds; r++) {
                    for (int k = 0; k < size; k++) answer[k] = (byte) (k * 7 + r);
                    out.write(answer);
                    out.flush();
                    in.read(); // the client's next request
                }
            } catch (IOException e) {
                e.printStackTrace();
            }
        });
        server.setDaemon(true);
        server.start();
        Socket c = new Socket(InetAddress.getLoopbackAddress(), ss.getLocalPort());
        c.setSoTimeout(30000);
        InputStream in = c.getInputStream();
        OutputStream out = c.getOutputStream();
        byte[] buf = new byte[size];
        for (int r = 0; r < rounds; r++) {
            long start = System.nanoTime();
            int got = 0;
            while (got < size) {
                int n = in.available();
                if (n == 0) {
                    if (System.nanoTime() - start > 10_000_000_000L) {
                        System.out.println("stalled in answer " + r + " after " + got + " bytes");
                        System.exit(1);
                    }
                    Thread.sleep(1);
                    continue;
                }
                int k = in.read(buf, got, Math.min(n, size - got));
                for (int i = got; i < got + k; i++) {
                    if (buf[i] != (byte) (i * 7 + r)) {
                        System.out.println("answer " + r + " differs at byte " + i);
                        System.exit(1);
                    }
                }
                got += k;
            }
            System.out.println("answer " + r + ": " + got + " bytes in " + (System.nanoTime() - start) / 1_000_000 + " ms");
            out.write(1);
            out.flush();
        }
    }
}
`

// A Java program that reads only what InputStream.available() (FIONREAD)
// announces and sleeps while told 0: no readiness wait, so no edge can wake
// it. On 6.1 it waited for ever for its second answer (redirected bytes,
// which the kernel's FIONREAD leaves out) until shunt corrected FIONREAD;
// under lockdown on 6.18 each connection's first answer (by TCP, which
// 6.18.44 leaves out) waits for the stall scan, then the connection is on
// TCP. Every answer must come whole within 3 s.
func TestJavaAvailablePoller(t *testing.T) {
	testenv.NeedProgram(t, "java")
	src := filepath.Join(t.TempDir(), "Poller.java")
	if err := os.WriteFile(src, []byte(javaPoller), 0o644); err != nil {
		t.Fatal(err)
	}
	bothWays(t, eitherPath, 0, func(t *testing.T, e *env) {
		var out []byte
		var err error
		for attempt := 1; ; attempt++ {
			cmd, done := e.command(t, "java", src, "4", "300000")
			out, err = cmd.CombinedOutput()
			done()
			t.Logf("%s", out)
			// The JVM's JIT crashes now and then under qemu without KVM
			// (SIGSEGV in compiled code while it reads its own modules,
			// before any socket: seen in 1 of 10 runs on 6.1, and in the
			// plain run too). That is not the program's behaviour through
			// shunt: run it again.
			if err == nil || !bytes.Contains(out, []byte("A fatal error has been detected by the Java Runtime Environment")) || attempt == 3 {
				break
			}
			t.Logf("the JVM crashed (attempt %d): running it again", attempt)
		}
		if err != nil {
			logState(t, e)
			t.Fatalf("the poller failed: %v", err)
		}
		if e.in == nil {
			return // plain TCP: the baseline (a cold JVM under qemu is slow)
		}
		for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
			var r, n, ms int
			if _, err := fmt.Sscanf(line, "answer %d: %d bytes in %d ms", &r, &n, &ms); err == nil && ms > 3000 {
				t.Errorf("answer %d took %d ms: the reader waited on a stall", r, ms)
			}
		}
	})
}

// TestTinyproxyInFrontOfLighttpd: tinyproxy, a forward proxy that reads
// with blocking calls, in front of lighttpd, an event-loop server; curl
// asks through it for plain HTTP and for a CONNECT tunnel, then lighttpd
// straight. tinyproxy's directions go back to TCP, its port is learned and
// so is tinyproxy as a client of lighttpd's port (a connection per request,
// read with blocking calls); every byte arrives.
func TestTinyproxyInFrontOfLighttpd(t *testing.T) {
	testenv.NeedProgram(t, "tinyproxy")
	testenv.NeedProgram(t, "lighttpd")
	testenv.NeedProgram(t, "curl")
	body := newBlob(4<<20, 19)
	// curl straight to lighttpd is bypassed (both read until EAGAIN).
	bothWays(t, eitherPath, 0, func(t *testing.T, e *env) {
		dir := t.TempDir()
		originPort := startLighttpd(t, e, map[string][]byte{"blob": body.data}, "")
		proxyPort := e.freePort(t)
		tinyproxy := filepath.Join(dir, "tinyproxy.conf")
		writeFile(t, tinyproxy, []byte(fmt.Sprintf(`Listen 127.0.0.1
Port %d
Allow 127.0.0.1
ConnectPort %d
Timeout 60
MaxClients 20
LogFile %q
`, proxyPort, originPort, filepath.Join(dir, "tinyproxy.log"))))
		e.start(t, "tinyproxy", "-d", "-c", tinyproxy)
		e.waitListening(t, fmt.Sprintf("127.0.0.1:%d", proxyPort))
		url, proxy := fmt.Sprintf("http://127.0.0.1:%d/blob", originPort), fmt.Sprintf("http://127.0.0.1:%d", proxyPort)
		for _, how := range [][]string{{"-x", proxy}, {"-x", proxy, "--proxytunnel"}, nil} {
			for i, got := range e.curlGet(t, url, 5, how...) {
				if got != body.sum {
					t.Fatalf("download %d %v: digest differs", i, how)
				}
			}
		}
		if e.in == nil {
			return
		}
		// Paired and taken out again, each upstream connection after
		// the first two cost more than plain TCP.
		st, err := e.in.Stats()
		if err != nil {
			t.Fatal(err)
		}
		if st.Counters.ReaderClient == 0 {
			t.Errorf("no upstream connection of tinyproxy was left unpaired (reader ports %+v)", st.ReaderPorts)
		}
	})
}

// startLighttpd serves files (name: content) with lighttpd 1.4 in the env
// on a free port, with extra configuration lines, and returns the port.
func startLighttpd(t *testing.T, e *env, files map[string][]byte, extra string) int {
	t.Helper()
	dir := t.TempDir()
	www := filepath.Join(dir, "www")
	if err := os.MkdirAll(www, 0o755); err != nil {
		t.Fatal(err)
	}
	for name, b := range files {
		writeFile(t, filepath.Join(www, name), b)
	}
	port := e.freePort(t)
	conf := filepath.Join(dir, "lighttpd.conf")
	writeFile(t, conf, []byte(fmt.Sprintf(`server.document-root = %q
server.bind = "127.0.0.1"
server.port = %d
server.errorlog = %q
%s`, www, port, filepath.Join(dir, "lighttpd.err"), extra)))
	t.Cleanup(func() {
		// Why it stopped, or what it met (it logs to its file alone).
		if b, err := os.ReadFile(filepath.Join(dir, "lighttpd.err")); t.Failed() && err == nil {
			t.Logf("lighttpd's error log (last 4 KiB):\n%s", b[max(0, len(b)-4096):])
		}
	})
	e.start(t, "lighttpd", "-D", "-f", conf)
	e.waitListening(t, fmt.Sprintf("127.0.0.1:%d", port))
	return port
}

// writeFile writes b to path, making its directory.
func writeFile(t testing.TB, path string, b []byte) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}
