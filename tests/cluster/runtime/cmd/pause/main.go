// Command pause is the process of every pod sandbox on the tests' kubelet nodes (the image pinned as
// containerd's sandbox image): it holds the pod's namespaces, reaps the zombies of a shared PID
// namespace and exits on SIGINT or SIGTERM. No registry can be reached here, so it is built, not pulled.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var status syscall.WaitStatus
			if pid, _ := syscall.Wait4(-1, &status, syscall.WNOHANG, nil); pid <= 0 {
				break
			}
		}
	}
}
