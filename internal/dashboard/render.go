package dashboard

import (
	"context"
	"errors"
	"fmt"
	"image/color"
	"math"
	"os"
	"sort"
	"time"

	v1 "github.com/prometheus/client_golang/api/prometheus/v1"
	"github.com/prometheus/common/model"
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/font"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// Grafana's grid: 24 columns, rows 30 pixels high (at 96 dpi: 22.5 points).
const (
	columns  = 24
	width    = 1800 * vg.Inch / 96
	rowH     = 30 * vg.Inch / 96
	headerH  = 2 * rowH
	gutter   = 4 * vg.Inch / 96
	maxLines = 12 // series drawn per panel, largest first
)

// Range is the window a rendering covers and its resolution.
type Range struct {
	Start, End   time.Time
	Step         time.Duration
	RateInterval time.Duration // what $__rate_interval stands for
}

// Render draws d's panels laid out as Grafana lays them out, each from
// prom's data over r, into a PNG file at out. A panel whose query fails is
// drawn with the error in it; Render fails only if every query failed.
func Render(ctx context.Context, prom v1.API, d *Dashboard, r Range, out string) error {
	rows := 0
	for _, p := range d.Panels {
		rows = max(rows, p.GridPos.Y+p.GridPos.H)
	}
	height := headerH + vg.Length(rows)*rowH
	img := vgimg.NewWith(vgimg.UseWH(width, height), vgimg.UseDPI(96))
	dc := draw.New(img)
	dc.SetColor(color.White)
	dc.Fill(dc.Rectangle.Path())
	dc.FillText(textStyle(16, draw.XLeft, draw.YCenter), vg.Point{X: gutter * 2, Y: height - headerH/2},
		fmt.Sprintf("%s: %s to %s (UTC)", d.Title, r.Start.UTC().Format("2006-01-02 15:04:05"), r.End.UTC().Format("15:04:05")))

	queries, failed := 0, 0
	for _, p := range d.Panels {
		c := cell(dc, height, p)
		switch p.Type {
		case "row":
			c.FillText(textStyle(14, draw.XLeft, draw.YCenter), vg.Point{X: c.Min.X + gutter, Y: (c.Min.Y + c.Max.Y) / 2}, p.Title)
			continue
		case "stat":
			queries++
			if err := stat(ctx, prom, c, p, r); err != nil {
				failed++
				message(c, p.Title, err.Error())
			}
		default:
			queries++
			if err := timeseries(ctx, prom, c, p, r); err != nil {
				failed++
				message(c, p.Title, err.Error())
			}
		}
	}
	if queries > 0 && failed == queries {
		return errors.New("every panel's query failed: is Prometheus scraping shunt?")
	}
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// cell is the panel's place on the canvas (Grafana counts rows from the
// top, the canvas from the bottom), less a gutter.
func cell(dc draw.Canvas, height vg.Length, p Panel) draw.Canvas {
	colW := width / columns
	top := headerH + vg.Length(p.GridPos.Y)*rowH
	c := dc
	c.Min = vg.Point{X: vg.Length(p.GridPos.X)*colW + gutter, Y: height - top - vg.Length(p.GridPos.H)*rowH + gutter}
	c.Max = vg.Point{X: vg.Length(p.GridPos.X+p.GridPos.W)*colW - gutter, Y: height - top - gutter}
	if p.Type != "row" {
		c.SetColor(color.Gray{Y: 200})
		c.SetLineWidth(vg.Points(0.5))
		c.Stroke(c.Rectangle.Path())
	}
	return c
}

func textStyle(size vg.Length, x draw.XAlignment, y draw.YAlignment) draw.TextStyle {
	return draw.TextStyle{
		Color:   color.Black,
		Font:    font.From(plot.DefaultFont, size),
		Handler: plot.DefaultTextHandler,
		XAlign:  x,
		YAlign:  y,
	}
}

func message(c draw.Canvas, title, msg string) {
	c.FillText(textStyle(11, draw.XLeft, draw.YTop), vg.Point{X: c.Min.X + gutter, Y: c.Max.Y - gutter}, title)
	c.FillText(textStyle(9, draw.XCenter, draw.YCenter), c.Center(), msg)
}

// stat draws the panel's value at the end of the range, as a stat panel
// shows the last value.
func stat(ctx context.Context, prom v1.API, c draw.Canvas, p Panel, r Range) error {
	var vals []string
	for _, t := range p.Targets {
		v, _, err := prom.Query(ctx, t.Query(r.RateInterval), r.End)
		if err != nil {
			return err
		}
		vec, _ := v.(model.Vector)
		for _, s := range vec {
			vals = append(vals, formatValue(float64(s.Value), p.FieldConfig.Defaults.Unit))
		}
	}
	c.FillText(textStyle(11, draw.XLeft, draw.YTop), vg.Point{X: c.Min.X + gutter, Y: c.Max.Y - gutter}, p.Title)
	text := "No data"
	if len(vals) > 0 {
		text = vals[0]
		for _, v := range vals[1:] {
			text += "  " + v
		}
	}
	c.FillText(textStyle(28, draw.XCenter, draw.YCenter), vg.Point{X: (c.Min.X + c.Max.X) / 2, Y: (c.Min.Y+c.Max.Y)/2 - rowH/3}, text)
	return nil
}

type series struct {
	name string
	xys  plotter.XYs
	peak float64
}

// timeseries draws every series of the panel's queries over the range.
func timeseries(ctx context.Context, prom v1.API, c draw.Canvas, p Panel, r Range) error {
	var all []series
	for _, t := range p.Targets {
		v, _, err := prom.QueryRange(ctx, t.Query(r.RateInterval), v1.Range{Start: r.Start, End: r.End, Step: r.Step})
		if err != nil {
			return err
		}
		m, _ := v.(model.Matrix)
		for _, s := range m {
			labels := map[string]string{}
			for k, v := range s.Metric {
				labels[string(k)] = string(v)
			}
			se := series{name: t.Legend(labels)}
			for _, pt := range s.Values {
				y := float64(pt.Value)
				if math.IsNaN(y) || math.IsInf(y, 0) {
					continue
				}
				se.xys = append(se.xys, plotter.XY{X: float64(pt.Timestamp.Unix()), Y: y})
				se.peak = max(se.peak, y)
			}
			if len(se.xys) > 0 {
				all = append(all, se)
			}
		}
	}
	pl := plot.New()
	pl.Title.Text = p.Title
	pl.Title.TextStyle.Font.Size = 11
	pl.X.Tick.Marker = plot.TimeTicks{Format: "15:04:05", Time: plot.UnixTimeIn(time.UTC)}
	pl.X.Min, pl.X.Max = float64(r.Start.Unix()), float64(r.End.Unix())
	pl.Y.Min = 0
	pl.Y.Label.Text = unitLabel(p.FieldConfig.Defaults.Unit)
	pl.Y.Tick.Marker = unitTicks{p.FieldConfig.Defaults.Unit}
	pl.Legend.Top = true
	pl.Legend.Left = true
	pl.Legend.TextStyle.Font.Size = 8
	pl.Add(plotter.NewGrid())
	if len(all) == 0 {
		pl.Y.Max = 1
		pl.Draw(c)
		c.FillText(textStyle(11, draw.XCenter, draw.YCenter), c.Center(), "No data")
		return nil
	}
	sort.SliceStable(all, func(i, j int) bool { return all[i].peak > all[j].peak })
	if len(all) > maxLines {
		all = all[:maxLines]
	}
	for i, s := range all {
		l, err := plotter.NewLine(s.xys)
		if err != nil {
			return err
		}
		l.Color = plotutil.Color(i)
		l.Width = vg.Points(1.5)
		pl.Add(l)
		pl.Legend.Add(s.name, l)
		pl.Y.Max = max(pl.Y.Max, s.peak*1.25)
	}
	if p.FieldConfig.Defaults.Unit == "percentunit" && pl.Y.Max > 1 && pl.Y.Max <= 1.25 {
		pl.Y.Max = 1 // a share's axis ends at 100%
	}
	pl.Draw(c)
	return nil
}
