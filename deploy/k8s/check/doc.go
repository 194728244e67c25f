// Package check validates the Kubernetes manifests of deploy/k8s (and of
// its embedded-cluster variant, deploy/k8s/embedded) offline:
// its test decodes every manifest strictly into the official API types of
// k8s.io/api (unknown or misspelt fields, wrong types and duplicate keys
// are errors, as for the API server) and checks what natshard relies on:
// the probes ask shardd's /healthz and /readyz on the port it serves, the
// PodDisruptionBudgets select the workloads' pods, the grace period covers
// a graceful leave, the environment variables are shardd's, the NATS
// servers route to each other and ping as natshard needs; in the embedded
// variant, the shardd route to each other by their stable names.
//
// It is a Go module of its own, so that the main module does not depend on
// Kubernetes' packages. Run it with
//
//	cd deploy/k8s/check && go test ./...
//
// (.ci/run does). It needs no cluster and no network but the Go module
// proxy, unlike kubeconform, which downloads its JSON schemas.
package check
