package agent

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"
)

// stats are the agent's own metrics, served beside shunt's.
type stats struct {
	mu         sync.Mutex
	reconciled map[string]uint64 // by result
	reloaded   map[string]uint64 // by result
	applied    map[string]uint64 // policy applies, by result
	enabled    int
}

var (
	reconcilesDesc = prometheus.NewDesc("shunt_agent_reconciles_total", "Reconciliations of the machine with the configuration, by result (failed ones are logged).", []string{"result"}, nil)
	reloadsDesc    = prometheus.NewDesc("shunt_agent_config_reloads_total", "Configuration reloads (SIGHUP or a change of the file), by result (a failed one keeps the previous configuration).", []string{"result"}, nil)
	policyDesc     = prometheus.NewDesc("shunt_agent_policy_applies_total", "Applies of the policy file, by result (a failed one keeps the rules in force and is logged).", []string{"result"}, nil)
	enabledDesc    = prometheus.NewDesc("shunt_agent_cgroups_enabled", "Cgroups bypass is enabled for, as of the last reconciliation.", nil, nil)
)

func (s *stats) reconciles(result string)    { s.count(&s.reconciled, result) }
func (s *stats) reloads(result string)       { s.count(&s.reloaded, result) }
func (s *stats) policyApplies(result string) { s.count(&s.applied, result) }

func (s *stats) count(m *map[string]uint64, result string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if *m == nil {
		*m = map[string]uint64{}
	}
	(*m)[result]++
}

func (s *stats) setEnabled(n int) {
	s.mu.Lock()
	s.enabled = n
	s.mu.Unlock()
}

// Describe and Collect make stats a prometheus.Collector.
func (s *stats) Describe(ch chan<- *prometheus.Desc) {
	ch <- reconcilesDesc
	ch <- reloadsDesc
	ch <- policyDesc
	ch <- enabledDesc
}

func (s *stats) Collect(ch chan<- prometheus.Metric) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, result := range []string{"ok", "failed"} {
		ch <- prometheus.MustNewConstMetric(reconcilesDesc, prometheus.CounterValue, float64(s.reconciled[result]), result)
		ch <- prometheus.MustNewConstMetric(reloadsDesc, prometheus.CounterValue, float64(s.reloaded[result]), result)
		ch <- prometheus.MustNewConstMetric(policyDesc, prometheus.CounterValue, float64(s.applied[result]), result)
	}
	ch <- prometheus.MustNewConstMetric(enabledDesc, prometheus.GaugeValue, float64(s.enabled))
}
