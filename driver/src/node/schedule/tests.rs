//! Reading schedules, the profile in force, and the switch decision.

use std::collections::{BTreeMap, BTreeSet};

use jiff::Timestamp;
use proptest::prelude::*;
use serde_json::{Value, json};

use super::switch::{self, Disruption, GpuState, GpuStep, Holder, SwitchRecord};
use super::*;
use crate::testing::string_map;

fn at(s: &str) -> Timestamp {
    s.parse().unwrap()
}

fn day_night() -> Value {
    json!({
        "apiVersion": "gpu.tessera.dev/v1alpha1",
        "kind": "GpuProfileSchedule",
        "metadata": {"name": "day-night"},
        "spec": {
            "nodeSelector": {"matchLabels": {"pool": "inference"}},
            "timeZone": "Europe/Berlin",
            "profiles": [
                {"name": "day", "mode": "shared", "drainDeadline": "30m"},
                {"name": "night", "mode": "exclusive", "gpus": [{"index": 1, "mode": "shared"}]},
            ],
            "windows": [
                {"start": "0 8 * * mon-fri", "profile": "day"},
                {"start": "0 20 * * *", "profile": "night"},
            ],
        },
    })
}

fn schedule() -> Schedule {
    parse(&day_night()).unwrap()
}

#[test]
fn a_schedule_reads_its_selector_zone_profiles_and_windows() {
    let s = schedule();
    assert_eq!(s.name, "day-night");
    assert_eq!(s.zone_name, "Europe/Berlin");
    assert!(s.selector.matches(&string_map(&[("pool", "inference")])));
    assert!(!s.selector.matches(&string_map(&[("pool", "training")])));
    assert_eq!(
        s.profiles[0]
            .drain_deadline
            .map(crate::rules::config::Patience::as_secs),
        Some(1800)
    );
    assert_eq!(s.profiles[1].choice.mode_of(0), Some(GpuMode::Exclusive));
    assert_eq!(s.profiles[1].choice.mode_of(1), Some(GpuMode::Shared));
    assert_eq!(s.windows[1].profile, 1);
}

#[test]
fn every_bad_field_is_named_with_its_rule() {
    let cases: [(&str, Value, &str, &str); 11] = [
        (
            "/spec/timeZone",
            json!("Mars/Olympus"),
            "spec.timeZone",
            "IANA",
        ),
        (
            "/spec/windows/0/start",
            json!("0 25 * * *"),
            "spec.windows[0].start",
            "hour field",
        ),
        (
            "/spec/windows/1/profile",
            json!("dusk"),
            "spec.windows[1].profile",
            "no profile is named \"dusk\"",
        ),
        (
            "/spec/profiles/0/mode",
            json!("half"),
            "spec.profiles[0].mode",
            "not a GPU mode",
        ),
        (
            "/spec/profiles/0/drainDeadline",
            json!("soon"),
            "spec.profiles[0].drainDeadline",
            "not a duration",
        ),
        (
            "/spec/profiles/0/drainDeadline",
            json!("25h"),
            "spec.profiles[0].drainDeadline",
            "longer",
        ),
        (
            "/spec/profiles/1/name",
            json!("day"),
            "spec.profiles[1].name",
            "named twice",
        ),
        (
            "/spec/profiles/1/gpus/0/index",
            json!(64),
            "spec.profiles[1].gpus[0].index",
            "highest GPU index",
        ),
        (
            "/spec/nodeSelector/matchExpressions",
            json!([{"key": "k", "operator": "Near"}]),
            "spec.nodeSelector.matchExpressions[0].operator",
            "not an operator",
        ),
        (
            "/apiVersion",
            json!("gpu.tessera.dev/v2"),
            "apiVersion",
            "not served",
        ),
        ("/spec/windows", json!([]), "spec.windows", "1 to 32"),
    ];
    for (pointer, value, field, says) in cases {
        let mut object = day_night();
        let (parent, key) = pointer.rsplit_once('/').unwrap();
        let target = object.pointer_mut(parent).unwrap();
        match target {
            Value::Array(items) => items[key.parse::<usize>().unwrap()] = value,
            Value::Object(map) => {
                map.insert(key.to_owned(), value);
            }
            _ => unreachable!(),
        }
        match parse(&object).unwrap_err() {
            Error::Invalid {
                object,
                field: f,
                message,
            } => {
                assert_eq!(object, "GpuProfileSchedule day-night");
                assert_eq!(f, field, "{message}");
                assert!(message.contains(says), "{field}: {message}");
            }
            other => panic!("{other}"),
        }
    }
    let mut unknown = day_night();
    unknown["spec"]["profiles"][0]["modes"] = json!("shared");
    let e = parse(&unknown).unwrap_err().to_string();
    assert!(e.contains("spec.profiles[0]") && e.contains("modes"), "{e}");
    let mut empty = day_night();
    empty["spec"]["profiles"][0] = json!({"name": "day"});
    assert!(
        parse(&empty)
            .unwrap_err()
            .to_string()
            .contains("chooses nothing")
    );
}

#[test]
fn the_profile_in_force_is_the_last_window_started_and_the_next_switch_changes_it() {
    let s = schedule();
    // Monday 2026-11-30 10:00 Berlin (09:00 UTC): day since 08:00 Berlin.
    let monday = at("2026-11-30T09:00:00Z");
    let active = s.active_at(monday).unwrap();
    assert_eq!(s.profiles[active.profile].name, "day");
    assert_eq!(active.since, at("2026-11-30T07:00:00Z"));
    let next = s.next_switch(monday).unwrap();
    assert_eq!(s.profiles[next.profile].name, "night");
    assert_eq!(next.since, at("2026-11-30T19:00:00Z"));
    // Saturday noon: still night since Friday 20:00; the next switch is Monday 08:00 (the
    // weekend's 20:00 starts of night change nothing).
    let saturday = at("2026-11-28T11:00:00Z");
    let active = s.active_at(saturday).unwrap();
    assert_eq!(s.profiles[active.profile].name, "night");
    assert_eq!(active.since, at("2026-11-27T19:00:00Z"));
    assert_eq!(
        s.next_switch(saturday).unwrap().since,
        at("2026-11-30T07:00:00Z")
    );
}

#[test]
fn a_node_follows_the_one_schedule_that_selects_it() {
    let a = schedule();
    let mut other = day_night();
    other["metadata"]["name"] = json!("all");
    other["spec"]["nodeSelector"] =
        json!({"matchExpressions": [{"key": "pool", "operator": "Exists"}]});
    let b = parse(&other).unwrap();
    let both = [a.clone(), b];
    assert_eq!(
        assign(&both[..1], &string_map(&[("pool", "inference")])),
        Assignment::One(&a)
    );
    assert_eq!(
        assign(&both, &string_map(&[("zone", "x")])),
        Assignment::None
    );
    assert_eq!(
        assign(&both, &string_map(&[("pool", "inference")])),
        Assignment::Conflict(vec!["day-night".into(), "all".into()])
    );
}

#[test]
fn a_profile_owns_every_mode_label() {
    let s = schedule();
    let night = &s.profiles[1];
    let labels = string_map(&[
        ("gpu.tessera.dev/mode", "shared"),
        ("gpu.tessera.dev/mode.gpu-3", "exclusive"),
        ("pool", "inference"),
    ]);
    let changes = night.label_changes(&labels);
    assert_eq!(
        changes,
        BTreeMap::from([
            (
                "gpu.tessera.dev/mode".to_owned(),
                Some("exclusive".to_owned())
            ),
            (
                "gpu.tessera.dev/mode.gpu-1".to_owned(),
                Some("shared".to_owned())
            ),
            ("gpu.tessera.dev/mode.gpu-3".to_owned(), None),
        ])
    );
    let mut applied = labels.clone();
    for (k, v) in changes {
        match v {
            Some(v) => applied.insert(k, v),
            None => applied.remove(&k),
        };
    }
    assert!(
        night.label_changes(&applied).is_empty(),
        "applying twice changes nothing"
    );
}

fn holder(pod: &str, disruption: Disruption) -> Holder {
    Holder {
        pod: format!("default/{pod}"),
        uid: Some(format!("uid-{pod}")),
        disruption,
        terminating: false,
    }
}

fn gpu(index: u32, mode: GpuMode, holders: Vec<Holder>) -> GpuState {
    GpuState {
        index,
        mode,
        draining: !holders.is_empty(),
        holders,
    }
}

/// Three exclusive GPUs at 08:00 Monday (the day window): GPU 0 free, GPU 1 held by a batch
/// pod, GPU 2 by an online pod and a class-preemptible one.
fn monday_morning() -> Vec<GpuState> {
    vec![
        gpu(0, GpuMode::Exclusive, vec![]),
        gpu(
            1,
            GpuMode::Exclusive,
            vec![holder("train", Disruption::Batch)],
        ),
        gpu(
            2,
            GpuMode::Exclusive,
            vec![
                holder("serve", Disruption::Online),
                holder("sweep", Disruption::Class),
            ],
        ),
    ]
}

#[test]
fn at_the_hour_free_gpus_switch_and_held_ones_drain_until_the_deadline() {
    let s = schedule();
    let start = at("2026-11-30T07:00:00Z");
    let active = s.active_at(start).unwrap();
    let labels = string_map(&[("gpu.tessera.dev/mode", "exclusive")]);
    let d = switch::decide(&s, active, &labels, &monday_morning(), None, start).unwrap();
    assert!(d.starts && d.record_changed);
    assert_eq!(d.record.profile, "day");
    assert_eq!(
        d.labels.get("gpu.tessera.dev/mode"),
        Some(&Some("shared".to_owned()))
    );
    assert_eq!(d.gpus[0].step, GpuStep::SwitchesNow);
    assert!(matches!(d.gpus[1].step, GpuStep::Draining(_)));
    assert_eq!(d.draining(), 2);
    assert!(d.evict.is_empty(), "nobody is evicted before the deadline");
    assert_eq!(d.deadline, Some(at("2026-11-30T07:30:00Z")));
    assert!(!d.finished);

    // Half an hour later, past the deadline: the batch and class-preemptible pods go, the
    // online one is waited for.
    let later = at("2026-11-30T07:30:00Z");
    let d2 = switch::decide(
        &s,
        active,
        &labels,
        &monday_morning(),
        Some(&d.record),
        later,
    )
    .unwrap();
    assert!(
        !d2.starts && !d2.record_changed,
        "the switch continues, it is not started again"
    );
    let evicted: Vec<&str> = d2.evict.iter().map(|h| h.pod.as_str()).collect();
    assert_eq!(evicted, ["default/sweep", "default/train"]);
    assert_eq!(d2.waiting_for, vec![holder("serve", Disruption::Online)]);

    // Evictions recorded (as the controller records an accepted one) are never repeated.
    let mut record = d2.record.clone();
    record.evicted = vec!["default/train".into(), "default/sweep".into()];
    let d3 = switch::decide(&s, active, &labels, &monday_morning(), Some(&record), later).unwrap();
    assert!(d3.evict.is_empty());
    // A terminating pod is not evicted again either.
    let mut gpus = monday_morning();
    gpus[1].holders[0].terminating = true;
    let d4 = switch::decide(&s, active, &labels, &gpus, Some(&d.record), later).unwrap();
    assert_eq!(d4.evict.len(), 1);

    // Once every GPU is shared, the switch finishes, once.
    let done: Vec<GpuState> = (0..3).map(|i| gpu(i, GpuMode::Shared, vec![])).collect();
    let fin = switch::decide(&s, active, &labels, &done, Some(&record), later).unwrap();
    assert!(fin.finished && fin.record_changed);
    assert_eq!(fin.record.finished.as_deref(), Some("2026-11-30T07:30:00Z"));
    let again = switch::decide(&s, active, &labels, &done, Some(&fin.record), later).unwrap();
    assert!(again.finished && !again.record_changed);
}

#[test]
fn a_profile_without_a_deadline_never_evicts_and_mig_is_never_switched() {
    let s = schedule();
    let night = s.active_at(at("2026-11-30T20:00:00Z")).unwrap();
    let mut gpus = monday_morning();
    for g in &mut gpus {
        g.mode = GpuMode::Shared;
    }
    gpus.push(gpu(3, GpuMode::Mig, vec![]));
    let d = switch::decide(
        &s,
        night,
        &BTreeMap::new(),
        &gpus,
        None,
        at("2026-12-25T00:00:00Z"),
    )
    .unwrap();
    assert!(d.evict.is_empty() && d.deadline.is_none());
    assert_eq!(d.gpus[1].step, GpuStep::Done, "night keeps GPU 1 shared");
    assert_eq!(d.gpus[3].step, GpuStep::Unchangeable);
}

#[test]
fn a_record_survives_its_annotation_and_an_unreadable_one_is_none() {
    let s = schedule();
    let start = at("2026-11-30T07:00:00Z");
    let active = s.active_at(start).unwrap();
    let d = switch::decide(&s, active, &BTreeMap::new(), &monday_morning(), None, start).unwrap();
    let annotations = string_map(&[(names::ANNOTATION_PROFILE_SWITCH, &d.record.to_annotation())]);
    let back = SwitchRecord::from_annotations(&annotations).unwrap();
    assert_eq!(back, d.record);
    assert!(back.is_for(&s, active));
    let garbled = string_map(&[(names::ANNOTATION_PROFILE_SWITCH, "{nope")]);
    assert_eq!(SwitchRecord::from_annotations(&garbled), None);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// At any instant, the profile in force is the one of the latest window start, it stays
    /// in force until the next switch, and the next switch changes it.
    #[test]
    fn the_profile_holds_until_the_next_switch(seconds in 1_700_000_000i64..1_900_000_000) {
        let s = schedule();
        let now = Timestamp::from_second(seconds).unwrap();
        let active = s.active_at(now).unwrap();
        prop_assert!(active.since <= now);
        let next = s.next_switch(now).unwrap();
        prop_assert!(next.since > now);
        prop_assert_ne!(next.profile, active.profile);
        let before = next.since.checked_sub(jiff::SignedDuration::from_secs(1)).unwrap();
        prop_assert_eq!(s.active_at(before).unwrap().profile, active.profile);
        prop_assert_eq!(s.active_at(next.since).unwrap().profile, next.profile);
    }

    /// Whatever holds the GPUs and whenever it is decided, only preemptible pods not already
    /// evicted or terminating are evicted, only past the deadline, and only from GPUs that
    /// must change mode.
    #[test]
    fn only_preemptible_holders_of_switching_gpus_are_evicted_and_only_after_the_deadline(
        gpus in proptest::collection::vec(
            (0usize..3, proptest::collection::vec((0usize..3, any::<bool>()), 0..4)), 1..6),
        minutes in 0i64..120,
        already in proptest::collection::vec("p[0-9]", 0..3),
    ) {
        let s = schedule();
        let start = at("2026-11-30T07:00:00Z");
        let active = s.active_at(start).unwrap();
        let modes = [GpuMode::Exclusive, GpuMode::Shared, GpuMode::Mig];
        let kinds = [Disruption::Online, Disruption::Batch, Disruption::Class];
        let states: Vec<GpuState> = gpus.iter().enumerate().map(|(i, (m, hs))| GpuState {
            index: u32::try_from(i).unwrap(),
            mode: modes[*m],
            draining: false,
            holders: hs.iter().enumerate().map(|(j, (k, terminating))| Holder {
                pod: format!("default/p{}", i * 4 + j),
                uid: None,
                disruption: kinds[*k],
                terminating: *terminating,
            }).collect(),
        }).collect();
        let first = switch::decide(&s, active, &BTreeMap::new(), &states, None, start).unwrap();
        let mut record = first.record.clone();
        record.evicted = already.iter().map(|p| format!("default/{p}")).collect();
        let now = start.checked_add(jiff::SignedDuration::from_mins(minutes)).unwrap();
        let d = switch::decide(&s, active, &BTreeMap::new(), &states, Some(&record), now).unwrap();
        let switching: BTreeSet<&str> = states.iter()
            .filter(|g| g.mode == GpuMode::Exclusive)
            .flat_map(|g| g.holders.iter().map(|h| h.pod.as_str()))
            .collect();
        if minutes < 30 {
            prop_assert!(d.evict.is_empty());
        }
        for h in &d.evict {
            prop_assert!(h.disruption.preemptible());
            prop_assert!(!h.terminating);
            prop_assert!(!record.evicted.contains(&h.pod));
            prop_assert!(switching.contains(h.pod.as_str()));
        }
        prop_assert!(d.waiting_for.iter().all(|h| h.disruption == Disruption::Online));
    }
}
