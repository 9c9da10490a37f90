// Command etcd is the upstream etcd server (go.etcd.io/etcd/server/v3 at the version
// k8s.io/kubernetes requires), so the test cluster needs no etcd package. It adds nothing.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
