// Package metrics exports shunt's state to Prometheus: what bypass, the
// socket index and the policy have counted, read from their pins at each scrape (so a
// scrape sees an enable or a disable that happened since), and what this
// build and kernel are. Names follow `shunt_<subsystem>_<noun>_<unit|total>`.
package metrics

import (
	"errors"
	"fmt"
	"reflect"
	"runtime"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/guard"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/policy"
	"github.com/shunt-project/shunt/sockindex"
)

// Source says where the collector reads shunt's state.
type Source struct {
	PinDir    string        // bypass's pins
	IndexDir  string        // the socket index's pins
	PolicyDir string        // the policy's pins
	Version   string        // this build's version
	Features  host.Features // the kernel's, probed once: it does not change under a running process
}

// Collector is a prometheus.Collector over one Source.
type Collector struct {
	src Source

	buildInfo, kernelInfo, mechanism *prometheus.Desc
	scrapeErr                        *prometheus.Desc

	bypassEnabled, bypassCgroups, bypassDraining, guardRunning *prometheus.Desc
	mapEntries, mapCapacity, learned                           *prometheus.Desc
	bypassCounters                                             []counter
	cgroupTraffic                                              [4]*prometheus.Desc

	indexEnabled, indexSockets, indexBackends *prometheus.Desc
	indexCounters                             []counter

	policyInstalled, policyScopes, policyRules *prometheus.Desc
	policyVerdicts                             [3]*prometheus.Desc
}

// counter is one field of a counters struct, exported as NAME_total.
type counter struct {
	desc  *prometheus.Desc
	field int
}

// countersOf describes each field of a counters struct (its json tag names
// it, its help tag says what it counts).
func countersOf(subsystem string, v any) []counter {
	t := reflect.TypeOf(v)
	var out []counter
	for i := range t.NumField() {
		f := t.Field(i)
		name := prometheus.BuildFQName("shunt", subsystem, f.Tag.Get("json")+"_total")
		out = append(out, counter{prometheus.NewDesc(name, f.Tag.Get("help"), nil, nil), i})
	}
	return out
}

// New returns a Collector reading src.
func New(src Source) *Collector {
	d := func(subsystem, name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(prometheus.BuildFQName("shunt", subsystem, name), help, labels, nil)
	}
	return &Collector{
		src:        src,
		buildInfo:  d("", "build_info", "This shunt's version and the Go it was built with.", "version", "goversion"),
		kernelInfo: d("", "kernel_info", "The running kernel's release.", "release"),
		mechanism:  d("kernel", "mechanism_info", "How this kernel gives each feature ('missing' where it lacks it); shunt status names the same.", "feature", "via"),
		scrapeErr:  d("", "scrape_errors", "1 where reading a part of shunt's state failed during this scrape (the reason is logged).", "part"),

		bypassEnabled:  d("bypass", "enabled", "1 while bypass is installed at the pin directory."),
		bypassCgroups:  d("bypass", "cgroups", "Cgroups bypass is enabled for."),
		bypassDraining: d("bypass", "draining", "1 while bypass is being removed (no new connections are bypassed)."),
		guardRunning:   d("bypass", "guard_running", "1 while a guard watches the install."),
		mapEntries:     d("bypass", "map_entries", "Entries in bypass's maps: sock_hash (sockets bypassed now), isn_handshakes (connection requests registered, not yet paired; LRU: those of handshakes that never completed stay until evicted), peer_refs (sockets published to their peers), shortcuts (sockets of kernel-mode proxies whose two legs bypass paired: two per connection).", "map"),
		mapCapacity:    d("bypass", "map_capacity_entries", "Entries each fixed-size map of bypass can hold.", "map"),
		learned:        d("bypass", "splice_programs_learned", "Programs learned as splice readers (their readers stay on TCP)."),
		bypassCounters: countersOf("bypass", bypass.Counters{}),
		cgroupTraffic: [4]*prometheus.Desc{
			d("bypass", "cgroup_redirected_bytes_total", "Bytes the cgroup's bypassed sockets sent by redirect.", "cgroup"),
			d("bypass", "cgroup_redirected_sends_total", "Sends of the cgroup's bypassed sockets that went by redirect.", "cgroup"),
			d("bypass", "cgroup_tcp_bytes_total", "Bytes the cgroup's bypassed sockets sent by TCP (flow control, a reader that needs TCP, draining).", "cgroup"),
			d("bypass", "cgroup_tcp_sends_total", "Sends of the cgroup's bypassed sockets that went by TCP.", "cgroup"),
		},

		indexEnabled:  d("index", "enabled", "1 while the socket index is enabled."),
		indexSockets:  d("index", "sockets", "Sockets indexed now."),
		indexBackends: d("index", "backends", "Backends seen since the index was enabled."),
		indexCounters: countersOf("index", sockindex.Counters{}),

		policyInstalled: d("policy", "installed", "1 while a policy is installed at the policy directory."),
		policyScopes:    d("policy", "scopes", "Scopes (cgroup subtrees) with rules in force."),
		policyRules:     d("policy", "rules", "Rules in force, both directions of all scopes together."),
		policyVerdicts: [3]*prometheus.Desc{
			d("policy", "rule_connects_total", "connect() calls (ingress: connection requests) the rule, or a scope's default (cidr=\"default\"), decided.", policyLabels...),
			d("policy", "rule_sends_total", "Unconnected UDP sends (ingress: datagrams received) the rule decided.", policyLabels...),
			d("policy", "rule_closed_total", "Open connections an apply closed because the rule denies them.", policyLabels...),
		},
	}
}

// policyLabels name a rule: its scope, counter id and fields (cidr
// "default" for a scope's default; a peer rule has peer_cgroup, no cidr).
var policyLabels = []string{"cgroup", "direction", "id", "action", "cidr", "peer_cgroup", "port", "proto"}

// Describe sends every metric's description.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.buildInfo, c.kernelInfo, c.mechanism, c.scrapeErr,
		c.bypassEnabled, c.bypassCgroups, c.bypassDraining, c.guardRunning, c.mapEntries, c.mapCapacity, c.learned,
		c.indexEnabled, c.indexSockets, c.indexBackends, c.policyInstalled, c.policyScopes, c.policyRules} {
		ch <- d
	}
	for _, d := range c.cgroupTraffic {
		ch <- d
	}
	for _, d := range c.policyVerdicts {
		ch <- d
	}
	for _, cs := range [][]counter{c.bypassCounters, c.indexCounters} {
		for _, k := range cs {
			ch <- k.desc
		}
	}
}

// Collect reads shunt's state and sends it. A part that cannot be read is
// left out and flagged in shunt_scrape_errors; the rest is still sent.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	gauge(c.buildInfo, 1, c.src.Version, runtime.Version())
	gauge(c.kernelInfo, 1, c.src.Features.Kernel)
	for _, m := range c.src.Features.Mechanisms() {
		via := m.Via
		if via == "" {
			via = "missing"
		}
		gauge(c.mechanism, 1, m.Feature, via)
	}
	for part, read := range map[string]func(chan<- prometheus.Metric) error{"bypass": c.collectBypass, "index": c.collectIndex, "policy": c.collectPolicy} {
		err := read(ch)
		failed := 0.0
		if err != nil {
			failed = 1
			ch <- prometheus.NewInvalidMetric(c.scrapeErr, fmt.Errorf("%s: %w", part, err))
		}
		gauge(c.scrapeErr, failed, part)
	}
}

func (c *Collector) collectBypass(ch chan<- prometheus.Metric) error {
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	in, err := bypass.Open(c.src.PinDir)
	if errors.Is(err, bypass.ErrNotInstalled) {
		gauge(c.bypassEnabled, 0)
		return nil
	}
	if err != nil {
		return err
	}
	defer in.Close()
	// Not sock_states: counting it walks every open file of the machine,
	// which with 10,000 connections took most of a 111 ms scrape.
	maps, err := in.MapFills("sock_hash", "isn_handshakes", "peer_refs", "shortcuts")
	if err != nil {
		return err
	}
	counters, err := in.Counters()
	if err != nil {
		return err
	}
	cgroups, err := in.CgroupIDs()
	if err != nil {
		return err
	}
	learned, err := in.SpliceProgramCount()
	if err != nil {
		return err
	}
	gauge(c.bypassEnabled, 1)
	gauge(c.bypassCgroups, float64(len(cgroups)))
	gauge(c.bypassDraining, boolValue(in.Draining()))
	gauge(c.guardRunning, boolValue(guard.Running(c.src.PinDir)))
	gauge(c.learned, float64(learned))
	for _, m := range maps {
		gauge(c.mapEntries, float64(m.Entries), m.Name)
		if m.Max > 0 {
			gauge(c.mapCapacity, float64(m.Max), m.Name)
		}
	}
	sendCounters(ch, c.bypassCounters, counters)
	traffic, err := in.CgroupTraffic()
	if errors.Is(err, bypass.ErrNoCgroupTraffic) {
		return nil
	}
	if err != nil {
		return err
	}
	for _, t := range traffic {
		for i, v := range []uint64{t.RedirectedBytes, t.RedirectedSends, t.TCPBytes, t.TCPSends} {
			ch <- prometheus.MustNewConstMetric(c.cgroupTraffic[i], prometheus.CounterValue, float64(v), t.Path)
		}
	}
	return nil
}

func (c *Collector) collectIndex(ch chan<- prometheus.Metric) error {
	gauge := func(d *prometheus.Desc, v float64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v)
	}
	ix, err := sockindex.Open(c.src.IndexDir)
	if errors.Is(err, sockindex.ErrNotEnabled) {
		gauge(c.indexEnabled, 0)
		return nil
	}
	if err != nil {
		return err
	}
	defer ix.Close()
	st, err := ix.Status()
	if err != nil {
		return err
	}
	gauge(c.indexEnabled, 1)
	gauge(c.indexSockets, float64(st.Sockets))
	gauge(c.indexBackends, float64(st.Backends))
	sendCounters(ch, c.indexCounters, st.Counters)
	return nil
}

func (c *Collector) collectPolicy(ch chan<- prometheus.Metric) error {
	gauge := func(d *prometheus.Desc, v float64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v)
	}
	p, err := policy.Open(c.src.PolicyDir)
	if errors.Is(err, policy.ErrNotEnabled) {
		gauge(c.policyInstalled, 0)
		return nil
	}
	if err != nil {
		return err
	}
	defer p.Close()
	rep, err := p.Show()
	if err != nil {
		return err
	}
	rules := 0
	for _, s := range rep.Scopes {
		for _, d := range policy.Directions {
			send := func(id uint32, action policy.Action, cidr, peer, port, proto string, n policy.Counts) {
				for i, v := range []uint64{n.Connects, n.Sends, n.Closed} {
					ch <- prometheus.MustNewConstMetric(c.policyVerdicts[i], prometheus.CounterValue, float64(v),
						s.Cgroup, d.String(), strconv.FormatUint(uint64(id), 10), action.String(), cidr, peer, port, proto)
				}
			}
			rr := s.Of(d)
			rules += len(rr.Rules)
			for _, r := range rr.Rules {
				cidr := ""
				if !r.IsPeer() {
					cidr = r.CIDR.String()
				}
				send(r.ID, r.Action, cidr, r.Peer, r.Ports.String(), r.Proto.String(), r.Counts)
			}
			send(rr.DefaultID, rr.Default, "default", "", "any", "any", rr.DefaultCounts)
		}
	}
	gauge(c.policyInstalled, 1)
	gauge(c.policyScopes, float64(len(rep.Scopes)))
	gauge(c.policyRules, float64(rules))
	return nil
}

// sendCounters sends each field of v (a counters struct) as a counter.
func sendCounters(ch chan<- prometheus.Metric, cs []counter, v any) {
	rv := reflect.ValueOf(v)
	for _, k := range cs {
		ch <- prometheus.MustNewConstMetric(k.desc, prometheus.CounterValue, float64(rv.Field(k.field).Uint()))
	}
}

func boolValue(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
