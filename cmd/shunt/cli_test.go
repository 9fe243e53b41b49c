package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/spf13/cobra"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/bypass/bypasstest"
	"github.com/shunt-project/shunt/guard"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/runlock"
	"github.com/shunt-project/shunt/internal/testenv"
)

// The README's example, driven in-process: enable, see the flow in
// `flows --json` and `status --json`, disable everything.
func TestBypassCommandsEndToEnd(t *testing.T) {
	testenv.RequireRoot(t)
	pin := bypasstest.MustPinDir(t)
	cg := testenv.MustCgroup(t)

	// Both ends below are this test's process: one program, which a new
	// install keeps on TCP for its first 16 reads (--no-probation).
	out, stderr, code := runShunt(t, nil, "bypass", "enable", "--no-probation", "--cgroup", cg.Path, "--pin-dir", pin)
	if code != 0 || !strings.Contains(out, "bypass enabled for cgroup "+cg.Path) {
		t.Fatalf("enable: exit %d, %q %q", code, out, stderr)
	}
	out, _, code = runShunt(t, nil, "bypass", "enable", "--cgroup", cg.Path, "--pin-dir", pin)
	if code != 0 || !strings.Contains(out, "already enabled") {
		t.Fatalf("second enable: exit %d, %q", code, out)
	}

	// Every list in JSON output is [] when empty, never null.
	if out, _, code = runShunt(t, nil, "flows", "--json", "--pin-dir", pin); code != 0 || out != "[]\n" {
		t.Fatalf("flows --json with nothing bypassed: exit %d, %q", code, out)
	}

	ns := testenv.MustNetNS(t)
	side := testenv.Side{NS: ns, CG: cg}
	c, s := testenv.ConnPair(t, "tcp6", side, "[::1]:0", side, "[::1]:0")
	testenv.Warm(t, c, s)
	if _, err := c.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(s, make([]byte, 5)); err != nil {
		t.Fatal(err)
	}

	out, _, code = runShunt(t, nil, "flows", "--json", "--pin-dir", pin)
	var flows []bypass.Flow
	if code != 0 || json.Unmarshal([]byte(out), &flows) != nil {
		t.Fatalf("flows --json: exit %d, %q", code, out)
	}
	if len(flows) != 1 || flows[0].Client == nil || flows[0].Server == nil ||
		flows[0].Client.TxBytes != 5 || flows[0].Client.Cookie != testenv.Cookie(t, c) ||
		flows[0].Client.Addr.String() != c.LocalAddr().String() {
		t.Fatalf("flows --json = %s", out)
	}
	out, _, code = runShunt(t, nil, "flows", "--pin-dir", pin)
	if code != 0 || !strings.Contains(out, c.LocalAddr().String()) || !strings.Contains(out, "5/1") {
		t.Fatalf("flows table lacks the connection: %q", out)
	}

	out, _, code = runShunt(t, nil, "status", "--json", "--pin-dir", pin)
	var st statusReport
	if code != 0 || json.Unmarshal([]byte(out), &st) != nil {
		t.Fatalf("status --json: exit %d, %q", code, out)
	}
	if !st.Installed || len(st.Cgroups) != 1 || st.Cgroups[0].Path != cg.Path || st.Stats.Counters.Paired != 1 {
		t.Fatalf("status --json = %s", out)
	}
	want := 6
	if host.Probe().FionreadMisses() {
		// fionread where the kernel's FIONREAD leaves bytes out and is
		// corrected; fionread_told where it cannot be (lockdown).
		want++
	}
	if len(st.Stats.Programs) != want {
		t.Fatalf("status --json programs = %+v, want sockops, setsockopt, getsockopt, sk_msg, reads and splices (and fionread or fionread_told where FIONREAD leaves bytes out)", st.Stats.Programs)
	}
	if st.Guard == nil || !st.Guard.Running || st.Stats.SplicePrograms == nil {
		t.Fatalf("status --json: want the guard running (enable starts it) and a splice program list: %s", out)
	}
	if bufs, err := bypass.ReadTCPBuffers(); err != nil || st.FlowControl == nil || st.FlowControl.TCPBuffers != bufs ||
		st.FlowControl.Bound != min(uint64(bypass.DefaultMaxBacklog), bufs.RmemMax-bufs.WmemMax-bufs.WmemMax/8) {
		t.Fatalf("status --json flow_control = %+v, want the least of --max-backlog and tcp_rmem[2] less 9/8 of tcp_wmem[2] (%+v, %v)", st.FlowControl, bufs, err)
	}
	if tot := st.Stats.Totals; tot == nil || tot.RedirectedBytes != 5 || tot.RedirectedSends != 1 {
		t.Fatalf("status --json totals = %+v, want the 5 bytes in 1 send redirected", st.Stats.Totals)
	}
	for _, p := range st.Stats.Programs {
		if p.ID == 0 || len(p.Links) != 1 {
			t.Fatalf("status --json program %+v: want an id and one link", p)
		}
	}
	out, _, code = runShunt(t, nil, "status", "--pin-dir", pin)
	if code != 0 || !strings.Contains(out, cg.Path) || !strings.Contains(out, "1 paired") || !strings.Contains(out, "5 B in 1 sends redirected") {
		t.Fatalf("status = %q", out)
	}

	out, _, code = runShunt(t, nil, "bypass", "disable", "--all", "--pin-dir", pin)
	if code != 0 || !strings.Contains(out, "shunt removed") {
		t.Fatalf("disable --all: exit %d, %q", code, out)
	}
	if _, err := os.Stat(pin); !os.IsNotExist(err) {
		t.Fatalf("pin dir still there after disable --all")
	}
	if !strings.Contains(out, "stays at "+bypass.LearnedDir(pin)) {
		t.Errorf("disable --all does not say what it left pinned: %q", out)
	}
	// The guard enable started ends once the install is gone.
	for deadline := time.Now().Add(5 * time.Second); guard.Running(pin); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the guard still runs 5 s after disable --all")
		}
	}
	// Nothing of shunt's left in /run either (the guard's log is a log).
	for _, purpose := range []string{"install", "guard"} {
		if _, err := os.Stat(runlock.Path(purpose, pin)); !os.IsNotExist(err) {
			t.Errorf("%s lock file after disable --all: %v", purpose, err)
		}
	}
	// The connection keeps working on the TCP path.
	if _, err := s.Write([]byte("still here")); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 10)
	if _, err := io.ReadFull(c, got); err != nil || string(got) != "still here" {
		t.Fatalf("after disable: %q %v", got, err)
	}
	out, _, code = runShunt(t, nil, "bypass", "disable", "--all", "--pin-dir", pin)
	if code != 0 || !strings.Contains(out, "not enabled") {
		t.Fatalf("disable when not enabled: exit %d, %q", code, out)
	}
	if _, err := os.Stat(runlock.Path("install", pin)); !os.IsNotExist(err) {
		t.Errorf("install lock file after a disable that found nothing: %v", err)
	}
	// Giving up on shunt: forget --all leaves nothing pinned.
	out, _, code = runShunt(t, nil, "bypass", "forget", "--all", "--pin-dir", pin)
	if code != 0 || !strings.Contains(out, "removed "+bypass.LearnedDir(pin)) {
		t.Fatalf("forget --all without an install: exit %d, %q", code, out)
	}
	if _, err := os.Stat(bypass.LearnedDir(pin)); !os.IsNotExist(err) {
		t.Errorf("%s still there after forget --all: %v", bypass.LearnedDir(pin), err)
	}
}

// commandPaths lists every command of the tree, root first.
func commandPaths(c *cobra.Command, parent []string) [][]string {
	out := [][]string{parent}
	for _, sub := range c.Commands() {
		if sub.Hidden || sub.Name() == "help" || sub.Name() == "completion" {
			continue
		}
		out = append(out, commandPaths(sub, append(slices.Clone(parent), sub.Name()))...)
	}
	return out
}

// Every command answers --help with its usage, and a flag it does not know
// with one line and exit 2 (a usage mistake, typed as one, not guessed from
// the message).
func TestHelpAndVersion(t *testing.T) {
	paths := commandPaths(newRoot(defaultEnv()), nil)
	if len(paths) < 25 {
		t.Fatalf("found %d commands: the walk is broken", len(paths))
	}
	for _, path := range paths {
		out, stderr, code := runShunt(t, nil, append(slices.Clone(path), "--help")...)
		if code != 0 || !strings.Contains(out, "Usage:") || stderr != "" {
			t.Errorf("%v --help: exit %d, %q, stderr %q", path, code, out, stderr)
		}
		_, stderr, code = runShunt(t, nil, append(slices.Clone(path), "--no-such-flag")...)
		if code != 2 {
			t.Errorf("%v --no-such-flag: exit %d, want 2", path, code)
		}
		oneLine(t, stderr, "unknown flag: --no-such-flag")
	}
	_, stderr, code := runShunt(t, nil, "frobnicate")
	if code != 2 {
		t.Errorf("unknown command: exit %d, want 2", code)
	}
	oneLine(t, stderr, `unknown command "frobnicate"`)
	out, _, code := runShunt(t, nil, "version")
	if code != 0 || !strings.HasPrefix(out, "shunt ") {
		t.Errorf("version: exit %d, %q", code, out)
	}
}

// A failure that is not a usage mistake exits 1 even when its message names
// a flag, and a message over several lines is printed whole, not cut.
func TestErrorExitCodes(t *testing.T) {
	e := defaultEnv()
	var errb bytes.Buffer
	e.stderr = &errb
	root := func(err error) int {
		errb.Reset()
		c := &cobra.Command{Use: "x", SilenceErrors: true, SilenceUsage: true, RunE: func(*cobra.Command, []string) error { return err }}
		return finish(c.Execute(), e)
	}
	if code := root(errors.New("the --mode flag's upstream refused")); code != 1 {
		t.Errorf("a failure naming a flag: exit %d, want 1", code)
	}
	if code := root(usageError{errors.New("bad value")}); code != 2 {
		t.Errorf("a typed usage error: exit %d, want 2", code)
	}
	root(errors.New("first\nsecond"))
	if got := errb.String(); got != "shunt: first\nsecond\n" {
		t.Errorf("a two-line error printed as %q", got)
	}
}

// disable --all must not drop bytes a reader has not read: it gives up after
// --timeout, says so, exits 1 and leaves shunt installed (no cgroup, all
// sends on TCP); once the reader has read, a second disable removes it.
func TestDisableWaitsForUnreadBytes(t *testing.T) {
	testenv.RequireRoot(t)
	testenv.WatchKernelLog(t)
	pin, cg := mustEnabled(t, "--no-probation")
	ns := testenv.MustNetNS(t)
	side := testenv.Side{NS: ns, CG: cg}
	c, s := testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
	testenv.Warm(t, c, s)
	first := testenv.Stream{Seed: 7, Size: 1 << 20, MaxChunk: 64 << 10}
	if err := first.Write(c); err != nil { // redirected; the server does not read yet
		t.Fatal(err)
	}

	_, stderr, code := runShunt(t, nil, "bypass", "disable", "--all", "--timeout", "300ms", "--pin-dir", pin)
	if code != 1 {
		t.Fatalf("disable with unread bytes: exit %d, want 1 (%s)", code, stderr)
	}
	oneLine(t, stderr, "still hold unread data; nothing was lost")
	out, _, _ := runShunt(t, nil, "status", "--json", "--pin-dir", pin)
	var st statusReport
	if err := json.Unmarshal([]byte(out), &st); err != nil || !st.Installed || !st.Stats.Draining || len(st.Cgroups) != 0 {
		t.Fatalf("after a refused disable want installed, draining, no cgroups: %s", out)
	}

	// Sends now take TCP; the reader gets the redirected bytes first, then these.
	second := testenv.Stream{Seed: 8, Size: 256 << 10, MaxChunk: 16 << 10}
	if err := second.Write(c); err != nil {
		t.Fatal(err)
	}
	if err := first.Check(s, false); err != nil {
		t.Fatal(err)
	}
	if err := second.Check(s, false); err != nil {
		t.Fatal(err)
	}
	if out, stderr, code := runShunt(t, nil, "bypass", "disable", "--all", "--pin-dir", pin); code != 0 || !strings.Contains(out, "shunt removed") {
		t.Fatalf("second disable: exit %d, %q %q", code, out, stderr)
	}
	if _, err := os.Stat(pin); !os.IsNotExist(err) {
		t.Fatalf("pin dir still there after disable")
	}
}

// disable --all --force does not wait past --timeout: it resets the
// connection whose reader has not read, names it, and removes shunt; the
// reader sees the connection fail, not the stream go on without the bytes.
func TestDisableForceResetsUnreadConnection(t *testing.T) {
	pin, cg := mustEnabled(t, "--no-probation")
	side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
	c, s := testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
	testenv.Warm(t, c, s)
	if _, err := c.Write(make([]byte, 64<<10)); err != nil { // redirected; s does not read
		t.Fatal(err)
	}
	out, stderr, code := runShunt(t, nil, "bypass", "disable", "--all", "--force", "--timeout", "200ms", "--pin-dir", pin)
	want := fmt.Sprintf("reset %s -> %s", s.LocalAddr(), s.RemoteAddr())
	if code != 0 || !strings.Contains(out, want) || !strings.Contains(out, "its reader had not read") || !strings.Contains(out, "shunt removed") {
		t.Fatalf("disable --force: exit %d, %q %q; want %q and shunt removed", code, out, stderr, want)
	}
	if _, err := os.Stat(pin); !os.IsNotExist(err) {
		t.Fatalf("pin dir still there after disable --force")
	}
	s.SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, err := s.Read(make([]byte, 128<<10)); n != 0 || !errors.Is(err, syscall.ECONNABORTED) {
		t.Fatalf("the reset reader read %d bytes, %v; want ECONNABORTED", n, err)
	}
}

func TestExcludePortsFlag(t *testing.T) {
	testenv.RequireRoot(t)
	pin := bypasstest.MustPinDir(t)
	cg := testenv.MustCgroup(t)
	status := func() []uint16 {
		t.Helper()
		out, _, code := runShunt(t, nil, "status", "--json", "--pin-dir", pin)
		var st statusReport
		if code != 0 || json.Unmarshal([]byte(out), &st) != nil || st.Stats == nil {
			t.Fatalf("status --json: exit %d, %q", code, out)
		}
		return st.Stats.ExcludedPorts
	}
	for _, bad := range []string{"0", "http", "80,,81", "65536"} {
		_, stderr, code := runShunt(t, nil, "bypass", "enable", "--cgroup", cg.Path, "--pin-dir", pin, "--exclude-ports", bad)
		if code != 2 {
			t.Errorf("--exclude-ports %q: exit %d, want 2", bad, code)
		}
		oneLine(t, stderr, "is not a port")
	}
	out, stderr, code := runShunt(t, nil, "bypass", "enable", "--cgroup", cg.Path, "--pin-dir", pin, "--exclude-ports", "9000,8080")
	if code != 0 || !strings.Contains(out, "server ports [9000 8080] stay on TCP") {
		t.Fatalf("enable: exit %d, %q %q", code, out, stderr)
	}
	if got := status(); len(got) != 2 || got[0] != 8080 || got[1] != 9000 {
		t.Errorf("excluded ports %v, want [8080 9000]", got)
	}
	// Enabling again without the flag keeps the list; "none" clears it.
	runShunt(t, nil, "bypass", "enable", "--cgroup", cg.Path, "--pin-dir", pin)
	if got := status(); len(got) != 2 {
		t.Errorf("excluded ports %v after an enable without the flag, want them kept", got)
	}
	runShunt(t, nil, "bypass", "enable", "--cgroup", cg.Path, "--pin-dir", pin, "--exclude-ports", "none")
	if got := status(); len(got) != 0 {
		t.Errorf("excluded ports %v after none, want none", got)
	}
}

// --trust-readers: the first send of a connection is redirected, before its
// reader has called recv.
func TestBypassEnableTrustReaders(t *testing.T) {
	pin, cg := mustEnabled(t, "--trust-readers")
	t.Cleanup(func() { runShunt(t, nil, "bypass", "disable", "--all", "--pin-dir", pin) })
	ns := testenv.MustNetNS(t)
	side := testenv.Side{NS: ns, CG: cg}
	c, s := testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
	c.Write([]byte("hello"))
	if _, err := io.ReadFull(s, make([]byte, 5)); err != nil {
		t.Fatal(err)
	}
	out, _, code := runShunt(t, nil, "flows", "--pin-dir", pin)
	if code != 0 || !strings.Contains(out, "5/1") {
		t.Fatalf("first send not redirected with --trust-readers: %q", out)
	}
	out, _, code = runShunt(t, nil, "status", "--pin-dir", pin)
	defaults := "--max-backlog " + formatSize(bypass.DefaultMaxBacklog) + ", --trust-readers"
	if code != 0 || !strings.Contains(out, defaults) {
		t.Fatalf("status does not show the install's options: %q", out)
	}
	// Options apply when the install is made; a later enable says so.
	other := testenv.MustCgroup(t)
	_, stderr, code := runShunt(t, nil, "bypass", "enable", "--max-backlog", "4M", "--cgroup", other.Path, "--pin-dir", pin)
	if code != 0 {
		t.Fatalf("second enable: exit %d %s", code, stderr)
	}
	oneLine(t, stderr, "keeps the options it was created with ("+defaults)
}

// The guard `bypass enable` starts in the background resets a connection
// whose reader splices after recv with redirected bytes queued; status
// names the program, and forget unlearns it.
func TestGuardResetsCaughtSplicer(t *testing.T) {
	pin, cg := mustEnabled(t, "--no-probation")
	side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
	c, s := testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
	for _, conn := range []*net.TCPConn{c, s} {
		conn.SetDeadline(time.Now().Add(20 * time.Second))
	}
	testenv.Warm(t, c, s)
	served := make(chan error, 1)
	go func() {
		_, err := testenv.HeaderThenSplice(s)
		served <- err
	}()
	if _, err := c.Write([]byte("HEAD" + strings.Repeat("body ", 10000))); err != nil {
		t.Fatal(err)
	}
	if err := <-served; !errors.Is(err, syscall.ECONNABORTED) {
		t.Fatalf("the splicing server got %v, want ECONNABORTED from the guard", err)
	}

	out, _, code := runShunt(t, nil, "status", "--json", "--pin-dir", pin)
	var st statusReport
	if code != 0 || json.Unmarshal([]byte(out), &st) != nil {
		t.Fatalf("status --json: exit %d, %q", code, out)
	}
	if st.Stats.Counters.SpliceCaught != 1 || len(st.Stats.SplicePrograms) != 1 || st.Stats.SplicePrograms[0].Caught != 1 {
		t.Fatalf("status after a caught splicer: %+v, programs %+v", st.Stats.Counters, st.Stats.SplicePrograms)
	}
	name := st.Stats.SplicePrograms[0].Command
	log, err := os.ReadFile(st.Guard.Log)
	if err != nil || !strings.Contains(string(log), "("+name+")") || !strings.Contains(string(log), "connection reset") {
		t.Fatalf("guard log %s: %q %v", st.Guard.Log, log, err)
	}
	out, _, code = runShunt(t, nil, "status", "--pin-dir", pin)
	if code != 0 || !strings.Contains(out, "splicer "+name) || !strings.Contains(out, "running, log") {
		t.Fatalf("status = %q", out)
	}
	// The metrics count the program without walking the processes.
	learnedGauge := func(want int) {
		t.Helper()
		out, _, code := runShunt(t, nil, "metrics", "--once", "--pin-dir", pin)
		if metric := fmt.Sprintf("shunt_bypass_splice_programs_learned %d\n", want); code != 0 || !strings.Contains(out, metric) {
			t.Fatalf("metrics --once: exit %d, no %q in:\n%s", code, metric, out)
		}
	}
	learnedGauge(1)
	out, _, code = runShunt(t, nil, "bypass", "forget", name, "--pin-dir", pin)
	if code != 0 || !strings.Contains(out, "forgot 1") {
		t.Fatalf("forget %s: exit %d, %q", name, code, out)
	}
	learnedGauge(0)
	_, stderr, code := runShunt(t, nil, "bypass", "forget", name, "--pin-dir", pin)
	if code != 2 {
		t.Errorf("forget of an unknown program: exit %d, want 2", code)
	}
	oneLine(t, stderr, "no such program")
}

// Two users of one machine share an install: a command that changes it
// waits for another one that holds it, and disable --all names what it
// takes away (cgroups and their owner, --exclude-ports) and what it keeps.
func TestDisableWaitsForTheInstallLockAndSaysWhatItRemoves(t *testing.T) {
	pin, cg := mustEnabled(t, "--exclude-ports", "8080", "--splicer", "haproxy", "--no-guard")
	release, err := runlock.Lock("install", pin, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	type result struct {
		out, stderr string
		code        int
	}
	done := make(chan result, 1)
	go func() {
		out, stderr, code := runShunt(t, nil, "bypass", "disable", "--all", "--pin-dir", pin)
		done <- result{out, stderr, code}
	}()
	select {
	case r := <-done:
		t.Fatalf("disable ran while another command held the install: %+v", r)
	case <-time.After(300 * time.Millisecond):
	}
	release()
	r := <-done
	if r.code != 0 || !strings.Contains(r.stderr, "waiting for another shunt command changing "+pin) {
		t.Fatalf("disable after the lock was released: exit %d, stderr %q", r.code, r.stderr)
	}
	for _, want := range []string{"detaching cgroup " + cg.Path, "owner root", "dropped with the install: --exclude-ports 8080", "kept: 1 program(s) seen splicing", "shunt removed"} {
		if !strings.Contains(r.out, want) {
			t.Errorf("disable --all said %q, without %q", r.out, want)
		}
	}
}

// mustEnabled enables bypass through the CLI for a new cgroup, with a pin
// directory of the test's own (removed when the test ends), giving flags.
func mustEnabled(t *testing.T, flags ...string) (pin string, cg host.Cgroup) {
	t.Helper()
	testenv.RequireRoot(t)
	pin = bypasstest.MustPinDir(t)
	cg = testenv.MustCgroup(t)
	args := append([]string{"bypass", "enable", "--cgroup", cg.Path, "--pin-dir", pin}, flags...)
	if _, stderr, code := runShunt(t, nil, args...); code != 0 {
		t.Fatalf("enable: %s", stderr)
	}
	return pin, cg
}
