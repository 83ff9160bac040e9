//! Random histories of routings, stores, removals and time against a
//! model of what each pod holds: every routing ends exactly once, a
//! confirmation with a delay means the pod held the whole prompt then, a
//! prompt held at routing time is confirmed at once, and the bookkeeping
//! (routings, bytes) returns to zero once everything ended.

use std::collections::HashSet;

use proptest::prelude::*;

use super::*;

const PODS: [&str; 2] = ["a", "b"];
const PROMPTS: u64 = 3;
const BLOCKS: u64 = 4;

/// Prompt `p`'s keys: prompts share nothing.
fn keys(p: u64) -> Vec<BlockKey> {
    (0..BLOCKS).map(|b| BlockKey(p * 100 + b + 1)).collect()
}

#[derive(Clone, Copy, Debug)]
enum Op {
    Record {
        pod: usize,
        prompt: u64,
    },
    /// The pod stores the prompt's first `upto` blocks.
    Store {
        pod: usize,
        prompt: u64,
        upto: u64,
    },
    /// The pod drops everything (a restart, a clear).
    Clear {
        pod: usize,
    },
    /// The pod is removed.
    Forget {
        pod: usize,
    },
    Advance {
        ms: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..PODS.len(), 0..PROMPTS).prop_map(|(pod, prompt)| Op::Record { pod, prompt }),
        4 => (0..PODS.len(), 0..PROMPTS, 1..=BLOCKS)
            .prop_map(|(pod, prompt, upto)| Op::Store { pod, prompt, upto }),
        1 => (0..PODS.len()).prop_map(|pod| Op::Clear { pod }),
        1 => (0..PODS.len()).prop_map(|pod| Op::Forget { pod }),
        3 => (0..400u64).prop_map(|ms| Op::Advance { ms }),
    ]
}

fn routing(pod: usize, prompt: u64) -> Routing {
    Routing {
        model: "m".into(),
        pod: PODS[pod].into(),
        keys: keys(prompt).into(),
        tokens: vec![7; (BLOCKS * 4) as usize],
        block_size: 4,
    }
}

fn leading(held: &HashSet<BlockKey>, keys: &[BlockKey], from: usize) -> usize {
    keys[from..].iter().take_while(|k| held.contains(k)).count()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn every_routing_ends_once_and_confirmations_are_true(
        ops in proptest::collection::vec(op(), 1..80),
        small in any::<bool>(),
    ) {
        let policy = TtlPolicy::Fixed(Duration::from_millis(300));
        // A small budget forces routings past it to end at once.
        let budget = if small { 3 * cost(&routing(0, 0)) } else { 1 << 20 };
        let mut t = Tracker::new(policy, budget, 2);
        let mut held: Vec<HashSet<BlockKey>> = vec![HashSet::new(); PODS.len()];
        let mut now = Instant::now();
        let (mut recorded, mut ended) = (0usize, 0usize);
        // Only `stored` confirms with a delay (checked there): whatever
        // else ends a routing says it without one.
        let check_ended = |ended_now: &[Ended]| -> usize {
            for e in ended_now {
                assert!(!matches!(e.outcome, Outcome::Confirmed { delay: Some(_) }), "{e:?}");
            }
            ended_now.len()
        };
        for op in ops {
            match op {
                Op::Record { pod, prompt } => {
                    let r = routing(pod, prompt);
                    let at_once = leading(&held[pod], &r.keys, 0);
                    let all_held = at_once == r.keys.len();
                    let (rec, ends) = t.record(r, at_once, now);
                    recorded += 1;
                    ended += check_ended(&ends);
                    if all_held {
                        prop_assert_eq!(&rec.ended, &Some(Outcome::Confirmed { delay: None }));
                    }
                    if rec.ended.is_some() {
                        ended += 1;
                    }
                }
                Op::Store { pod, prompt, upto } => {
                    for k in &keys(prompt)[..upto as usize] {
                        held[pod].insert(*k);
                    }
                    let h = &held[pod];
                    let out = t.stored("m", PODS[pod], &[], |k, from| leading(h, k, from), now);
                    for e in &out.ended {
                        if let Outcome::Confirmed { delay: Some(_) } = e.outcome {
                            // Confirmed now: this pod holds some prompt whole.
                            prop_assert!((0..PROMPTS).any(|p| leading(h, &keys(p), 0) == BLOCKS as usize));
                        }
                    }
                    prop_assert!(out.superseded.iter().all(|k| h.contains(k)));
                    ended += out.ended.len();
                }
                Op::Clear { pod } => held[pod].clear(),
                Op::Forget { pod } => {
                    held[pod].clear();
                    ended += check_ended(&t.forget_pod("m", PODS[pod]));
                }
                Op::Advance { ms } => {
                    now += Duration::from_millis(ms);
                    ended += check_ended(&t.expire(now));
                }
            }
            prop_assert_eq!(recorded, ended + t.tracked());
            prop_assert!(t.bytes() <= budget);
        }
        ended += t.expire(now + Duration::from_secs(3600)).len();
        prop_assert_eq!(recorded, ended);
        prop_assert_eq!((t.tracked(), t.bytes()), (0, 0));
    }
}
