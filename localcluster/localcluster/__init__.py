"""A real Kubernetes control plane on loopback, for tests and the local demo.

Pinned etcd, kube-apiserver, kube-scheduler and kube-controller-manager are built from their Go
modules once and cached outside the clone (:mod:`localcluster.build`), started with generated
certificates (:mod:`localcluster.cluster`), and given fake GPU nodes (:mod:`localcluster.nodes`).
"""
