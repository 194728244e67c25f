package check

import (
	"fmt"
	"net"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
)

// TestEmbedded: the embedded variant (deploy/k8s/embedded) runs three
// shardd as a StatefulSet whose embedded servers route to each other by
// the pods' stable names through a headless service that publishes them
// before they are ready; all three start at once; each stores JetStream on
// its own claimed volume; the probes ask shardd's listener; no NATS_URL
// (which would replace the embedded server); the environment is shardd's;
// the grace period covers a graceful leave.
func TestEmbedded(t *testing.T) {
	o := load(t, embeddedDir)
	if len(o.deployments) != 0 || o.statefulSets["nats"] != nil {
		t.Errorf("the embedded variant runs no other workload: %d Deployments, StatefulSet nats %v", len(o.deployments), o.statefulSets["nats"] != nil)
	}
	s := o.statefulSets["shardd"]
	if s == nil {
		t.Fatal("no StatefulSet shardd")
	}
	if s.Spec.Replicas == nil || *s.Spec.Replicas != 3 {
		t.Fatalf("replicas %v, want 3", s.Spec.Replicas)
	}
	if s.Spec.PodManagementPolicy != appsv1.ParallelPodManagement {
		t.Errorf("podManagementPolicy %q: the members need each other before any is ready: Parallel", s.Spec.PodManagementPolicy)
	}
	if s.Spec.UpdateStrategy.Type != "" && s.Spec.UpdateStrategy.Type != appsv1.RollingUpdateStatefulSetStrategyType {
		t.Errorf("updateStrategy %q: a rolling update, one ready pod at a time", s.Spec.UpdateStrategy.Type)
	}
	if g := s.Spec.Template.Spec.TerminationGracePeriodSeconds; g == nil || *g < 50 {
		t.Errorf("terminationGracePeriodSeconds %s: a graceful leave takes up to 30 s of handoffs + 20 s to close", orUnset(g))
	}
	h := o.services[s.Spec.ServiceName]
	if h == nil || h.Spec.ClusterIP != corev1.ClusterIPNone || !h.Spec.PublishNotReadyAddresses {
		t.Fatalf("serviceName %q: want a headless service (clusterIP None) that publishes pods before they are ready", s.Spec.ServiceName)
	}
	pods := labels.Set(s.Spec.Template.Labels)
	for name, svc := range o.services {
		if len(svc.Spec.Selector) == 0 || !labels.SelectorFromSet(svc.Spec.Selector).Matches(pods) {
			t.Errorf("service %s does not select the shardd pods %v", name, pods)
		}
	}
	c := container(t, s.Spec.Template.Spec, "shardd")
	i := slices.Index(c.Args, "--http")
	if i < 0 || i+1 >= len(c.Args) {
		t.Fatalf("args %q: no --http ADDR", c.Args)
	}
	listen := c.Args[i+1]
	for _, p := range []struct {
		name  string
		probe *corev1.Probe
		path  string
	}{{"readinessProbe", c.ReadinessProbe, "/readyz"}, {"livenessProbe", c.LivenessProbe, "/healthz"}, {"startupProbe", c.StartupProbe, "/healthz"}} {
		if p.probe == nil || p.probe.HTTPGet == nil || p.probe.HTTPGet.Path != p.path {
			t.Errorf("%s: want an HTTP GET of %s", p.name, p.path)
			continue
		}
		if port := portOf(t, c, p.probe.HTTPGet.Port); !strings.HasSuffix(listen, fmt.Sprintf(":%d", port)) {
			t.Errorf("%s asks port %d; shardd listens on %s", p.name, port, listen)
		}
	}

	sh := readShardd(t)
	for _, e := range c.Env {
		if !slices.Contains(sh.env, e.Name) && !strings.HasPrefix(e.Name, "OTEL_") {
			t.Errorf("env %s: shardd reads no such variable (it reads %s)", e.Name, strings.Join(sh.env, ", "))
		}
	}
	env := func(name string) string {
		e, _ := envOf(c, name)
		return e.Value
	}
	if _, ok := envOf(c, "NATS_URL"); ok {
		t.Error("NATS_URL is set: shardd would connect to it instead of starting its embedded server")
	}
	if e, ok := envOf(c, "NATSHARD_REGION"); !ok || e.ValueFrom == nil || e.ValueFrom.FieldRef == nil || e.ValueFrom.FieldRef.FieldPath != "metadata.name" {
		t.Errorf("NATSHARD_REGION %+v: each region needs a unique id: the pod's name", e)
	}
	if r := env("NATSHARD_REPLICAS"); r != "" && r != "0" && r != "3" {
		t.Errorf("NATSHARD_REPLICAS %q: auto (the cluster's size) or 3", r)
	}
	portIs := func(variable, portName string) {
		_, port, err := net.SplitHostPort(env(variable))
		if err != nil || port != fmt.Sprint(portNamed(t, c, portName)) {
			t.Errorf("%s %q: want the container port %s (%d)", variable, env(variable), portName, portNamed(t, c, portName))
		}
	}
	portIs("NATSHARD_LISTEN", "client")
	portIs("NATSHARD_CLUSTER", "cluster")
	// Every member's route, by its stable name.
	var want []string
	for n := range int(*s.Spec.Replicas) {
		want = append(want, fmt.Sprintf("nats-route://%s-%d.%s:%d", s.Name, n, h.Name, portNamed(t, c, "cluster")))
	}
	if got := env("NATSHARD_ROUTES"); got != strings.Join(want, ",") {
		t.Errorf("NATSHARD_ROUTES %q, want %q", got, strings.Join(want, ","))
	}
	// JetStream (and the server's name) on the claimed volume.
	mounts := map[string]string{}
	for _, m := range c.VolumeMounts {
		mounts[m.Name] = m.MountPath
	}
	if len(s.Spec.VolumeClaimTemplates) != 1 || env("NATSHARD_DATA_DIR") == "" || mounts[s.Spec.VolumeClaimTemplates[0].Name] != env("NATSHARD_DATA_DIR") {
		t.Errorf("NATSHARD_DATA_DIR %q is not the mount of the volume claim template", env("NATSHARD_DATA_DIR"))
	}
}
