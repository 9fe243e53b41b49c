package compat_test

import (
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
)

// lighttpd 1.4 as a reverse proxy (mod_proxy) in front of nginx, every
// process in one enabled cgroup. lighttpd reads an upstream response's
// header with recv and splices its body: the splice cannot read bytes shunt
// redirected. Before lighttpd is known, its first splice from a socket with
// redirected bytes queued is caught (that download is reset, and told by
// Content-Length) and teaches it; told in advance (bypass enable --splicer
// lighttpd), nothing is caught. Where the kernel runs BPF LSM programs
// (6.12 in the kernel matrix), --refuse-splice fails each splice from a
// bypassed socket with EINVAL and lighttpd reads instead: nothing is caught
// and its connections stay bypassed. No download may hang or come back
// wrong.
func TestLighttpdProxy(t *testing.T) {
	testenv.NeedProgram(t, "lighttpd")
	body := newBlob(1<<20, 13)
	type lighttpdCase struct {
		name    string
		told    bool // lighttpd learned before it starts
		refuse  bool // installed with RefuseSplice
		clients int  // at once, each downloading each times
		each    int
	}
	cases := []lighttpdCase{
		{name: "learned-at-first-splice", clients: 1, each: 12},
		{name: "learned-at-first-splice/20-at-once", clients: 20, each: 3},
		{name: "told-in-advance", told: true, clients: 1, each: 12},
	}
	if host.CanRefuseSplice() {
		cases = append(cases,
			lighttpdCase{name: "splice-refused", refuse: true, clients: 1, each: 12},
			lighttpdCase{name: "splice-refused/20-at-once", refuse: true, clients: 20, each: 3})
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnvWith(t, bypass.Options{RefuseSplice: tc.refuse})
			if tc.told {
				if err := e.in.Learn("lighttpd"); err != nil {
					t.Fatal(err)
				}
			}
			addr := e.lighttpdProxy(t, nginxOrigin(t, e, body, true))
			counts := fetchAll(t, tc.clients, tc.each, func() (outcome, string) { return e.download(t, addr, body, 20*time.Second) })
			st, err := e.in.Stats()
			if err != nil {
				t.Fatal(err)
			}
			what := counts.String()
			t.Logf("%s; paired %d, splices refused %d, splice readers %d, caught %d, presumed splicers %d (%d with bytes queued), programs %+v",
				what, st.Counters.Paired, st.Counters.SplicesRefused, st.Counters.SpliceReaders, st.Counters.SpliceCaught,
				st.Counters.PresumedSplicers, st.Counters.PresumedQueued, st.SplicePrograms)
			if counts[wrong] > 0 || counts[hung] > 0 {
				t.Errorf("%s: a download may never hang or come back wrong", what)
			}
			if st.Counters.Paired == 0 {
				t.Errorf("nothing was bypassed: the run compared TCP with TCP")
			}
			if tc.refuse {
				if counts[intact] != tc.clients*tc.each || st.Counters.SpliceCaught+st.Counters.SpliceReaders != 0 || len(st.SplicePrograms) != 0 {
					t.Errorf("%s: with splices refused every download must be intact and nothing caught, sent back or learned", what)
				}
				if tc.clients == 1 && st.Counters.SplicesRefused == 0 {
					t.Errorf("no splice was refused: lighttpd never spliced from a bypassed socket")
				}
				return
			}
			// lighttpd splices only a read FIONREAD says is over 32 KiB: in
			// some runs it never does from a socket shunt holds.
			learned := slices.ContainsFunc(st.SplicePrograms, func(p bypass.SpliceProgram) bool { return p.Command == "lighttpd" })
			if !learned && (tc.told || st.Counters.SpliceReaders > 0) {
				t.Errorf("lighttpd is not among the learned splicers")
			}
			allowed := 0
			if !tc.told {
				// The first caught connection teaches lighttpd; after it only
				// one that held redirected bytes at that moment may be caught.
				allowed = 1 + int(st.Counters.PresumedQueued)
			}
			if counts[reset] > int(st.Counters.SpliceCaught) || counts[reset] > allowed {
				t.Errorf("%s: every reset must be a caught splice reader (%d caught), %d at most", what, st.Counters.SpliceCaught, allowed)
			}
			if tc.told && st.Counters.SpliceCaught > 0 {
				t.Errorf("%d connections caught although lighttpd was told in advance", st.Counters.SpliceCaught)
			}
			if tc.told && (len(st.SplicePrograms) != 1 || !st.SplicePrograms[0].ByName || st.SplicePrograms[0].Splices != st.Counters.SpliceReaders) {
				t.Errorf("learned %+v: want lighttpd by name alone, with its %d splices", st.SplicePrograms, st.Counters.SpliceReaders)
			}
		})
	}
}

// lighttpdProxy runs lighttpd with mod_proxy in front of origin (host:port
// on 127.0.0.1) and returns where it listens.
func (e *env) lighttpdProxy(t *testing.T, origin string) string {
	t.Helper()
	var port int
	if _, err := fmt.Sscanf(origin, "127.0.0.1:%d", &port); err != nil {
		t.Fatalf("origin %q: %v", origin, err)
	}
	proxy := startLighttpd(t, e, nil, fmt.Sprintf(`server.modules = ( "mod_proxy" )
proxy.server = ( "" => ( ( "host" => "127.0.0.1", "port" => %d ) ) )
`, port))
	return fmt.Sprintf("127.0.0.1:%d", proxy)
}

// fetchAll runs fetch each times from each of clients goroutines at once
// and counts the outcomes, logging every one that was not intact.
func fetchAll(t *testing.T, clients, each int, fetch func() (outcome, string)) tally {
	t.Helper()
	var mu sync.Mutex
	var counts tally
	var wg sync.WaitGroup
	for c := 0; c < clients; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < each; i++ {
				o, why := fetch()
				mu.Lock()
				counts[o]++
				mu.Unlock()
				if o != intact {
					t.Logf("client %d download %d: %s", c, i, why)
				}
			}
		}()
	}
	wg.Wait()
	return counts
}
