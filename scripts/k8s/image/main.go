// Command mkimage writes an image archive (docker save format, which
// `ctr images import` takes) of one layer holding the files given, for the
// kubelet of make test-k8s: no image registry is reachable from here.
//
//	mkimage -o out.tar -ref shunt-test.local/web:1 -entrypoint /web /path/to/web=/web
package main

import (
	"archive/tar"
	"bytes"
	"flag"
	"fmt"
	"os"
	"path"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

func main() {
	out := flag.String("o", "", "the archive to write")
	ref := flag.String("ref", "", "the image's name and tag")
	entry := flag.String("entrypoint", "", "the image's entrypoint")
	flag.Usage = func() {
		fmt.Fprintln(flag.CommandLine.Output(), "usage: mkimage -o out.tar -ref name:tag -entrypoint /prog src=/dst...")
		flag.PrintDefaults()
	}
	flag.Parse()
	if *out == "" || *ref == "" || *entry == "" || flag.NArg() == 0 {
		flag.Usage()
		os.Exit(2)
	}
	if err := write(*out, *ref, *entry, flag.Args()); err != nil {
		fmt.Fprintln(os.Stderr, "mkimage:", err)
		os.Exit(1)
	}
}

func write(out, ref, entry string, files []string) error {
	tag, err := name.NewTag(ref)
	if err != nil {
		return err
	}
	layer, err := layerOf(files)
	if err != nil {
		return err
	}
	img, err := mutate.AppendLayers(empty.Image, layer)
	if err != nil {
		return err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", "amd64"
	cf.Config = v1.Config{Entrypoint: []string{entry}}
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		return err
	}
	return tarball.WriteToFile(out, tag, img)
}

// layerOf is a layer with each src=dst file, executable, and the
// directories above them.
func layerOf(files []string) (v1.Layer, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	dirs := map[string]bool{}
	for _, f := range files {
		src, dst, ok := strings.Cut(f, "=")
		if !ok || !path.IsAbs(dst) {
			return nil, fmt.Errorf("%q: want src=/dst", f)
		}
		b, err := os.ReadFile(src)
		if err != nil {
			return nil, err
		}
		var parents []string
		for d := path.Dir(dst); d != "/"; d = path.Dir(d) {
			parents = append([]string{d}, parents...)
		}
		for _, d := range parents {
			if !dirs[d] {
				dirs[d] = true
				if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d[1:] + "/", Mode: 0o755}); err != nil {
					return nil, err
				}
			}
		}
		if err := tw.WriteHeader(&tar.Header{Name: dst[1:], Mode: 0o755, Size: int64(len(b))}); err != nil {
			return nil, err
		}
		if _, err := tw.Write(b); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return tarball.LayerFromReader(bytes.NewReader(buf.Bytes()))
}
