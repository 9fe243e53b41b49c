package compat_test

import (
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/internal/testenv"
)

// Apache 2.4 (mpm_event, mod_proxy_http) as a reverse proxy in front of
// lighttpd, which closes a kept-alive connection after 1 s idle. Apache
// keeps its connections to the origin in a pool nobody polls, so each one
// the origin closed sits with its end unread until Apache next takes it:
// as over TCP, that is no stall, and shunt must neither move nor count it
// (one wrk run counted 89 rescued stalls before). Downloads before and
// after the origin closed the pool come through whole.
func TestApacheProxyPool(t *testing.T) {
	testenv.NeedProgram(t, "apache2")
	testenv.NeedProgram(t, "lighttpd")
	testenv.NeedProgram(t, "curl")
	small, large := newBlob(1<<10, 31), newBlob(1500000, 32)
	bothWays(t, eitherPath, 0, func(t *testing.T, e *env) {
		dir := t.TempDir()
		originPort := startLighttpd(t, e, map[string][]byte{"small": small.data, "large": large.data}, "server.max-keep-alive-idle = 1\n")
		proxyPort := e.freePort(t)
		apache := filepath.Join(dir, "apache2.conf")
		writeFile(t, apache, []byte(fmt.Sprintf(`ServerRoot %[1]q
ServerName localhost
PidFile %[1]s/apache2.pid
ErrorLog %[1]s/apache2.err
Mutex file:%[1]s
LoadModule mpm_event_module /usr/lib/apache2/modules/mod_mpm_event.so
LoadModule authz_core_module /usr/lib/apache2/modules/mod_authz_core.so
LoadModule proxy_module /usr/lib/apache2/modules/mod_proxy.so
LoadModule proxy_http_module /usr/lib/apache2/modules/mod_proxy_http.so
Listen 127.0.0.1:%[2]d
User nobody
Group nogroup
ProxyPass "/" "http://127.0.0.1:%[3]d/"
`, dir, proxyPort, originPort)))
		e.start(t, "apache2", "-DFOREGROUND", "-f", apache)
		e.waitListening(t, fmt.Sprintf("127.0.0.1:%d", proxyPort))
		base := fmt.Sprintf("http://127.0.0.1:%d/", proxyPort)
		fetch := func(when string) {
			for _, b := range []struct {
				name string
				blob blob
			}{{"small", small}, {"large", large}} {
				for i, got := range e.curlGet(t, base+b.name, 4) {
					if got != b.blob.sum {
						t.Fatalf("%s, %s download %d: digest differs", when, b.name, i)
					}
				}
			}
		}
		fetch("first")
		// The origin closes the pool (idle for 1 s; lighttpd looks once a
		// second), then three of the stall scan's rounds pass.
		closed := ""
		for deadline := time.Now().Add(10 * time.Second); closed == "" && time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
			closed = strings.TrimSpace(e.run(t, "ss", "-Htn", "state", "close-wait", "dport", fmt.Sprint(originPort)))
		}
		if closed == "" {
			t.Fatal("the origin did not close Apache's pooled connections within 10 s")
		}
		time.Sleep(3*bypass.StallScanInterval + 200*time.Millisecond)
		fetch("after the origin closed the pool")
		if e.in == nil {
			return
		}
		st, err := e.in.Stats()
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("paired %d, stalls rescued %d, sockets back on TCP %d", st.Counters.Paired, st.Counters.StallsRescued, st.Counters.Left)
		if st.Counters.StallsRescued != 0 {
			t.Errorf("%d of Apache's idle pooled connections were taken for stalls", st.Counters.StallsRescued)
		}
	})
}
