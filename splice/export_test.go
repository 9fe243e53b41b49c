package splice

// DropRepeated runs the user-space half of repeat removal on a direction
// whose ring holds the given repeats (pairs of stream position and length).
func DropRepeated(b []byte, pos uint64, repeats ...[2]uint64) (kept []byte, left int) {
	var shared spliceSpliceDir
	for i, r := range repeats {
		shared.Skips[i].Pos = r[0]
		shared.Skips[i].Len = uint32(r[1])
	}
	shared.SkipHead = uint32(len(repeats))
	d := &direction{shared: &shared}
	kept = d.dropRepeated(b, pos)
	return kept, int(shared.SkipHead - shared.SkipTail)
}
