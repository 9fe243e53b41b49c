package compat_test

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/shunt-project/shunt/internal/testenv"
)

// nginxStreamModule is where Debian's libnginx-mod-stream puts the module.
const nginxStreamModule = "/usr/lib/nginx/modules/ngx_stream_module.so"

// nginx as a proxy in front of an nginx origin, every process in one enabled
// cgroup. nginx reads a full buffer, then asks FIONREAD how much is left and
// waits for the next edge-triggered event when told 0; on kernels whose
// FIONREAD misses bytes that came by TCP into a socket in the sockhash
// (6.18) or bytes that came by redirect (6.1), that event never came and the
// download hung for good. Through shunt every download must be whole, on
// fresh and on kept-alive upstream connections.
func TestNginxProxy(t *testing.T) {
	testenv.NeedProgram(t, "nginx")
	sizes := []int{1 << 10, 64 << 10, 1 << 20, 10 << 20}
	const rounds = 3
	for _, mode := range []string{"stream", "http", "http-keepalive"} {
		t.Run(mode, func(t *testing.T) {
			if _, err := os.Stat(nginxStreamModule); mode == "stream" && err != nil {
				t.Skipf("no nginx stream module (%s): install libnginx-mod-stream", nginxStreamModule)
			}
			for _, shunt := range []bool{false, true} {
				e := newEnv(t, shunt)
				for _, size := range sizes {
					body := newBlob(size, uint64(size))
					originAddr := nginxOrigin(t, e, body, true)
					addr := nginxProxy(t, e, mode, originAddr, -1)
					var counts tally
					for i := 0; i < rounds; i++ {
						o, why := e.download(t, addr, body, 15*time.Second)
						counts[o]++
						if o != intact {
							t.Errorf("shunt=%v %d bytes, download %d: %s", shunt, size, i, why)
							logState(t, e)
						}
					}
					t.Logf("shunt=%v %d bytes: %v", shunt, size, counts)
				}
				if !shunt {
					continue
				}
				st, err := e.in.Stats()
				if err != nil {
					t.Fatal(err)
				}
				t.Logf("paired %d, sockets left %d, stalls rescued %d", st.Counters.Paired, st.Counters.Left, st.Counters.StallsRescued)
				if st.Counters.Paired == 0 {
					t.Errorf("nothing was bypassed: the run compared TCP with TCP")
				}
			}
		})
	}
}

// nginxProxy starts nginx proxying to origin in mode: "stream" (the stream
// module), "http" (proxy_pass, a new upstream connection per request) or
// "http-keepalive" (HTTP/1.1 to the upstream, connections kept), on cpu
// (-1: not pinned), and returns where it listens.
func nginxProxy(t testing.TB, e *env, mode, origin string, cpu int) string {
	t.Helper()
	dir := t.TempDir()
	port := e.freePort(t)
	var body string
	switch mode {
	case "stream":
		body = fmt.Sprintf("stream { server { listen 127.0.0.1:%d; proxy_pass %s; } }", port, origin)
	case "http":
		body = fmt.Sprintf(`http {
	access_log off;
	proxy_temp_path %[1]s;
	client_body_temp_path %[1]s;
	server { listen 127.0.0.1:%[2]d; location / { proxy_pass http://%[3]s; } }
}`, dir, port, origin)
	case "http-keepalive":
		body = fmt.Sprintf(`http {
	access_log off;
	proxy_temp_path %[1]s;
	client_body_temp_path %[1]s;
	upstream origin { server %[3]s; keepalive 4; }
	server {
		listen 127.0.0.1:%[2]d;
		location / {
			proxy_pass http://origin;
			proxy_http_version 1.1;
			proxy_set_header Connection "";
		}
	}
}`, dir, port, origin)
	default:
		t.Fatalf("unknown nginx proxy mode %q", mode)
	}
	load := ""
	if mode == "stream" {
		load = "load_module " + nginxStreamModule + ";\n"
	}
	return runNginx(t, e, dir, port, cpu, load, body)
}

// runNginx writes an nginx configuration in dir (one worker in the
// foreground, logging to stderr, load lines first, then body: its http or
// stream block listening on port), starts nginx in the env on cpu (-1: not
// pinned) and returns where it listens.
func runNginx(t testing.TB, e *env, dir string, port, cpu int, load, body string) string {
	t.Helper()
	text := fmt.Sprintf(`%sdaemon off;
master_process off;
worker_processes 1;
pid %s/nginx.pid;
error_log stderr;
events { worker_connections 256; }
%s
`, load, dir, body)
	conf := filepath.Join(dir, "nginx.conf")
	if err := os.WriteFile(conf, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	argv := []string{"nginx", "-c", conf, "-p", dir, "-e", "stderr"}
	if cpu >= 0 {
		argv = pinned(cpu, argv...)
	}
	e.start(t, argv...)
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	e.waitListening(t, addr)
	return addr
}
