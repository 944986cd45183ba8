//go:build tools

// Package testruntime pins the container runtime of the tests' kubelet nodes: `go build` of these
// import paths inside this module gives containerd, its runc shim and ctr (runc itself and the CNI
// plugins come from Debian).
package testruntime

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
)
