package compat_test

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shunt-project/shunt/internal/testenv"
)

// phpFPMBinary is Debian 12's PHP FastCGI process manager.
const phpFPMBinary = "php-fpm8.2"

// PHP behind nginx over FastCGI on TCP, every process in one enabled
// cgroup: nginx opens a connection to php-fpm per request and reads it with
// its event loop; php-fpm's workers read their requests with blocking
// reads, so shunt keeps them on TCP (their port is learned) while the
// clients' connections to nginx are bypassed. Uploads PHP echoes back and
// downloads PHP sends must arrive whole, as over plain TCP.
func TestPHPFPMBehindNginx(t *testing.T) {
	testenv.NeedProgram(t, phpFPMBinary)
	testenv.NeedProgram(t, "nginx")
	body := newBlob(4<<20, 13)
	upload := newBlob(2<<20, 17)
	const rounds = 10
	for _, shunt := range []bool{false, true} {
		e := newEnv(t, shunt)
		fpm := fmt.Sprintf("127.0.0.1:%d", e.freePort(t))
		addr := nginxFastCGI(t, e, phpFPM(t, e, fpm, body, -1), -1)
		var counts tally
		for i := 0; i < rounds; i++ {
			o, why := e.download(t, addr, body, 20*time.Second)
			counts[o]++
			if o != intact {
				t.Logf("shunt=%v: download %d: %s", shunt, i, why)
			}
			o, why = e.echoUpload(t, addr, upload, 20*time.Second)
			counts[o]++
			if o != intact {
				t.Logf("shunt=%v: upload %d: %s", shunt, i, why)
			}
		}
		what := fmt.Sprintf("shunt=%v: %v", shunt, counts)
		t.Log(what)
		if counts[intact] != 2*rounds {
			t.Errorf("%s: every download and upload must arrive whole", what)
		}
		if !shunt {
			continue
		}
		st, err := e.in.Stats()
		if err != nil {
			t.Fatal(err)
		}
		c := st.Counters
		t.Logf("paired %d, kept for their reader %d, left unpaired for their port's reader %d, stalls rescued %d", c.Paired, c.TCPReaders, c.ReaderPort, c.StallsRescued)
		if c.Paired == 0 {
			t.Errorf("nothing was bypassed: the run compared TCP with TCP")
		}
	}
}

// echoUpload POSTs up to addr's /echo, which PHP sends back, over HTTP/1.0
// from the env, and says how that ended.
func (e *env) echoUpload(t *testing.T, addr string, up blob, deadline time.Duration) (outcome, string) {
	c, err := e.dialFor(t, addr, deadline)
	if err != nil {
		return reset, err.Error()
	}
	defer c.Close()
	head := fmt.Sprintf("POST /echo HTTP/1.0\r\nHost: compat\r\nContent-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n", len(up.data))
	if _, err := c.Write(append([]byte(head), up.data...)); err != nil {
		return reset, err.Error()
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return e.ended(t, err, "no response")
	}
	got, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		return e.ended(t, err, fmt.Sprintf("%d of %d bytes", len(got), len(up.data)))
	}
	if resp.StatusCode != http.StatusOK || !bytes.Equal(got, up.data) {
		return wrong, fmt.Sprintf("status %d, %d bytes back, not the %d sent", resp.StatusCode, len(got), len(up.data))
	}
	return intact, ""
}

// phpFPM runs php-fpm in the env with four static workers listening on
// listen (host:port, or a unix socket's path), serving /blob (body) and
// /echo (the request body back), and returns the directory of its scripts.
// cpu >= 0 pins it.
func phpFPM(t testing.TB, e *env, listen string, body blob, cpu int) fastCGI {
	t.Helper()
	dir := t.TempDir()
	files := map[string]string{
		"blob":     string(body.data),
		"blob.php": "<?php\nheader('Content-Type: application/octet-stream');\nreadfile(__DIR__ . '/blob');\n",
		"echo.php": "<?php\nheader('Content-Type: application/octet-stream');\necho file_get_contents('php://input');\n",
		// The master runs as root with -R; its workers too: the test's
		// directories are root's alone.
		"fpm.conf": fmt.Sprintf(`[global]
error_log = /proc/self/fd/2
daemonize = no
[www]
user = root
group = root
listen = %s
pm = static
pm.max_children = 4
`, listen),
	}
	for name, text := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	argv := []string{phpFPMBinary, "-F", "-R", "-y", filepath.Join(dir, "fpm.conf")}
	if cpu >= 0 {
		argv = pinned(cpu, argv...)
	}
	e.start(t, argv...)
	if strings.HasPrefix(listen, "/") {
		waitSocketFile(t, listen)
		listen = "unix:" + listen
	} else {
		e.waitListening(t, listen)
	}
	return fastCGI{upstream: listen, scripts: dir}
}

// fastCGI is where php-fpm listens (nginx's fastcgi_pass form) and where
// its scripts are.
type fastCGI struct {
	upstream, scripts string
}

// nginxFastCGI runs nginx in the env in front of php-fpm (a connection per
// request, as nginx's FastCGI module does by default) and returns where it
// listens: /blob and /echo run the scripts of the same names. cpu >= 0
// pins it.
func nginxFastCGI(t testing.TB, e *env, fpm fastCGI, cpu int) string {
	t.Helper()
	dir := t.TempDir()
	port := e.freePort(t)
	return runNginx(t, e, dir, port, cpu, "", fmt.Sprintf(`http {
	access_log off;
	client_max_body_size 64m;
	client_body_temp_path %[1]s;
	fastcgi_temp_path %[1]s;
	proxy_temp_path %[1]s;
	uwsgi_temp_path %[1]s;
	scgi_temp_path %[1]s;
	server {
		listen 127.0.0.1:%[2]d;
		location / {
			include /etc/nginx/fastcgi_params;
			fastcgi_param SCRIPT_FILENAME %[3]s$uri.php;
			fastcgi_pass %[4]s;
		}
	}
}`, dir, port, fpm.scripts, fpm.upstream))
}
