"""``fthsdp k8s``: Kubernetes manifests for a fault-tolerant job (docs/kubernetes.md). Not run on a cluster here:
the tests check their structure only."""
