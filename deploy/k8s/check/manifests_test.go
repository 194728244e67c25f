package check

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"
)

// manifestDir holds the manifests, embeddedDir the embedded cluster's
// variant; repoRoot is the main module.
const (
	manifestDir = ".."
	embeddedDir = "../embedded"
	repoRoot    = "../../.."
)

// objects are the decoded manifests, by kind and name.
type objects struct {
	configMaps   map[string]*corev1.ConfigMap
	services     map[string]*corev1.Service
	statefulSets map[string]*appsv1.StatefulSet
	deployments  map[string]*appsv1.Deployment
	budgets      map[string]*policyv1.PodDisruptionBudget
}

// decodeStrict decodes one YAML document into the API type its apiVersion
// and kind name, refusing unknown fields, duplicate keys and wrong types.
func (o *objects) decodeStrict(doc []byte) (string, error) {
	var tm metav1.TypeMeta
	if err := yaml.Unmarshal(doc, &tm); err != nil {
		return "", err
	}
	id := tm.APIVersion + " " + tm.Kind
	var name string
	strict := func(v interface{ GetName() string }) error {
		if err := yaml.UnmarshalStrict(doc, v); err != nil {
			return fmt.Errorf("%s: %w", id, err)
		}
		name = v.GetName()
		if name == "" {
			return fmt.Errorf("%s without metadata.name", id)
		}
		return nil
	}
	var err error
	switch id {
	case "v1 ConfigMap":
		v := &corev1.ConfigMap{}
		err = strict(v)
		o.configMaps[name] = v
	case "v1 Service":
		v := &corev1.Service{}
		err = strict(v)
		o.services[name] = v
	case "apps/v1 StatefulSet":
		v := &appsv1.StatefulSet{}
		err = strict(v)
		o.statefulSets[name] = v
	case "apps/v1 Deployment":
		v := &appsv1.Deployment{}
		err = strict(v)
		o.deployments[name] = v
	case "policy/v1 PodDisruptionBudget":
		v := &policyv1.PodDisruptionBudget{}
		err = strict(v)
		o.budgets[name] = v
	default:
		err = fmt.Errorf("%q: a kind this check does not know (add it to decodeStrict)", id)
	}
	return id + " " + name, err
}

// load decodes every document of every *.yaml file of dir.
func load(t *testing.T, dir string) *objects {
	t.Helper()
	o := &objects{
		configMaps: map[string]*corev1.ConfigMap{}, services: map[string]*corev1.Service{},
		statefulSets: map[string]*appsv1.StatefulSet{}, deployments: map[string]*appsv1.Deployment{},
		budgets: map[string]*policyv1.PodDisruptionBudget{},
	}
	files, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no manifests in %s: %v", dir, err)
	}
	seen := map[string]string{}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for i, doc := range documents(data) {
			id, err := o.decodeStrict(doc)
			if err != nil {
				t.Errorf("%s, document %d: %v", f, i+1, err)
				continue
			}
			if prev, dup := seen[id]; dup {
				t.Errorf("%s, document %d: %s again (first in %s)", f, i+1, id, prev)
			}
			seen[id] = f
		}
	}
	return o
}

// documents splits a YAML stream at its "---" lines, dropping documents
// that hold only comments.
func documents(data []byte) [][]byte {
	var docs [][]byte
	for _, d := range regexp.MustCompile(`(?m)^---\s*$`).Split(string(data), -1) {
		for _, line := range strings.Split(d, "\n") {
			if l := strings.TrimSpace(line); l != "" && !strings.HasPrefix(l, "#") {
				docs = append(docs, []byte(d))
				break
			}
		}
	}
	return docs
}

// TestStrictDecoding: the check refuses what the API server would.
func TestStrictDecoding(t *testing.T) {
	base := "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: x\nspec:\n"
	for _, tc := range []struct{ doc, want string }{
		{base + "  replica: 3\n", `unknown field "replica"`},
		{base + "  replicas: three\n", "cannot unmarshal"},
		{base + "  replicas: 3\n  replicas: 4\n", "already set"},
		{"apiVersion: apps/v1beta1\nkind: Deployment\nmetadata:\n  name: x\n", "a kind this check does not know"},
		{"apiVersion: v1\nkind: Service\nspec: {}\n", "without metadata.name"},
	} {
		o := &objects{deployments: map[string]*appsv1.Deployment{}, services: map[string]*corev1.Service{}}
		if _, err := o.decodeStrict([]byte(tc.doc)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: %v, want an error with %q", tc.doc, err, tc.want)
		}
	}
}

// shardd is what shardd's --help says it takes.
type shardd struct {
	flags []string // without dashes
	env   []string
}

// readShardd runs the main module's shardd --help (which lists each flag
// with its environment variable in brackets).
func readShardd(t *testing.T) shardd {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", "run", "./cmd/shardd", "--help")
	cmd.Dir = repoRoot
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		t.Fatalf("shardd --help: %v\n%s", err, out.String())
	}
	var s shardd
	for _, m := range regexp.MustCompile(`(?m)^  -([a-z0-9-]+)`).FindAllStringSubmatch(out.String(), -1) {
		s.flags = append(s.flags, m[1])
	}
	for _, m := range regexp.MustCompile(`\[(NATS_URL|NATSHARD_[A-Z0-9_]+)\]`).FindAllStringSubmatch(out.String(), -1) {
		s.env = append(s.env, m[1])
	}
	if len(s.flags) < 10 || !slices.Contains(s.env, "NATS_URL") {
		t.Fatalf("shardd --help does not list its flags and variables as expected:\n%s", out.String())
	}
	return s
}

func container(t *testing.T, spec corev1.PodSpec, name string) corev1.Container {
	t.Helper()
	for _, c := range spec.Containers {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("no container %q", name)
	return corev1.Container{}
}

// portOf resolves a probe's port (a number, or the name of a container
// port) to a number.
func portOf(t *testing.T, c corev1.Container, p intstr.IntOrString) int32 {
	t.Helper()
	if p.Type == intstr.Int {
		return p.IntVal
	}
	for _, cp := range c.Ports {
		if cp.Name == p.StrVal {
			return cp.ContainerPort
		}
	}
	t.Fatalf("container %s has no port named %q", c.Name, p.StrVal)
	return 0
}

func envOf(c corev1.Container, name string) (corev1.EnvVar, bool) {
	i := slices.IndexFunc(c.Env, func(e corev1.EnvVar) bool { return e.Name == name })
	if i < 0 {
		return corev1.EnvVar{}, false
	}
	return c.Env[i], true
}

// TestShardd: the Deployment runs three shardd whose probes ask the HTTP
// listener they are told to serve, whose environment is shardd's, whose
// NATS_URL names every server of the StatefulSet, and whose grace period
// covers a graceful leave (30 s of handoffs, then up to 20 s to close).
func TestShardd(t *testing.T) {
	o := load(t, manifestDir)
	d := o.deployments["shardd"]
	if d == nil {
		t.Fatal("no Deployment shardd")
	}
	if d.Spec.Replicas == nil || *d.Spec.Replicas != 3 {
		t.Errorf("replicas %v, want 3", d.Spec.Replicas)
	}
	if g := d.Spec.Template.Spec.TerminationGracePeriodSeconds; g == nil || *g < 50 {
		t.Errorf("terminationGracePeriodSeconds %s: a graceful leave takes up to 30 s of handoffs + 20 s to close", orUnset(g))
	}
	if ru := d.Spec.Strategy.RollingUpdate; ru == nil || ru.MaxUnavailable == nil || ru.MaxUnavailable.IntValue() != 0 {
		t.Errorf("rolling update %+v: a new region should be ready before an old one leaves (maxUnavailable 0)", ru)
	}
	c := container(t, d.Spec.Template.Spec, "shardd")

	// --http ADDR: the probes' port is the listener's.
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
		if p.probe == nil || p.probe.HTTPGet == nil {
			t.Errorf("%s: none, or not an HTTP GET", p.name)
			continue
		}
		if p.probe.HTTPGet.Path != p.path {
			t.Errorf("%s asks %s, want %s", p.name, p.probe.HTTPGet.Path, p.path)
		}
		if port := portOf(t, c, p.probe.HTTPGet.Port); !strings.HasSuffix(listen, fmt.Sprintf(":%d", port)) {
			t.Errorf("%s asks port %d; shardd listens on %s", p.name, port, listen)
		}
	}

	s := readShardd(t)
	for _, e := range c.Env {
		// OpenTelemetry's own variables configure shardd's tracing
		// (its --help says so); the rest must be shardd's.
		if !slices.Contains(s.env, e.Name) && !strings.HasPrefix(e.Name, "OTEL_") {
			t.Errorf("env %s: shardd reads no such variable (it reads %s)", e.Name, strings.Join(s.env, ", "))
		}
	}
	t.Run("flags", func(t *testing.T) {
		for _, a := range c.Args {
			name, ok := strings.CutPrefix(a, "--")
			if !ok {
				continue
			}
			name, _, _ = strings.Cut(name, "=")
			if !slices.Contains(s.flags, name) {
				t.Errorf("args: shardd has no flag --%s", name)
			}
		}
	})

	if e, ok := envOf(c, "NATSHARD_REGION"); !ok || e.ValueFrom == nil || e.ValueFrom.FieldRef == nil || e.ValueFrom.FieldRef.FieldPath != "metadata.name" {
		t.Errorf("NATSHARD_REGION %+v: each region needs a unique id: the pod's name", e)
	}
	// NATS_URL: every server of the StatefulSet, by its stable name.
	nats := o.statefulSets["nats"]
	if nats == nil || nats.Spec.Replicas == nil {
		t.Fatal("no StatefulSet nats with replicas")
	}
	url, _ := envOf(c, "NATS_URL")
	var want []string
	for i := range int(*nats.Spec.Replicas) {
		want = append(want, fmt.Sprintf("nats://nats-%d.%s:%d", i, nats.Spec.ServiceName, 4222))
	}
	if url.Value != strings.Join(want, ",") {
		t.Errorf("NATS_URL %q, want %q", url.Value, strings.Join(want, ","))
	}
	if r, _ := envOf(c, "NATSHARD_REPLICAS"); r.Value != fmt.Sprint(*nats.Spec.Replicas) {
		t.Errorf("NATSHARD_REPLICAS %q: the bucket should be replicated on the %d servers", r.Value, *nats.Spec.Replicas)
	}
}

// TestDisruptionBudgets: each PodDisruptionBudget selects the pods of one
// workload of the manifests, and lets at most one go at a time.
func TestDisruptionBudgets(t *testing.T) {
	for _, dir := range []string{manifestDir, embeddedDir} {
		t.Run(filepath.Base(dir), func(t *testing.T) { checkBudgets(t, load(t, dir)) })
	}
}

func checkBudgets(t *testing.T, o *objects) {
	pods := map[string]map[string]string{} // workload -> its pods' labels
	selects := map[string]*metav1.LabelSelector{}
	for n, d := range o.deployments {
		pods["Deployment "+n], selects["Deployment "+n] = d.Spec.Template.Labels, d.Spec.Selector
	}
	for n, s := range o.statefulSets {
		pods["StatefulSet "+n], selects["StatefulSet "+n] = s.Spec.Template.Labels, s.Spec.Selector
	}
	// A workload's selector must select its own pods.
	for w, sel := range selects {
		s, err := metav1.LabelSelectorAsSelector(sel)
		if err != nil || s.Empty() || !s.Matches(labels.Set(pods[w])) {
			t.Errorf("%s: selector %v does not select its pods %v (%v)", w, sel, pods[w], err)
		}
	}
	covered := map[string]bool{}
	for n, b := range o.budgets {
		sel, err := metav1.LabelSelectorAsSelector(b.Spec.Selector)
		if err != nil || sel.Empty() {
			t.Errorf("PodDisruptionBudget %s: selector %v (%v)", n, b.Spec.Selector, err)
			continue
		}
		var matched []string
		for w, l := range pods {
			if sel.Matches(labels.Set(l)) {
				matched = append(matched, w)
			}
		}
		if len(matched) != 1 {
			t.Errorf("PodDisruptionBudget %s selects the pods of %v, want exactly one workload", n, matched)
			continue
		}
		covered[matched[0]] = true
		if b.Spec.MaxUnavailable == nil || b.Spec.MaxUnavailable.IntValue() != 1 || b.Spec.MinAvailable != nil {
			t.Errorf("PodDisruptionBudget %s: maxUnavailable %v, minAvailable %v; want maxUnavailable 1", n, b.Spec.MaxUnavailable, b.Spec.MinAvailable)
		}
	}
	for w := range pods {
		if !covered[w] {
			t.Errorf("%s has no PodDisruptionBudget", w)
		}
	}
}

// TestNATS: three servers with JetStream on their own volumes, routed to
// each other through a headless service that publishes them before they
// are ready, the ping settings natshard relies on, probes on the
// monitoring port, and a client service.
func TestNATS(t *testing.T) {
	o := load(t, manifestDir)
	s := o.statefulSets["nats"]
	if s == nil {
		t.Fatal("no StatefulSet nats")
	}
	if s.Spec.Replicas == nil || *s.Spec.Replicas != 3 {
		t.Errorf("replicas %v, want 3", s.Spec.Replicas)
	}
	h := o.services[s.Spec.ServiceName]
	if h == nil || h.Spec.ClusterIP != corev1.ClusterIPNone || !h.Spec.PublishNotReadyAddresses {
		t.Fatalf("serviceName %q: want a headless service (clusterIP None) that publishes pods before they are ready", s.Spec.ServiceName)
	}
	pods := labels.Set(s.Spec.Template.Labels)
	for _, name := range []string{h.Name, "nats"} {
		svc := o.services[name]
		if svc == nil || len(svc.Spec.Selector) == 0 || !labels.SelectorFromSet(svc.Spec.Selector).Matches(pods) {
			t.Errorf("service %s is missing or does not select the NATS pods %v", name, pods)
		}
	}
	c := container(t, s.Spec.Template.Spec, "nats")
	i := slices.Index(c.Args, "--config")
	if i < 0 || i+1 >= len(c.Args) {
		t.Fatalf("args %q: no --config", c.Args)
	}
	confPath := c.Args[i+1]
	mounts := map[string]string{} // volume -> path
	for _, m := range c.VolumeMounts {
		mounts[m.Name] = m.MountPath
	}
	// The configuration comes from a ConfigMap mounted where --config says.
	var conf string
	for _, v := range s.Spec.Template.Spec.Volumes {
		if v.ConfigMap == nil {
			continue
		}
		cm := o.configMaps[v.ConfigMap.Name]
		if cm == nil {
			t.Fatalf("volume %s: no ConfigMap %s", v.Name, v.ConfigMap.Name)
		}
		if filepath.Dir(confPath) == mounts[v.Name] {
			conf = cm.Data[filepath.Base(confPath)]
		}
	}
	if conf == "" {
		t.Fatalf("no ConfigMap holds %s", confPath)
	}
	// Whole lines of nats.conf: the ping settings of docs/OPERATIONS.md,
	// a unique name per server, JetStream, a route to each server.
	want := []string{`ping_interval: "2s"`, "ping_max: 3", "server_name: $SERVER_NAME", "jetstream {"}
	for n := range int(*s.Spec.Replicas) {
		want = append(want, fmt.Sprintf("nats-route://nats-%d.%s:%d", n, h.Name, portNamed(t, c, "cluster")))
	}
	for _, w := range want {
		if !regexp.MustCompile(`(?m)^\s*` + regexp.QuoteMeta(w) + `\s*$`).MatchString(conf) {
			t.Errorf("nats.conf lacks the line %q", w)
		}
	}
	if e, ok := envOf(c, "SERVER_NAME"); !ok || e.ValueFrom == nil || e.ValueFrom.FieldRef == nil || e.ValueFrom.FieldRef.FieldPath != "metadata.name" {
		t.Errorf("SERVER_NAME %+v: each server's name must be unique: the pod's", e)
	}
	// JetStream stores on the claimed volume.
	m := regexp.MustCompile(`store_dir:\s*(\S+)`).FindStringSubmatch(conf)
	if m == nil || len(s.Spec.VolumeClaimTemplates) != 1 || mounts[s.Spec.VolumeClaimTemplates[0].Name] != m[1] {
		t.Errorf("JetStream's store_dir %v is not the mount of the volume claim template", m)
	}
	for _, p := range []struct {
		name  string
		probe *corev1.Probe
	}{{"startupProbe", c.StartupProbe}, {"livenessProbe", c.LivenessProbe}, {"readinessProbe", c.ReadinessProbe}} {
		if p.probe == nil || p.probe.HTTPGet == nil || !strings.HasPrefix(p.probe.HTTPGet.Path, "/healthz") || portOf(t, c, p.probe.HTTPGet.Port) != 8222 {
			t.Errorf("%s: want nats-server's /healthz on its monitoring port 8222", p.name)
		}
	}
	for _, want := range []string{"listen: 0.0.0.0:4222", "http: 0.0.0.0:8222", "listen: 0.0.0.0:6222"} {
		if !strings.Contains(conf, want) {
			t.Errorf("nats.conf lacks %q, which the container's ports assume", want)
		}
	}
}

func portNamed(t *testing.T, c corev1.Container, name string) int32 {
	return portOf(t, c, intstr.FromString(name))
}

func orUnset(p *int64) string {
	if p == nil {
		return "unset (30 s)"
	}
	return fmt.Sprint(*p)
}
