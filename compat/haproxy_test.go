package compat_test

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
)

// origin serves body at /blob on 127.0.0.1 in the env and returns where:
// "go" (a recv-and-write server of the test's) or "nginx" (sendfile on, as
// shipped).
func origin(t *testing.T, e *env, kind string, body blob) string {
	t.Helper()
	if kind == "go" {
		ln := e.listen(t)
		httpOrigin(t, ln, body)
		return ln.Addr().String()
	}
	return nginxOrigin(t, e, body, true)
}

// nginxOrigin serves body at /blob with nginx (as shipped: sendfile on,
// unless told otherwise) and returns where.
func nginxOrigin(t testing.TB, e *env, body blob, sendfile bool) string {
	return nginxOriginWith(t, e, body, nginxSetup{sendfile: sendfile, cpu: -1})
}

// nginxSetup is what a test changes in nginx's configuration.
type nginxSetup struct {
	sendfile bool
	cpu      int // -1: not pinned
	// keepaliveRequests is how many requests nginx serves on a connection
	// before it closes it; 0 leaves nginx's default (1,000).
	keepaliveRequests int
	// kernelTLS serves HTTPS (a self-signed certificate) with OpenSSL's
	// KTLS option on: nginx asks the kernel for TLS after each handshake.
	kernelTLS bool
}

func nginxOriginWith(t testing.TB, e *env, body blob, s nginxSetup) string {
	t.Helper()
	testenv.NeedProgram(t, "nginx")
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "blob"), body.data, 0o644); err != nil {
		t.Fatal(err)
	}
	// /small: a response HAProxy reads with recv whatever its splice mode.
	if err := os.WriteFile(filepath.Join(dir, "small"), body.data[:min(len(body.data), smallSize)], 0o644); err != nil {
		t.Fatal(err)
	}
	port := e.freePort(t)
	onOff := map[bool]string{true: "on", false: "off"}[s.sendfile]
	keepalive := ""
	if s.keepaliveRequests > 0 {
		keepalive = fmt.Sprintf("keepalive_requests %d;", s.keepaliveRequests)
	}
	listen := fmt.Sprintf("listen 127.0.0.1:%d;", port)
	if s.kernelTLS {
		cert, key := selfSigned(t, dir)
		listen = fmt.Sprintf("listen 127.0.0.1:%d ssl; ssl_certificate %s; ssl_certificate_key %s; ssl_conf_command Options KTLS;", port, cert, key)
	}
	return runNginx(t, e, dir, port, s.cpu, "", fmt.Sprintf(`http {
	access_log off;
	sendfile %[3]s;
	%[4]s
	client_body_temp_path %[1]s;
	proxy_temp_path %[1]s;
	fastcgi_temp_path %[1]s;
	uwsgi_temp_path %[1]s;
	scgi_temp_path %[1]s;
	server {
		%[2]s
		root %[1]s;
	}
}`, dir, listen, onOff, keepalive))
}

// HAProxy in front of an HTTP origin, every process in one enabled cgroup:
// with splice on, HAProxy reads with recv and then splices, which cannot
// read bytes shunt redirected. Through shunt no download may hang or come
// back wrong; a connection caught that way is reset (one at most: the
// program is learned at its first splice), and every other is intact.
func TestHAProxy(t *testing.T) {
	testenv.NeedProgram(t, "haproxy")
	body := newBlob(8<<20, 7)
	const downloads = 12
	for _, kind := range []string{"go", "nginx"} {
		for _, mode := range []struct{ name, mode, splice string }{
			{"tcp/splice-auto", "tcp", "option splice-auto"},
			{"tcp/no-splice", "tcp", ""},
			{"http/splice-auto", "http", "option splice-auto"},
			{"http/splice-request", "http", "option splice-request"},
			{"http/splice-response", "http", "option splice-response"},
			{"http/no-splice", "http", ""},
		} {
			t.Run(kind+"/"+mode.name, func(t *testing.T) {
				for _, setup := range haproxySetups() {
					shunt := setup.shunt
					e := newEnv(t, false)
					if shunt {
						e = newEnvWith(t, bypass.Options{RefuseSplice: setup.refuse})
					}
					addr := e.haproxy(t, mode.mode, mode.splice, origin(t, e, kind, body))
					var counts tally
					for i := 0; i < downloads; i++ {
						o, why := e.download(t, addr, body, 10*time.Second)
						counts[o]++
						if o != intact {
							t.Logf("%s: download %d: %s", setup.name, i, why)
						}
					}
					what := fmt.Sprintf("%s: %v", setup.name, counts)
					t.Log(what)
					if counts[wrong] > 0 || counts[hung] > 0 {
						t.Errorf("%s: a download may never hang or come back wrong", what)
					}
					if !shunt {
						if counts[intact] != downloads {
							t.Errorf("%s: plain TCP must deliver every download", what)
						}
						continue
					}
					st, err := e.in.Stats()
					if err != nil {
						t.Fatal(err)
					}
					t.Logf("paired %d, splices refused %d (%d let through after one), splice readers %d, caught %d, learned readers %d, programs %+v", st.Counters.Paired,
						st.Counters.SplicesRefused, st.Counters.SplicesRetried, st.Counters.SpliceReaders, st.Counters.SpliceCaught, st.Counters.LearnedReaders, st.SplicePrograms)
					if st.Counters.Paired == 0 {
						t.Errorf("nothing was bypassed: the run compared TCP with TCP")
					}
					for _, p := range st.SplicePrograms {
						if p.Command != "haproxy" {
							t.Errorf("learned %+v: only haproxy splices here (a catch reported before the splice watch noted its splicer learned an empty program)", p)
						}
					}
					// HAProxy is learned at its first splice: one download
					// at most can be caught, whichever it splices first. With
					// splices refused, HAProxy 2.6 splices again without
					// reading, which is let through and handled the same way
					// (before, every download hung on the refusal).
					if counts[reset] > int(st.Counters.SpliceCaught) || counts[reset] > 1 {
						t.Errorf("%s: every reset must be a caught splice reader (%d caught), one at most", what, st.Counters.SpliceCaught)
					}
				}
			})
		}
	}
}

type haproxySetup struct {
	name          string
	shunt, refuse bool
}

// haproxySetups: plain TCP, shunt, and where the kernel runs BPF LSM
// programs shunt with --refuse-splice.
func haproxySetups() []haproxySetup {
	s := []haproxySetup{{name: "plain"}, {name: "shunt", shunt: true}}
	if host.CanRefuseSplice() {
		s = append(s, haproxySetup{name: "shunt, splices refused", shunt: true, refuse: true})
	}
	return s
}

// HAProxy splicing 20 downloads at once, every process in one enabled
// cgroup, before it was ever seen splicing: its first splice from a socket
// holding redirected bytes is caught (that download is reset) and teaches
// the program, and its other connections must not be caught one after
// another: those with nothing redirected queued go back to TCP before the
// origin's next bytes, those with some queued keep their redirect until
// HAProxy has read what is queued. At most one download may fail.
func TestHAProxyConcurrentDownloadsBeforeLearned(t *testing.T) {
	testenv.NeedProgram(t, "haproxy")
	body := newBlob(1<<20, 11)
	const clients, each = 20, 3
	for _, mode := range []struct{ name, mode, splice string }{
		{"http/splice-auto", "http", "option splice-auto"},
		{"http/splice-response", "http", "option splice-response"},
		{"tcp/splice-auto", "tcp", "option splice-auto"},
	} {
		t.Run(mode.name, func(t *testing.T) {
			e := newEnv(t, true)
			addr := e.haproxy(t, mode.mode, mode.splice, nginxOrigin(t, e, body, true))
			counts := fetchAll(t, clients, each, func() (outcome, string) {
				return e.keptAliveAfter(t, addr, body, 3, each, 20*time.Second)
			})
			st, err := e.in.Stats()
			if err != nil {
				t.Fatal(err)
			}
			what := counts.String()
			t.Logf("%s; paired %d, splice readers %d, caught %d, learned readers %d, presumed splicers %d (%d with bytes queued)",
				what, st.Counters.Paired, st.Counters.SpliceReaders, st.Counters.SpliceCaught, st.Counters.LearnedReaders,
				st.Counters.PresumedSplicers, st.Counters.PresumedQueued)
			if counts[wrong] > 0 || counts[hung] > 0 {
				t.Errorf("%s: a download may never hang or come back wrong", what)
			}
			if st.Counters.Paired == 0 {
				t.Errorf("nothing was bypassed: the run compared TCP with TCP")
			}
			// The first caught connection teaches HAProxy; after that only a
			// connection that held redirected bytes at that moment may be
			// caught (no hook runs before splice(2) reads on these kernels).
			if counts[reset] > int(st.Counters.SpliceCaught) || counts[reset] > 1+int(st.Counters.PresumedQueued) {
				t.Errorf("%s: every reset must be a caught splice reader (%d caught), one at most besides connections holding redirected bytes when HAProxy was learned (%d)",
					what, st.Counters.SpliceCaught, st.Counters.PresumedQueued)
			}
		})
	}
}

// haproxy runs HAProxy in the env in front of origin (haproxyConf) and
// returns where it listens.
func (e *env) haproxy(t *testing.T, mode, splice, origin string) string {
	t.Helper()
	port := e.freePort(t)
	e.start(t, "haproxy", "-db", "-f", haproxyConf(t, mode, splice, port, origin))
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	e.waitListening(t, addr)
	return addr
}

// haproxyConf writes a one-thread HAProxy configuration that listens on
// port and forwards to origin in mode (tcp or http), with splice (an option
// line, or "") and returns its path.
func haproxyConf(t testing.TB, mode, splice string, port int, origin string) string {
	t.Helper()
	conf := filepath.Join(t.TempDir(), "haproxy.cfg")
	text := fmt.Sprintf(`global
	nbthread 1
	maxconn 100
defaults
	mode %s
	%s
	timeout connect 5s
	timeout client 30s
	timeout server 30s
listen compat
	bind 127.0.0.1:%d
	server origin %s
`, mode, splice, port, origin)
	if err := os.WriteFile(conf, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	return conf
}
