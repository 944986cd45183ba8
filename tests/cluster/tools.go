//go:build tools

// Package testcluster pins the commands the tests build: `go build` of these import paths inside this
// module gives kube-apiserver, kube-controller-manager, kube-scheduler, kubectl and etcd, and a node's
// kubelet and kube-proxy.
package testcluster

import (
	_ "go.etcd.io/etcd/server/v3/etcdmain"
	_ "k8s.io/kubernetes/cmd/kube-apiserver/app"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	_ "k8s.io/kubernetes/cmd/kube-proxy/app"
	_ "k8s.io/kubernetes/cmd/kube-scheduler/app"
	_ "k8s.io/kubernetes/cmd/kubelet/app"
	_ "k8s.io/kubectl/pkg/cmd"
)
