//! The stream rules, one test each, then random histories against a
//! reference model.

use super::*;

type Out = Vec<Action<u64>>;

fn limits() -> StreamLimits {
    StreamLimits {
        expiry: Some(Duration::from_secs(60)),
        ..StreamLimits::default()
    }
}

/// Batch content `fp` doubles as its fingerprint: a restarted run's
/// batches get other values.
fn b(seq: u64, fp: u64) -> Numbered<u64> {
    Numbered {
        seq,
        fingerprint: fp,
        batch: fp,
    }
}

struct Harness {
    stream: Stream<u64>,
    now: Instant,
}

impl Harness {
    fn new(replayable: bool) -> Harness {
        let now = Instant::now();
        Harness {
            stream: Stream::new(limits(), replayable, None, now),
            now,
        }
    }

    fn feed(&mut self, input: Input<u64>) -> Out {
        let mut out = Vec::new();
        self.stream.handle(input, self.now, &mut out);
        out
    }

    fn live(&mut self, seq: u64, fp: u64) -> Out {
        self.feed(Input::Live(b(seq, fp)))
    }

    /// Fetch `ticket` timed out.
    fn fail(&mut self, ticket: u32) -> Out {
        self.feed(Input::Replayed {
            ticket,
            result: Err("timeout".into()),
        })
    }

    fn reply(&mut self, ticket: u32, items: Vec<Numbered<u64>>) -> Out {
        self.feed(Input::Replayed {
            ticket,
            result: Ok(items),
        })
    }
}

fn apply(seq: u64, fp: u64) -> Action<u64> {
    Action::Apply {
        seq,
        fingerprint: fp,
        batch: fp,
    }
}

fn fetch(from: u64, ticket: u32) -> Action<u64> {
    Action::Fetch {
        from,
        ticket,
        delay: Duration::ZERO,
    }
}

fn gap(from: u64, to: u64) -> Action<u64> {
    Action::Note(Note::Gap { from, to })
}

fn replayed(batches: u64) -> Action<u64> {
    Action::Note(Note::Replayed { batches })
}

#[test]
fn batches_in_order_apply() {
    let mut h = Harness::new(true);
    assert_eq!(h.live(0, 10), vec![apply(0, 10)]);
    assert_eq!(h.live(1, 11), vec![apply(1, 11)]);
    assert_eq!(h.stream.last_seq(), Some(1));
}

#[test]
fn the_same_batch_twice_is_a_duplicate_but_another_under_its_seq_is_a_restart() {
    let mut h = Harness::new(true);
    h.live(0, 10);
    h.live(1, 11);
    assert_eq!(h.live(1, 11), vec![Action::Note(Note::Duplicate)]);
    assert_eq!(h.live(1, 99), vec![Action::Restart, gap(0, 1), fetch(0, 1)]);
}

#[test]
fn seq_going_back_is_a_restart() {
    let mut h = Harness::new(false);
    h.live(0, 10);
    h.live(1, 11);
    h.live(2, 12);
    assert_eq!(h.live(0, 20), vec![Action::Restart, apply(0, 20)]);
}

#[test]
fn seq_max_then_zero_is_a_restart() {
    let mut h = Harness::new(false);
    h.stream = Stream::new(limits(), false, Some(u64::MAX - 1), h.now);
    assert_eq!(h.live(u64::MAX, 1), vec![apply(u64::MAX, 1)]);
    assert_eq!(h.live(0, 2), vec![Action::Restart, apply(0, 2)]);
}

#[test]
fn a_gap_without_replay_is_lost_and_the_batch_applies() {
    let mut h = Harness::new(false);
    h.live(0, 10);
    assert_eq!(
        h.live(4, 14),
        vec![gap(1, 4), Action::Lost { missing: 3 }, apply(4, 14)]
    );
}

#[test]
fn a_gap_is_fetched_from_the_last_applied_and_merged_with_live_batches() {
    let mut h = Harness::new(true);
    h.live(0, 10);
    // 1 and 2 dropped; 3 reveals the gap; 4 arrives while fetching.
    assert_eq!(h.live(3, 13), vec![gap(1, 3), fetch(0, 1)]);
    assert_eq!(h.live(4, 14), vec![]);
    let out = h.reply(1, vec![b(0, 10), b(1, 11), b(2, 12), b(3, 13)]);
    assert_eq!(
        out,
        vec![
            replayed(2),
            apply(1, 11),
            apply(2, 12),
            apply(3, 13),
            apply(4, 14)
        ]
    );
    assert!(!h.stream.repairing());
    // 5 continues.
    assert_eq!(h.live(5, 15), vec![apply(5, 15)]);
}

#[test]
fn a_first_batch_past_zero_fetches_from_zero() {
    let mut h = Harness::new(true);
    assert_eq!(h.live(2, 12), vec![gap(0, 2), fetch(0, 1)]);
    let out = h.reply(1, vec![b(0, 10), b(1, 11), b(2, 12)]);
    assert_eq!(
        out,
        vec![replayed(2), apply(0, 10), apply(1, 11), apply(2, 12)]
    );
}

#[test]
fn failed_fetches_are_retried_with_backoff_then_the_range_is_lost() {
    let mut h = Harness::new(true);
    h.live(0, 10);
    h.live(3, 13);
    let mut ticket = 1;
    for (attempt, delay_ms) in [(2, 200), (3, 400), (4, 800)] {
        let out = h.fail(ticket);
        ticket += 1;
        assert_eq!(
            out,
            vec![
                Action::Note(Note::ReplayRetry { attempt }),
                Action::Fetch {
                    from: 0,
                    ticket,
                    delay: Duration::from_millis(delay_ms)
                }
            ]
        );
    }
    assert_eq!(
        h.fail(ticket),
        vec![
            Action::Note(Note::ReplayFailed),
            replayed(0),
            apply(3, 13),
            Action::Lost { missing: 2 }
        ]
    );
}

#[test]
fn a_reply_that_ends_before_the_gap_asks_again() {
    let mut h = Harness::new(true);
    h.live(0, 10);
    h.live(2, 12); // gap at 1; fetch 1
    h.live(3, 13);
    h.live(6, 16); // 4 and 5 dropped too
                   // The pod answered when it had published up to 3 only.
    let out = h.reply(1, vec![b(0, 10), b(1, 11), b(2, 12), b(3, 13)]);
    assert_eq!(
        out,
        vec![
            replayed(1),
            apply(1, 11),
            apply(2, 12),
            apply(3, 13),
            Action::Note(Note::NextRound { from: 4, round: 2 }),
            fetch(3, 2)
        ]
    );
    let out = h.reply(2, vec![b(3, 13), b(4, 14), b(5, 15), b(6, 16)]);
    assert_eq!(
        out,
        vec![replayed(2), apply(4, 14), apply(5, 15), apply(6, 16)]
    );
}

#[test]
fn a_stale_reply_is_ignored() {
    let mut h = Harness::new(true);
    h.live(0, 10);
    h.live(2, 12);
    assert_eq!(h.reply(7, vec![b(1, 11)]), vec![]);
    assert!(h.stream.repairing());
}

#[test]
fn a_restart_while_repairing_cancels_the_repair() {
    let mut h = Harness::new(true);
    h.live(0, 10);
    h.live(1, 11);
    h.live(5, 15); // gap; fetch ticket 1
                   // The pod restarted: its seq 0 arrives.
    assert_eq!(h.live(0, 20), vec![Action::Restart, apply(0, 20)]);
    // The old fetch's reply describes the old run: ignored.
    assert_eq!(h.reply(1, vec![b(2, 12), b(3, 13), b(4, 14)]), vec![]);
    assert_eq!(h.live(1, 21), vec![apply(1, 21)]);
}

#[test]
fn a_restart_right_after_a_catch_up_is_seen() {
    // The bug this machine was written for: caught up 0..4 from the
    // buffer, then the pod restarted and published 0..2 anew.
    let mut h = Harness::new(true);
    let out = h.feed(Input::CatchUp((0..5).map(|s| b(s, 10 + s)).collect()));
    assert_eq!(out.len(), 6);
    assert_eq!(h.stream.last_seq(), Some(4));
    assert_eq!(h.live(0, 20), vec![Action::Restart, apply(0, 20)]);
    assert_eq!(h.live(1, 21), vec![apply(1, 21)]);
}

#[test]
fn live_copies_of_a_catch_up_are_duplicates() {
    let mut h = Harness::new(true);
    h.feed(Input::CatchUp((0..5).map(|s| b(s, 10 + s)).collect()));
    for s in 2..5 {
        assert_eq!(h.live(s, 10 + s), vec![Action::Note(Note::Duplicate)]);
    }
    assert_eq!(h.live(5, 15), vec![apply(5, 15)]);
}

#[test]
fn a_catch_up_behind_what_was_applied_is_a_restart() {
    let mut h = Harness::new(true);
    for s in 0..100 {
        h.live(s, 10 + s);
    }
    let out = h.feed(Input::CatchUp(vec![b(0, 500), b(1, 501)]));
    assert_eq!(
        out,
        vec![Action::Restart, apply(0, 500), apply(1, 501), replayed(2)]
    );
}

#[test]
fn a_catch_up_overtaken_by_live_batches_is_no_restart() {
    // The buffer answered at seq 97; 98 and 99 were applied live before
    // the reply reached the worker.
    let mut h = Harness::new(true);
    for s in 0..100 {
        h.live(s, 10 + s);
    }
    let out = h.feed(Input::CatchUp((90..98).map(|s| b(s, 10 + s)).collect()));
    assert_eq!(out, vec![replayed(0)]);
}

#[test]
fn a_restart_hidden_behind_a_gap_shows_in_the_reply() {
    // The pod restarted and its new run passed our seq before we heard
    // from it: the seq looks like a gap, the reply shows another batch
    // where our last one was.
    let mut h = Harness::new(true);
    h.live(0, 10);
    h.live(1, 11);
    assert_eq!(h.live(5, 25), vec![gap(2, 5), fetch(1, 1)]);
    let new_run: Vec<_> = (0..6).map(|s| b(s, 20 + s)).collect();
    let out = h.reply(1, new_run);
    let mut expected = vec![Action::Restart];
    expected.extend((0..6).map(|s| apply(s, 20 + s)));
    expected.push(replayed(6));
    assert_eq!(out, expected);
}

#[test]
fn a_full_repair_buffer_drops_and_says_so() {
    let mut h = Harness::new(true);
    h.stream = Stream::new(
        StreamLimits {
            max_buffered: 2,
            ..limits()
        },
        true,
        None,
        h.now,
    );
    h.live(1, 11);
    h.live(2, 12);
    assert_eq!(h.live(3, 13), vec![Action::Note(Note::BufferFull)]);
}

#[test]
fn a_restored_pod_continues_after_its_snapshot_seq() {
    let mut h = Harness::new(false);
    h.stream = Stream::new(limits(), false, Some(5), h.now);
    assert_eq!(h.live(6, 16), vec![apply(6, 16)]);
    assert_eq!(
        h.live(3, 23),
        vec![
            Action::Restart,
            gap(0, 3),
            Action::Lost { missing: 3 },
            apply(3, 23)
        ]
    );
}

/// The applied seqs among `out`.
fn applied(out: &Out) -> Vec<u64> {
    out.iter()
        .filter_map(|a| match a {
            Action::Apply { seq, .. } => Some(*seq),
            _ => None,
        })
        .collect()
}

/// Restored from a snapshot whose last batch (seq 5) had fingerprint 15;
/// the pod's buffer, caught up on connecting, holds seqs 0..=9.
fn restored_then_caught_up(buffer_fp_of_5: u64) -> Out {
    let mut h = Harness::new(true);
    h.stream = Stream::new(limits(), true, Some(5), h.now).restored_batch(15);
    let buffer = (0..10)
        .map(|s| b(s, if s == 5 { buffer_fp_of_5 } else { 10 + s }))
        .collect();
    h.feed(Input::CatchUp(buffer))
}

#[test]
fn a_restored_pod_whose_buffer_still_holds_its_last_batch_continues() {
    let out = restored_then_caught_up(15);
    assert!(!out.contains(&Action::Restart), "{out:?}");
    assert_eq!(applied(&out), vec![6, 7, 8, 9]);
}

/// The pod restarted while we were down and its new run passed the
/// snapshot's seq: the batch under seq 5 is another one. Without the
/// snapshot's fingerprint this continued at 6, over the old run's blocks.
#[test]
fn a_restored_pod_whose_buffer_holds_another_last_batch_restarted() {
    let out = restored_then_caught_up(99);
    assert_eq!(out.first(), Some(&Action::Restart), "{out:?}");
    assert_eq!(applied(&out), (0..10).collect::<Vec<_>>());
}

/// A repair after a restore asks from the restored batch on, and finds
/// the restart there too.
#[test]
fn a_restored_pods_first_repair_checks_its_last_batch() {
    let mut h = Harness::new(true);
    h.stream = Stream::new(limits(), true, Some(5), h.now).restored_batch(15);
    assert_eq!(h.live(8, 18), vec![gap(6, 8), fetch(5, 1)]);
    let out = h.reply(1, (0..9).map(|s| b(s, 20 + s)).collect());
    assert_eq!(out.first(), Some(&Action::Restart), "{out:?}");
    // The live seq 8 came before the restart showed: asked for again.
    assert_eq!(applied(&out), (0..9).collect::<Vec<_>>());
}

#[test]
fn a_restored_pods_last_batch_sent_again_is_a_duplicate() {
    let mut h = Harness::new(false);
    h.stream = Stream::new(limits(), false, Some(5), h.now).restored_batch(15);
    assert_eq!(h.live(5, 15), vec![Action::Note(Note::Duplicate)]);
    assert_eq!(h.live(6, 16), vec![apply(6, 16)]);
}

/// The pod's last batch was dropped on its way (a full ingest queue) and
/// the pod went quiet: no later batch will show the gap, so the drop
/// itself starts the repair.
#[test]
fn a_dropped_last_batch_is_fetched_at_once() {
    let mut h = Harness::new(true);
    h.live(0, 10);
    h.live(1, 11);
    assert_eq!(
        h.feed(Input::Dropped { seq: 2 }),
        vec![gap(2, 3), fetch(1, 1)]
    );
    let out = h.reply(1, (0..3).map(|s| b(s, 10 + s)).collect());
    assert_eq!(applied(&out), vec![2]);
    assert_eq!(h.stream.last_seq(), Some(2));
    assert!(!h.stream.repairing());
}

/// Dropped while a repair is pending: the reply must reach it.
#[test]
fn a_batch_dropped_during_a_repair_is_part_of_it() {
    let mut h = Harness::new(true);
    h.live(0, 10);
    assert_eq!(h.live(2, 12), vec![gap(1, 2), fetch(0, 1)]);
    assert!(h.feed(Input::Dropped { seq: 3 }).is_empty());
    let out = h.reply(1, (0..4).map(|s| b(s, 10 + s)).collect());
    assert_eq!(applied(&out), vec![1, 2, 3]);
    assert_eq!(h.stream.last_seq(), Some(3));
}

/// Dropped batches whose fetches all fail: their live copies will not
/// come and the pod may stay quiet, so they are lost now, not when a later
/// batch shows the gap (found by the model test: the machine said nothing
/// was lost while it held none of them). Then they are passed, as a gap's
/// lost batches are: the next batch applies in order, and nothing is
/// fetched or counted lost twice. A drop at `u64::MAX` counts no more than
/// it can.
#[test]
fn dropped_batches_whose_fetches_all_fail_are_lost_at_once() {
    let mut h = Harness::new(true);
    h.live(0, 10);
    assert_eq!(
        h.feed(Input::Dropped { seq: 1 }),
        vec![gap(1, 2), fetch(0, 1)]
    );
    assert!(h.feed(Input::Dropped { seq: 2 }).is_empty());
    for ticket in 1..4 {
        h.fail(ticket);
    }
    assert_eq!(
        h.fail(4),
        vec![
            Action::Note(Note::ReplayFailed),
            replayed(0),
            Action::Lost { missing: 2 }
        ]
    );
    assert!(!h.stream.repairing());
    assert_eq!(h.live(3, 13), vec![apply(3, 13)]);

    let mut h = Harness::new(true);
    assert_eq!(h.feed(Input::Dropped { seq: u64::MAX }).len(), 2);
    for ticket in 1..4 {
        h.fail(ticket);
    }
    assert_eq!(h.fail(4).last(), Some(&Action::Lost { missing: u64::MAX }));
}

/// Without a replay endpoint the next batch reports the gap, as before;
/// a drop at or below what was applied asks for nothing.
#[test]
fn a_drop_without_replay_or_behind_asks_for_nothing() {
    let mut h = Harness::new(false);
    h.live(0, 10);
    assert!(h.feed(Input::Dropped { seq: 1 }).is_empty());
    let mut h = Harness::new(true);
    h.live(0, 10);
    h.live(1, 11);
    assert!(h.feed(Input::Dropped { seq: 1 }).is_empty());
}

/// A live batch the full repair buffer could not hold, the pod's last:
/// the reply must reach it.
#[test]
fn a_batch_past_a_full_repair_buffer_is_still_fetched() {
    let mut h = Harness::new(true);
    h.stream = Stream::new(
        StreamLimits {
            max_buffered: 1,
            ..limits()
        },
        true,
        None,
        h.now,
    );
    h.live(0, 10);
    h.live(2, 12);
    assert_eq!(h.live(3, 13), vec![Action::Note(Note::BufferFull)]);
    let out = h.reply(1, (0..4).map(|s| b(s, 10 + s)).collect());
    assert_eq!(applied(&out), vec![1, 2, 3]);
}

/// A drop noted after the fetch went out, past the end of its reply: the
/// batch was received and not kept, so it will not come again live; the
/// repair asks again and applies it.
#[test]
fn a_drop_past_the_replys_end_is_asked_for_again() {
    let mut h = Harness::new(true);
    h.live(0, 10);
    assert_eq!(h.live(2, 12), vec![gap(1, 2), fetch(0, 1)]);
    assert!(h.feed(Input::Dropped { seq: 4 }).is_empty());
    // The pod answered before it had published 3 and 4.
    let out = h.reply(1, (0..3).map(|s| b(s, 10 + s)).collect());
    assert_eq!(applied(&out), vec![1, 2]);
    assert_eq!(out.last(), Some(&fetch(2, 2)), "asked again: {out:?}");
    let out = h.reply(2, (0..5).map(|s| b(s, 10 + s)).collect());
    assert_eq!(applied(&out), vec![3, 4]);
    assert!(!h.stream.repairing());
}

#[test]
fn only_a_disconnected_silent_stream_expires() {
    let mut h = Harness::new(false);
    h.live(0, 10);
    h.now += Duration::from_secs(120);
    // Connected but quiet: kept (an idle vLLM holds its cache).
    assert_eq!(h.feed(Input::Tick), vec![]);
    h.feed(Input::Connection { up: false });
    h.now += Duration::from_secs(59);
    assert_eq!(h.feed(Input::Tick), vec![]);
    h.now += Duration::from_secs(1);
    assert_eq!(h.feed(Input::Tick), vec![Action::Forget]);
}

#[test]
fn a_stream_that_reconnects_or_publishes_is_kept() {
    let mut h = Harness::new(false);
    h.live(0, 10);
    h.feed(Input::Connection { up: false });
    h.now += Duration::from_secs(30);
    h.feed(Input::Connection { up: true });
    h.now += Duration::from_secs(60);
    assert_eq!(h.feed(Input::Tick), vec![]);
    // Down again, but it published 30 s ago.
    h.feed(Input::Connection { up: false });
    h.now += Duration::from_secs(30);
    h.live(1, 11);
    h.now += Duration::from_secs(59);
    assert_eq!(h.feed(Input::Tick), vec![]);
    h.now += Duration::from_secs(1);
    assert_eq!(h.feed(Input::Tick), vec![Action::Forget]);
}

mod model;
