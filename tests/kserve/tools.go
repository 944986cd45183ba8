//go:build tools

// Package testkserve pins the commands the tests build: `go build` of these import paths inside this
// module gives KServe's controller manager and its local-model controller.
package testkserve

import (
	_ "github.com/kserve/kserve/cmd/localmodel"
	_ "github.com/kserve/kserve/cmd/manager"
)
