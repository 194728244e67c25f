// Package jobs runs jobs of steps on natshard: one entity per job, whose
// steps are durable reminders, so that a job goes on through crashes,
// moves and full restarts, and each step happens once. A job that runs is
// a remembered entity: after a crash or a restart the process that takes
// its shard starts it again at once, without a message, and it goes on
// reporting that it runs; a job that is done passivates itself and is
// forgotten.
//
// A job answers JSON requests:
//
//	{"op":"start","steps":3,"every":"2s"}   starts it: step k comes k*every after the start
//	{"op":"get"}                            reads it
//
// with the job, {"steps":3,"every":"2s","started":"...","done":[1,2],"fired":[1,2]}.
// While it runs, it publishes its id on jobs.running.<id> every
// HeartbeatEvery.
package jobs

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/natshard/natshard"
)

// HeartbeatEvery is how often a running job says so on jobs.running.<id>.
const HeartbeatEvery = 500 * time.Millisecond

// Job is what a job holds: its persisted state.
type Job struct {
	Steps   int       `json:"steps"`
	Every   Duration  `json:"every"`
	Started time.Time `json:"started"`
	Done    []int     `json:"done"`  // the steps applied, in order
	Fired   []int     `json:"fired"` // every step reminder that came, in order (a step that came twice would show twice)
}

// Running reports whether the job has steps to go.
func (j Job) Running() bool { return j.Steps > 0 && len(j.Done) < j.Steps }

// Request is what a job is asked.
type Request struct {
	Op    string   `json:"op"`
	Steps int      `json:"steps,omitempty"`
	Every Duration `json:"every,omitempty"`
}

// Duration is a time.Duration written as "2s" in JSON.
type Duration time.Duration

func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(time.Duration(d).String()) }

func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return err
	}
	v, err := time.ParseDuration(s)
	*d = Duration(v)
	return err
}

// Key is the job type's key: a Request asked, the Job answered, in JSON.
// Ask a job with jobs.Key.Ref(client, id).Ask(ctx, jobs.Request{...}).
var Key = natshard.NewKey[Request, Job]("job")

// Type is the job entity type: durable delivery (reminders need it) and
// remembered entities.
func Type() natshard.Type {
	t := natshard.TypeOf(Key, New)
	t.Delivery, t.Remember = natshard.Durable, true
	return t
}

// New activates job id: it loads its state and, if the job runs, starts
// its heartbeat; a job activated without a message (remembered) does the
// same.
func New(ctx context.Context, id string) (natshard.Handler[Request, Job], error) {
	state, err := natshard.LoadState[Job](ctx)
	if err != nil {
		return nil, err
	}
	j := &job{env: natshard.EnvFrom(ctx), state: state}
	if state.Value().Running() {
		j.beat()
	}
	return j, nil
}

type job struct {
	env     *natshard.Env
	state   *natshard.State[Job]
	beating bool // the heartbeat's timer is armed
}

// Handle answers a request, or applies a step. The job's own timer and
// reminders come through Handle too, with no request (the message says
// which: natshard.MessageFrom).
func (j *job) Handle(ctx context.Context, req Request) (Job, error) {
	m := natshard.MessageFrom(ctx)
	if m.Timer() == heartbeat {
		j.publishBeat()
		return Job{}, nil
	}
	if name := m.Reminder(); name != "" {
		return Job{}, j.step(ctx, name)
	}
	switch req.Op {
	case "get":
	case "start":
		if err := j.start(ctx, req); err != nil {
			return Job{}, err
		}
	default:
		return Job{}, natshard.ErrBadRequest.Errorf("unknown op %q", req.Op)
	}
	if !j.state.Value().Running() {
		j.env.Passivate() // asked about a job that does not run: not kept active
	}
	return j.state.Value(), nil
}

// start saves the job, then sets a reminder per step. A start handled
// again after a crash finds the job saved (Applied) and sets the same
// reminders again, which the stream stores once.
func (j *job) start(ctx context.Context, req Request) error {
	if req.Steps < 1 || req.Every <= 0 {
		return natshard.ErrBadRequest.Errorf("start needs steps >= 1 and a positive every")
	}
	if j.state.Value().Steps > 0 && !j.state.Applied(ctx) {
		return errors.New("the job has started already")
	}
	err := j.state.Update(ctx, func(job *Job) error {
		*job = Job{Steps: req.Steps, Every: req.Every, Started: time.Now().UTC()}
		return nil
	})
	if err != nil {
		return err
	}
	v := j.state.Value()
	for k := 1; k <= v.Steps; k++ {
		at := v.Started.Add(time.Duration(k) * time.Duration(v.Every))
		if err := j.env.Remind(ctx, "step-"+strconv.Itoa(k), at, nil); err != nil {
			return err
		}
	}
	if !j.beating {
		j.beat()
	}
	return nil
}

// step applies the step a reminder names, once (State skips a message it
// applied), and in order: a step that is not the next one is recorded
// but not done. The job passivates once done: it is forgotten.
func (j *job) step(ctx context.Context, name string) error {
	k, err := strconv.Atoi(strings.TrimPrefix(name, "step-"))
	if err != nil {
		return fmt.Errorf("unknown reminder %q", name)
	}
	err = j.state.Update(ctx, func(job *Job) error {
		job.Fired = append(job.Fired, k)
		if k == len(job.Done)+1 {
			job.Done = append(job.Done, k)
		}
		return nil
	})
	if err != nil {
		return err
	}
	if !j.state.Value().Running() {
		j.env.Passivate()
	}
	return nil
}

// heartbeat is the name of the job's heartbeat timer.
const heartbeat = "heartbeat"

// beat publishes the job's id on jobs.running.<id> now, and every
// HeartbeatEvery while the job is active: a periodic timer of the
// entity, which Handle gets in its turn (no goroutine of its own) and
// which ends with the activation.
func (j *job) beat() {
	j.publishBeat()
	if err := j.env.StartPeriodicTimer(heartbeat, HeartbeatEvery, nil); err != nil {
		j.env.Logger().Warn("jobs: no heartbeat", "err", err)
		return
	}
	j.beating = true
}

func (j *job) publishBeat() { _ = j.env.Conn.Publish(RunningSubject(j.env.ID), nil) }

// Stop has nothing to do: the state was saved at every change, and the
// heartbeat's timer ends with the activation.
func (j *job) Stop(context.Context) error { return nil }

// RunningSubject is where job id says that it runs.
func RunningSubject(id string) string { return "jobs.running." + id }
