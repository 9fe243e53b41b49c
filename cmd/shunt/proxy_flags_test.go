package main

import (
	"strings"
	"testing"
	"time"

	"github.com/shunt-project/shunt/proxy"
)

// proxy's flags are checked before anything is made, each error naming the
// flag to fix; good ones make the configuration they say.
func TestProxyFlags(t *testing.T) {
	good := proxyFlags{listen: "127.0.0.1:8080", upstreams: "127.0.0.1:9000", mode: "kernel",
		proxyProto: "none", maxInflight: "4M", maxConns: 10000, idle: time.Minute}
	for _, tc := range []struct {
		name string
		edit func(*proxyFlags)
		want string // "" for success
	}{
		{"defaults", func(*proxyFlags) {}, ""},
		{"no listen", func(f *proxyFlags) { f.listen = "" }, "--listen and --upstream are required"},
		{"no upstream", func(f *proxyFlags) { f.upstreams = "" }, "--listen and --upstream are required"},
		{"bad listen", func(f *proxyFlags) { f.listen = "localhost" }, "--listen:"},
		{"bad upstream", func(f *proxyFlags) { f.upstreams = "127.0.0.1:9000,nope" }, "--upstream:"},
		{"bad route", func(f *proxyFlags) { f.routes = []string{"api.example"} }, "--route:"},
		{"bad mode", func(f *proxyFlags) { f.mode = "zerocopy" }, "--mode:"},
		{"bad proxy protocol", func(f *proxyFlags) { f.proxyProto = "v3" }, "--proxy-protocol:"},
		{"max-inflight too large", func(f *proxyFlags) { f.maxInflight = "2G" }, "--max-inflight: want one size up to 1G"},
		{"max-inflight two sizes", func(f *proxyFlags) { f.maxInflight = "4M,8M" }, "--max-inflight:"},
		{"max-conns zero", func(f *proxyFlags) { f.maxConns = 0 }, "--max-conns: want 1 to"},
		{"bad metrics address", func(f *proxyFlags) { f.metricsAddr = "9465" }, "--metrics-addr"},
		{"udp without idle", func(f *proxyFlags) { f.udp, f.idle = true, 0 }, "--idle: want a positive duration"},
		{"tcp ignores idle", func(f *proxyFlags) { f.idle = 0 }, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fl := good
			tc.edit(&fl)
			_, err := fl.config()
			if tc.want == "" {
				if err != nil {
					t.Fatalf("config: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("config: %v, want an error with %q", err, tc.want)
			}
		})
	}
	cfg, err := proxyFlags{listen: "[::1]:8080", upstreams: "127.0.0.1:9000,127.0.0.1:9001", mode: "pipe",
		proxyProto: "v2", maxInflight: "1M", maxConns: 7, routes: []string{"api.example=127.0.0.1:9002"}}.config()
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Listen.String() != "[::1]:8080" || len(cfg.Upstreams) != 2 || cfg.Mode != proxy.Pipe ||
		cfg.MaxInflight != 1<<20 || cfg.MaxConns != 7 || len(cfg.Routes) != 1 {
		t.Errorf("config: %+v", cfg)
	}
}
