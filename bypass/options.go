package bypass

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/cilium/ebpf"
)

// Options reads back the options the install was created with: they live in
// the read-only data (the volatile const cfg) of its sockops program, and
// the splice refusal's link, and stay as they were for as long as the
// install exists.
func (in *Install) Options() (Options, error) {
	cfg, err := in.config()
	if err != nil {
		return Options{}, fmt.Errorf("read install options: %w", err)
	}
	_, refusal := os.Stat(filepath.Join(in.dir, linksDir, refuseLink))
	return Options{MaxBacklog: cfg.MaxBacklog, TrustReaders: cfg.TrustReaders != 0, RefuseSplice: refusal == nil, PairBrief: cfg.BriefStreak == 0, NoProbation: cfg.ProbationReads == 0, NoFIONREADWatch: cfg.NoFionreadWatch != 0}, nil
}

// config reads the configuration the install's programs were loaded with.
func (in *Install) config() (bypassConfig, error) {
	var cfg bypassConfig
	spec, err := newSpec()
	if err != nil {
		return cfg, err
	}
	v, ok := spec.Variables["cfg"]
	if !ok {
		return cfg, fmt.Errorf("the BPF object has no cfg")
	}
	info, err := in.sockops.Info()
	if err != nil {
		return cfg, err
	}
	ids, _ := info.MapIDs()
	for _, id := range ids {
		m, err := ebpf.NewMapFromID(id)
		if err != nil {
			continue
		}
		mi, err := m.Info()
		if err != nil || !strings.HasSuffix(mi.Name, ".rodata") {
			m.Close()
			continue
		}
		data := make([]byte, m.ValueSize())
		err = m.Lookup(uint32(0), data)
		m.Close()
		if err != nil {
			return cfg, err
		}
		if int(v.Offset)+int(v.Size()) > len(data) {
			return cfg, fmt.Errorf("the installed programs are of another shunt version")
		}
		err = binary.Read(bytes.NewReader(data[v.Offset:v.Offset+v.Size()]), binary.NativeEndian, &cfg)
		return cfg, err
	}
	return cfg, fmt.Errorf("the sockops program has no read-only data")
}
