// Command etcd is upstream etcd's server entry point (go.etcd.io/etcd/server/v3/etcdmain), built at the
// version go.mod pins; etcd's own main package lives in a module that is not meant to be required.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
