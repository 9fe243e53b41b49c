package compat_test

import (
	"bufio"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shunt-project/shunt/internal/testenv"
)

// selfSigned writes a certificate for 127.0.0.1 and its key into dir.
func selfSigned(t testing.TB, dir string) (certFile, keyFile string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: "compat"},
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	for f, b := range map[string]*pem.Block{certFile: {Type: "CERTIFICATE", Bytes: der}, keyFile: {Type: "EC PRIVATE KEY", Bytes: keyDER}} {
		if err := os.WriteFile(f, pem.EncodeToMemory(b), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return certFile, keyFile
}

// httpsClient is one kept-alive HTTPS connection.
type httpsClient struct {
	c *tls.Conn
	r *bufio.Reader
}

// dialHTTPS connects to addr from side, for deadline from now, and
// closes the connection when the test ends.
func dialHTTPS(t *testing.T, side testenv.Side, addr string, deadline time.Duration) (*httpsClient, error) {
	var raw net.Conn
	var err error
	side.Make(t, func() { raw, err = net.DialTimeout("tcp4", addr, 5*time.Second) })
	if err != nil {
		return nil, err
	}
	raw.SetDeadline(time.Now().Add(deadline))
	c := tls.Client(raw, &tls.Config{InsecureSkipVerify: true})
	t.Cleanup(func() { c.Close() })
	return &httpsClient{c: c, r: bufio.NewReader(c)}, nil
}

// fetch gets /blob and says how that ended.
func (h *httpsClient) fetch(t *testing.T, e *env, body blob) (outcome, string) {
	if _, err := io.WriteString(h.c, "GET /blob HTTP/1.1\r\nHost: compat\r\n\r\n"); err != nil {
		return reset, err.Error()
	}
	resp, err := http.ReadResponse(h.r, nil)
	if err != nil {
		return e.ended(t, err, "no response")
	}
	got, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		return e.ended(t, err, fmt.Sprintf("%d of %d bytes", len(got), len(body.data)))
	}
	if sha256.Sum256(got) != body.sum {
		return wrong, fmt.Sprintf("body of %d bytes differs from the %d sent", len(got), len(body.data))
	}
	return intact, ""
}

// nginx serving HTTPS with OpenSSL's KTLS option: after each handshake it
// puts the kernel's TLS layer on the socket (setsockopt TCP_ULP) and hands
// it the keys. The kernel takes no keys on a socket in a sockhash, and
// before shunt refused the layer on bypassed sockets, one client off the
// bypass was enough to leave a bypassed client's next request unread for
// good: the layer's operations, rebuilt from the last socket that put it
// on, read plain TCP's queue, not the psock's (6.12 under qemu, by hand:
// the first bypassed download hung, curl gave up after 15 s). A bypassed
// client fetches, one off the bypass (the same namespace, a cgroup not
// enabled) fetches, the bypassed one fetches again on its connection.
func TestNginxKernelTLS(t *testing.T) {
	body := newBlob(4<<20, 7)
	for _, shunt := range []bool{false, true} {
		t.Run(map[bool]string{false: "plain", true: "shunt"}[shunt], func(t *testing.T) {
			e := newEnv(t, shunt)
			addr := nginxOriginWith(t, e, body, nginxSetup{sendfile: true, cpu: -1, kernelTLS: true})
			off := testenv.Side{NS: e.side.NS, CG: testenv.MustCgroup(t)}
			in, err := dialHTTPS(t, e.side, addr, 30*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			if o, why := in.fetch(t, e, body); o != intact {
				t.Fatalf("the client in the enabled cgroup, first fetch: %s", why)
			}
			out, err := dialHTTPS(t, off, addr, 15*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			if o, why := out.fetch(t, e, body); o != intact {
				t.Errorf("the client off the bypass: %s", why)
			}
			t.Logf("kernel TLS in the namespace: %s", kernelTLSCounts(t, e))
			for i := range 2 {
				if o, why := in.fetch(t, e, body); o != intact {
					t.Fatalf("the client in the enabled cgroup, fetch %d after the other client's: %s", i+2, why)
				}
			}
			if !shunt {
				return
			}
			st, err := e.in.Stats()
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("paired %d, TCP_ULP refused %d", st.Counters.Paired, st.Counters.ULPRefused)
			if st.Counters.Paired == 0 || st.Counters.ULPRefused == 0 {
				t.Errorf("paired %d, TCP_ULP refused %d: want both above 0 (nginx asked for kernel TLS on a bypassed socket)", st.Counters.Paired, st.Counters.ULPRefused)
			}
		})
	}
}

// kernelTLSCounts is the kernel's count of TLS sockets in the env's
// namespace that have their keys (software TLS, sending and receiving), or
// why there is none.
func kernelTLSCounts(t *testing.T, e *env) string {
	var b []byte
	var err error
	e.side.NS.Do(t, func() { b, err = os.ReadFile("/proc/thread-self/net/tls_stat") })
	if err != nil {
		return "none (" + err.Error() + ")"
	}
	var tx, rx int
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) != 2 {
			continue
		}
		switch f[0] {
		case "TlsTxSw":
			fmt.Sscan(f[1], &tx)
		case "TlsRxSw":
			fmt.Sscan(f[1], &rx)
		}
	}
	return fmt.Sprintf("%d sending, %d receiving", tx, rx)
}
