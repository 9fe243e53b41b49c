// Command web is the workload of make test-k8s's pods. It serves the files
// of a directory over HTTP from memory (written, not sent with sendfile:
// what an application's own buffers look like to shunt); `web get URL`
// writes what URL answers to stdout, resolving names as the pod does (its
// /etc/resolv.conf: the cluster DNS and the namespace's search list).
//
//	web -dir /www -addr :8080
//	web get http://web-headless:8080/blob
package main

import (
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"path/filepath"
)

func main() {
	if len(os.Args) == 3 && os.Args[1] == "get" {
		if err := get(os.Args[2]); err != nil {
			fmt.Fprintln(os.Stderr, "web get:", err)
			os.Exit(1)
		}
		return
	}
	dir := flag.String("dir", "/www", "the directory served")
	addr := flag.String("addr", ":8080", "the address to listen on")
	flag.Parse()
	http.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		b, err := os.ReadFile(filepath.Join(*dir, filepath.Clean("/"+r.URL.Path)))
		if err != nil {
			http.NotFound(w, r)
			return
		}
		w.Write(b)
	})
	log.Fatal(http.ListenAndServe(*addr, nil))
}

func get(url string) error {
	resp, err := http.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", url, resp.Status)
	}
	_, err = io.Copy(os.Stdout, resp.Body)
	return err
}
