package bench

import (
	"context"
	"fmt"
	"io"
)

// cell is one mode at one size.
type cell struct {
	mode string
	size int
}

// sweepCells runs run for every size and mode, modes interleaved within a
// size and rounds outermost, so drift on a noisy machine hits every cell
// alike. It returns the cells in the order of the first round; what names
// the benchmark in progress lines.
func sweepCells(ctx context.Context, what string, rounds int, sizes []int, modes []string, progress io.Writer, run func(cell) error) ([]cell, error) {
	var order []cell
	for round := 1; round <= rounds; round++ {
		for _, size := range sizes {
			for _, mode := range modes {
				if err := ctx.Err(); err != nil {
					return nil, err
				}
				c := cell{mode, size}
				if round == 1 {
					order = append(order, c)
				}
				if progress != nil {
					fmt.Fprintf(progress, "%s round %d: %s, %d B\n", what, round, mode, size)
				}
				if err := run(c); err != nil {
					return nil, fmt.Errorf("%s, %d B: %w", mode, size, err)
				}
			}
		}
	}
	return order, nil
}
