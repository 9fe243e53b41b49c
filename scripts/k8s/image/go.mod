// What make test-k8s puts into containers: the images' programs and the
// tool that writes image archives (no image registry is reachable here).
module github.com/shunt-project/shunt/scripts/k8s/image

go 1.25.0

require github.com/google/go-containerregistry v0.22.1

require (
	github.com/klauspost/compress v1.19.2 // indirect
	github.com/opencontainers/go-digest v1.0.0 // indirect
	github.com/opencontainers/image-spec v1.1.1 // indirect
)
