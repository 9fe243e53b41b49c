package compat_test

import (
	"fmt"
	"path/filepath"
	"testing"

	"github.com/shunt-project/shunt/internal/testenv"
)

// Squid 5 as a forward proxy (no cache) in front of nginx: curl asks
// through it for plain HTTP (on one kept-alive connection, so Squid reuses
// its server connection too) and through a CONNECT tunnel. Squid reads
// without blocking after epoll on both sides; every byte arrives, and less
// than half of them cross IP.
func TestSquidForwardProxy(t *testing.T) {
	testenv.NeedProgram(t, "squid")
	testenv.NeedProgram(t, "curl")
	body := newBlob(4<<20, 23)
	bothWays(t, redirected, 0, func(t *testing.T, e *env) {
		dir := t.TempDir()
		origin := nginxOrigin(t, e, body, true)
		port := e.freePort(t)
		conf := filepath.Join(dir, "squid.conf")
		writeFile(t, conf, []byte(fmt.Sprintf(`http_port 127.0.0.1:%d
http_access allow localhost
http_access deny all
cache deny all
cache_mem 8 MB
access_log none
cache_log stdio:%s
pid_filename none
coredump_dir %s
workers 1
pinger_enable off
shutdown_lifetime 0 seconds
`, port, filepath.Join(dir, "cache.log"), dir)))
		e.start(t, "squid", "-N", "-f", conf)
		e.waitListenSocket(t, port)
		url, proxy := fmt.Sprintf("http://%s/blob", origin), fmt.Sprintf("http://127.0.0.1:%d", port)
		for _, how := range [][]string{{"-x", proxy}, {"-x", proxy, "--proxytunnel"}} {
			for i, got := range e.curlGet(t, url, 5, how...) {
				if got != body.sum {
					t.Fatalf("download %d %v: digest differs", i, how)
				}
			}
		}
	})
}
