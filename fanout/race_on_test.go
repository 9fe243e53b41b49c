//go:build race

package fanout_test

// raceEnabled: the race detector multiplies each subscriber's memory, so the
// load tests run at their -short size under it.
const raceEnabled = true
