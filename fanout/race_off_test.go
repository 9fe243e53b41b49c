//go:build !race

package fanout_test

const raceEnabled = false
