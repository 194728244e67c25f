package campaign

import (
	"reflect"
	"testing"
	"time"
)

var testConfig = Config{Duration: 90 * time.Second, Regions: 4, Servers: 3, Shards: 128}

// TestScheduleIsPure: the schedule is a function of the seed alone.
func TestScheduleIsPure(t *testing.T) {
	for seed := range uint64(20) {
		a, b := Schedule(seed, testConfig), Schedule(seed, testConfig)
		if !reflect.DeepEqual(a, b) {
			t.Fatalf("seed %d: two schedules differ:\n%v\n%v", seed, a, b)
		}
	}
	if reflect.DeepEqual(Schedule(1, testConfig), Schedule(2, testConfig)) {
		t.Fatal("seeds 1 and 2 give the same schedule")
	}
}

// TestScheduleGolden pins seed 1's first faults: a change of the generator
// changes what a seed reproduces, and must be seen.
func TestScheduleGolden(t *testing.T) {
	got := Schedule(1, testConfig)
	want := []string{}
	for _, f := range got[:4] {
		want = append(want, f.String())
	}
	golden := []string{
		"#1 isolate-server server 2 at 3s, healed at 9.563s",
		"#2 kill-coordinator at 9.038s, healed at 12.67s",
		"#3 drain region 1 at 15.399s, healed at 21.73s",
		"#4 kill-server server 2 at 22.289s, healed at 28.609s",
	}
	if !reflect.DeepEqual(want, golden) {
		t.Errorf("seed 1 starts\n%q\nwant\n%q", want, golden)
	}
}

// TestScheduleBounds checks the bounds of issue 30 on many seeds.
func TestScheduleBounds(t *testing.T) {
	kinds := map[Kind]int{}
	for seed := range uint64(500) {
		faults := Schedule(seed, testConfig)
		if len(faults) < 8 {
			t.Fatalf("seed %d: %d faults in 90 s", seed, len(faults))
		}
		for i, f := range faults {
			kinds[f.Kind]++
			if f.ID != i+1 {
				t.Fatalf("seed %d: fault %d has id %d", seed, i, f.ID)
			}
			if f.At < 3*time.Second || f.At >= testConfig.Duration || f.Heal > testConfig.Duration {
				t.Fatalf("seed %d: %v outside the run", seed, f)
			}
			d := f.Heal - f.At
			switch {
			case f.Kind == MoveShard:
				if d != 0 || f.Shard < 0 || f.Shard >= 128 || f.Region < 0 || f.Region >= 4 {
					t.Fatalf("seed %d: %v", seed, f)
				}
			case f.Heal == testConfig.Duration:
			case f.Kind == StopRegion && (d < time.Second || d > 12*time.Second),
				f.Kind != StopRegion && (d < time.Second || d > 10*time.Second):
				t.Fatalf("seed %d: %v lasts %s", seed, f, d)
			}
			if f.Kind == SplitServers && (f.Server == f.Peer || f.Peer < 0 || f.Peer > 2) {
				t.Fatalf("seed %d: %v", seed, f)
			}
			if i > 0 {
				gap := f.At - faults[i-1].At
				if gap < 0 || (gap < 3*time.Second && f.At != earliestHeal(faults[:i], faults[i-1].At)+time.Second) {
					t.Fatalf("seed %d: %v %s after the one before", seed, f, gap)
				}
			}
			var inForce, onNATS int
			for _, g := range faults[:i+1] {
				if g.At <= f.At && f.At < g.Heal {
					inForce++
				}
				if g.At <= f.At && f.At < g.Heal+time.Second && g.ID != f.ID {
					if g.Kind.onNATS() && f.Kind.onNATS() {
						onNATS++
					}
					if g.Kind.onRegion() && f.Kind.onRegion() && g.Region == f.Region {
						t.Fatalf("seed %d: %v while %v", seed, f, g)
					}
				}
			}
			if inForce > 2 || onNATS > 0 {
				t.Fatalf("seed %d: at %v, %d faults in force, %d other on NATS", seed, f, inForce, onNATS)
			}
		}
	}
	for _, k := range Kinds {
		if kinds[k] == 0 {
			t.Errorf("kind %s never drawn in 500 seeds", k)
		}
	}
	t.Logf("kinds drawn: %v", kinds)
}

// earliestHeal is the earliest heal after t among faults in force at t.
func earliestHeal(faults []Fault, t time.Duration) time.Duration {
	best := time.Duration(-1)
	for _, f := range faults {
		if f.At <= t && t < f.Heal && (best < 0 || f.Heal < best) {
			best = f.Heal
		}
	}
	return best
}

// TestScheduleMenu draws only from the menu given.
func TestScheduleMenu(t *testing.T) {
	cfg := testConfig
	cfg.Kinds = []Kind{StopRegion}
	for _, f := range Schedule(3, cfg) {
		if f.Kind != StopRegion {
			t.Fatalf("%v drawn from a menu of %v", f, cfg.Kinds)
		}
	}
}
