// Command web is the workload of make test-k8s's pods: it serves the files
// of a directory over HTTP from memory (written, not sent with sendfile:
// what an application's own buffers look like to shunt).
//
//	web -dir /www -addr :8080
package main

import (
	"flag"
	"log"
	"net/http"
	"os"
	"path/filepath"
)

func main() {
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
