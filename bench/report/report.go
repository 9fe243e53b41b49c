// Package report writes benchmark results for people: a markdown table, the
// raw JSON, and PNG plots, into one directory.
package report

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"

	"github.com/shunt-project/shunt/bench"
)

// Latency writes latency.json, latency.md and one latency-PLACEMENT.png per
// placement (p50 and p99 against message size, one line per mode).
func Latency(dir string, res []bench.LatencyResult) error {
	var md strings.Builder
	fmt.Fprintf(&md, "| size | placement | mode | p50 us | p99 us | p99.9 us | max us | round trips/s | CPU us/RT | p50 vs tcp | stall |\n")
	fmt.Fprintf(&md, "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|\n")
	series := map[string]map[string][]xy{} // placement -> "mode p50" -> points
	for _, r := range res {
		fmt.Fprintf(&md, "| %d | %s | %s | %.1f | %.1f | %.1f | %.1f | %.0f | %.1f | %s | %s |\n",
			r.Size, r.Placement, r.Mode, us(r.MedianP50), us(r.Dist.P99), us(r.Dist.P999), us(r.Dist.Max),
			r.RoundTripsPS, us(r.CPUPerRT), ratio(r.RatioToTCP), yes(r.Stalled))
		if series[r.Placement] == nil {
			series[r.Placement] = map[string][]xy{}
		}
		series[r.Placement][r.Mode+" p50"] = append(series[r.Placement][r.Mode+" p50"], xy{float64(r.Size), us(r.MedianP50)})
		series[r.Placement][r.Mode+" p99"] = append(series[r.Placement][r.Mode+" p99"], xy{float64(r.Size), us(r.Dist.P99)})
	}
	if err := write(dir, "latency", res, md.String()); err != nil {
		return err
	}
	for pl, s := range series {
		title := fmt.Sprintf("Round-trip latency, %s, %s", pl, res[0].Topology)
		if err := linePlot(filepath.Join(dir, "latency-"+pl+".png"), title, "message size (bytes)", "microseconds", s, true); err != nil {
			return err
		}
	}
	return nil
}

// Throughput writes throughput.json, throughput.md and one
// throughput-PLACEMENT.png per placement.
func Throughput(dir string, res []bench.ThroughputResult) error {
	var md strings.Builder
	fmt.Fprintf(&md, "| write size | placement | mode | Gbit/s median | rounds | CPU s/GB | peak TCP mem MiB | vs tcp |\n")
	fmt.Fprintf(&md, "|---:|---|---|---:|---|---:|---:|---:|\n")
	series := map[string]map[string][]xy{}
	for _, r := range res {
		rounds := make([]string, len(r.RoundGbps))
		for i, g := range r.RoundGbps {
			rounds[i] = fmt.Sprintf("%.2f", g)
		}
		fmt.Fprintf(&md, "| %d | %s | %s | %.2f | %s | %.2f | %.1f | %s |\n", r.WriteSize, r.Placement, r.Mode, r.MedianGbps,
			strings.Join(rounds, " "), r.CPUSecPerGB, r.PeakTCPMemMiB, ratio(r.RatioToTCP))
		if series[r.Placement] == nil {
			series[r.Placement] = map[string][]xy{}
		}
		series[r.Placement][r.Mode] = append(series[r.Placement][r.Mode], xy{float64(r.WriteSize), r.MedianGbps})
	}
	if err := write(dir, "throughput", res, md.String()); err != nil {
		return err
	}
	for pl, s := range series {
		title := fmt.Sprintf("One-way throughput, %s, %s", pl, res[0].Topology)
		if err := linePlot(filepath.Join(dir, "throughput-"+pl+".png"), title, "write size (bytes)", "Gbit/s", s, true); err != nil {
			return err
		}
	}
	return nil
}

// Echo writes echo.json, echo.md and one echo-PLACEMENT.png per placement
// (p50 and p99 against block size, one line per mode).
func Echo(dir string, res []bench.EchoResult) error {
	var md strings.Builder
	fmt.Fprintf(&md, "| block | placement | mode | echoes | p50 us | p99 us | p99.9 us | max us | >10 ms | CPU us/echo | stall |\n")
	fmt.Fprintf(&md, "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|\n")
	series := map[string]map[string][]xy{}
	for _, r := range res {
		fmt.Fprintf(&md, "| %d | %s | %s | %d | %.1f | %.1f | %.1f | %.1f | %d | %.1f | %s |\n", r.Block, r.Placement, r.Mode,
			r.Dist.Count, us(r.MedianP50), us(r.Dist.P99), us(r.Dist.P999), us(r.Dist.Max), r.Over10ms, us(r.CPUPerEcho), yes(r.Stalled))
		if series[r.Placement] == nil {
			series[r.Placement] = map[string][]xy{}
		}
		series[r.Placement][r.Mode+" p50"] = append(series[r.Placement][r.Mode+" p50"], xy{float64(r.Block), us(r.MedianP50)})
		series[r.Placement][r.Mode+" p99"] = append(series[r.Placement][r.Mode+" p99"], xy{float64(r.Block), us(r.Dist.P99)})
	}
	if err := write(dir, "echo", res, md.String()); err != nil {
		return err
	}
	for pl, s := range series {
		title := fmt.Sprintf("Echo latency, %s, %s", pl, res[0].Topology)
		if err := linePlot(filepath.Join(dir, "echo-"+pl+".png"), title, "block size (bytes)", "microseconds", s, true); err != nil {
			return err
		}
	}
	return nil
}

// Backpressure writes backpressure.json, backpressure.md and
// backpressure.png: bytes in flight over time, one line per mode and round.
func Backpressure(dir string, res []bench.BackpressureResult) error {
	var md strings.Builder
	fmt.Fprintf(&md, "| mode | round | peak in flight MiB | final in flight MiB | final queued MiB | produced KB/s | consumed KB/s |\n")
	fmt.Fprintf(&md, "|---|---:|---:|---:|---:|---|---:|\n")
	series := map[string][]xy{}
	for _, r := range res {
		last := r.Samples[len(r.Samples)-1]
		prod := make([]string, len(r.ProducedKBps))
		for i, p := range r.ProducedKBps {
			prod[i] = fmt.Sprintf("%.0f", p)
		}
		fmt.Fprintf(&md, "| %s | %d | %.1f | %.1f | %.1f | %s | %.0f |\n", r.Mode, r.Round, mb(r.PeakInFlight), mb(last.InFlight),
			mb(last.Queued), strings.Join(prod, " + "), r.ConsumedKBps)
		name := fmt.Sprintf("%s round %d", r.Mode, r.Round)
		for _, s := range r.Samples {
			series[name] = append(series[name], xy{float64(s.AtMs) / 1000, mb(s.InFlight)})
		}
	}
	if err := write(dir, "backpressure", res, md.String()); err != nil {
		return err
	}
	return linePlot(filepath.Join(dir, "backpressure.png"), "Bytes written and not yet read, over time",
		"seconds", "MiB in flight", series, false)
}

func mb(b int64) float64 { return float64(b) / (1 << 20) }

type xy struct{ x, y float64 }

func write(dir, name string, res any, md string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("report: %w", err)
	}
	b, err := json.MarshalIndent(res, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, name+".json"), append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("report: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, name+".md"), []byte(md), 0o644); err != nil {
		return fmt.Errorf("report: %w", err)
	}
	return nil
}

// linePlot draws one line per series on log-log axes (a single size gets a
// linear x axis: a log axis needs a range).
func linePlot(path, title, xlabel, ylabel string, series map[string][]xy, logAxes bool) error {
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = xlabel
	p.Y.Label.Text = ylabel
	p.Legend.Top = true
	p.Legend.Left = true
	names := make([]string, 0, len(series))
	multi := false
	lo, hi := math.Inf(1), 0.0
	for n, pts := range series {
		names = append(names, n)
		multi = multi || len(pts) > 1
		for _, v := range pts {
			lo, hi = math.Min(lo, v.y), math.Max(hi, v.y)
		}
	}
	sort.Strings(names)
	if multi && logAxes {
		p.X.Scale = plot.LogScale{}
		p.X.Tick.Marker = plot.LogTicks{Prec: -1}
	}
	// Values spanning orders of magnitude (16 KiB echoes beside 2 MiB ones)
	// would flatten into the axis on a linear scale.
	if logAxes && lo > 0 && hi/lo > 20 {
		p.Y.Scale = plot.LogScale{}
		p.Y.Tick.Marker = plot.LogTicks{Prec: -1}
	}
	var args []any
	for _, n := range names {
		pts := make(plotter.XYs, len(series[n]))
		for i, v := range series[n] {
			pts[i].X, pts[i].Y = v.x, v.y
		}
		args = append(args, n, pts)
	}
	if err := plotutil.AddLinePoints(p, args...); err != nil {
		return fmt.Errorf("plot: %w", err)
	}
	if err := p.Save(7*vg.Inch, 4.5*vg.Inch, path); err != nil {
		return fmt.Errorf("plot: %w", err)
	}
	return nil
}

func us(d interface{ Nanoseconds() int64 }) float64 { return float64(d.Nanoseconds()) / 1e3 }

func ratio(r float64) string {
	if r == 0 {
		return "-"
	}
	return fmt.Sprintf("%.2f", r)
}

func yes(b bool) string {
	if b {
		return "STALL"
	}
	return ""
}

// Reap writes the reap table (the RFC's layout) and a plot of time against
// sockets on the host for each method and protocol.
func Reap(dir string, res []bench.ReapResult) error {
	var md strings.Builder
	fmt.Fprintf(&md, "| proto | sockets on host | method | rounds | destroyed (worst round) | missed (all rounds) | median us | min us | max us | lookup us | netns us | destroy us |\n")
	fmt.Fprintf(&md, "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	series := map[string][]xy{}
	for _, r := range res {
		fmt.Fprintf(&md, "| %s | %d | %s | %d | %d | %d | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f |\n", r.Proto, r.Sockets, r.Method, r.Rounds,
			r.Destroyed, r.Missed, us(r.Took), us(r.Min), us(r.Max), us(r.Lookup), us(r.Resolve), us(r.Destroy))
		for _, f := range r.Failed {
			fmt.Fprintf(&md, "\n%s %s at %d sockets failed: %s\n\n", r.Proto, r.Method, r.Sockets, f)
		}
		name := r.Proto + " " + r.Method
		series[name] = append(series[name], xy{float64(r.Sockets), us(r.Took)})
	}
	if err := write(dir, "reap", res, md.String()); err != nil {
		return err
	}
	return linePlot(filepath.Join(dir, "reap.png"), "Time to destroy the sockets of one backend",
		"sockets on the host", "microseconds (median)", series, true)
}

// Fanout writes the fan-out table and a plot of p99 latency against
// subscribers for each path, size and rate.
func Fanout(dir string, res []bench.FanoutResult) error {
	var md strings.Builder
	fmt.Fprintf(&md, "| path | size B | rate/s | subscribers | not reading | sent | delivered | undelivered | p50 us | p99 us | max us | CPU s/GB | stall |\n")
	fmt.Fprintf(&md, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n")
	series := map[string][]xy{}
	for _, r := range res {
		fmt.Fprintf(&md, "| %s | %d | %d | %d | %d | %d | %d | %d | %.0f | %.0f | %.0f | %.2f | %s |\n", r.Path, r.Size, r.Rate, r.Subscribers, r.Slow,
			r.Sent, r.Delivered, r.Undelivered, us(r.Latency.P50), us(r.Latency.P99), us(r.Latency.Max), r.CPUPerGB, yes(r.Stalled))
		name := fmt.Sprintf("%s %dB %dk/s", r.Path, r.Size, r.Rate/1000)
		if r.Slow > 0 {
			name += fmt.Sprintf(" +%d stalled", r.Slow)
		}
		series[name] = append(series[name], xy{float64(r.Subscribers), us(r.Latency.P99)})
	}
	if err := write(dir, "fanout", res, md.String()); err != nil {
		return err
	}
	return linePlot(filepath.Join(dir, "fanout.png"), "Fan-out: p99 delivery latency",
		"subscribers", "p99 us", series, true)
}

// Proxy writes proxy.md/json and two plots: request/response p99 and bulk
// CPU per GB, each against size, one line per proxy.
func Proxy(dir string, res []bench.ProxyResult) error {
	var md strings.Builder
	fmt.Fprintf(&md, "Request/response (one connection, one request at a time):\n\n")
	fmt.Fprintf(&md, "| proxy | size B | round trips | p50 us | p99 us | p99.9 us | max us | over 10 ms | machine CPU s/GB | proxy CPU s/GB |\n")
	fmt.Fprintf(&md, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	p99 := map[string][]xy{}
	cpu := map[string][]xy{}
	for _, r := range res {
		if r.Test != "rr" {
			continue
		}
		fmt.Fprintf(&md, "| %s | %d | %d | %.1f | %.1f | %.1f | %.0f | %d | %.2f | %.2f |\n", r.Mode, r.Size, r.Dist.Count,
			us(r.Dist.P50), us(r.Dist.P99), us(r.Dist.P999), us(r.Dist.Max), r.Over10ms, r.MachineCPUPerGB, r.ProxyCPUPerGB)
		p99[r.Mode] = append(p99[r.Mode], xy{float64(r.Size), us(r.Dist.P99)})
	}
	fmt.Fprintf(&md, "\nBulk (one connection, client to upstream; medians over rounds):\n\n")
	fmt.Fprintf(&md, "| proxy | block B | Gbit/s | rounds Gbit/s | max read gap ms | gaps over 10 ms | machine CPU s/GB | proxy CPU s/GB | moved by the kernel |\n")
	fmt.Fprintf(&md, "|---|---:|---:|---|---:|---:|---:|---:|---:|\n")
	for _, r := range res {
		if r.Test != "bulk" {
			continue
		}
		rounds := make([]string, len(r.RoundGbps))
		for i, g := range r.RoundGbps {
			rounds[i] = fmt.Sprintf("%.2f", g)
		}
		share := ""
		if len(r.RoundKernelShare) > 0 {
			share = fmt.Sprintf("%.0f%%", 100*r.KernelShare)
		}
		fmt.Fprintf(&md, "| %s | %d | %.2f | %s | %.1f | %d | %.2f | %.2f | %s |\n", r.Mode, r.Size, r.Gbps, strings.Join(rounds, " "),
			float64(r.MaxGap.Microseconds())/1e3, r.Over10ms, r.MachineCPUPerGB, r.ProxyCPUPerGB, share)
		cpu[r.Mode] = append(cpu[r.Mode], xy{float64(r.Size), r.MachineCPUPerGB})
	}
	if err := write(dir, "proxy", res, md.String()); err != nil {
		return err
	}
	if len(p99) > 0 {
		if err := linePlot(filepath.Join(dir, "proxy-p99.png"), "Proxies: request/response p99", "request bytes", "p99 us", p99, true); err != nil {
			return err
		}
	}
	if len(cpu) > 0 {
		return linePlot(filepath.Join(dir, "proxy-cpu.png"), "Proxies: whole-machine CPU per GB (bulk)", "block bytes", "CPU s/GB", cpu, true)
	}
	return nil
}

// UDP writes udp.md and udp.json.
func UDP(dir string, res []bench.UDPResult) error {
	var md strings.Builder
	fmt.Fprintf(&md, "| mode | size B | round trips | p50 us | p99 us | p99.9 us | max us | lost | bulk sent | bulk delivered | Gbit/s | machine CPU s/GB |\n")
	fmt.Fprintf(&md, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range res {
		fmt.Fprintf(&md, "| %s | %d | %d | %.1f | %.1f | %.1f | %.0f | %d | %d | %d | %.2f | %.2f |\n", r.Mode, r.Size, r.RoundTrip.Count,
			us(r.RoundTrip.P50), us(r.RoundTrip.P99), us(r.RoundTrip.P999), us(r.RoundTrip.Max), r.Lost, r.Sent, r.Delivered, r.Gbps, r.CPUPerGB)
	}
	return write(dir, "udp", res, md.String())
}
