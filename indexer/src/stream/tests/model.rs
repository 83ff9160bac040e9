//! Random histories against a reference model: a publisher with restarts
//! and a bounded replay buffer, a network that drops and duplicates (and
//! an owner that drops batches it received, and says so),
//! fetches answered late, partially or not at all, catch-ups that race the
//! live batches. (No reordering within a connection: ZeroMQ delivers a
//! connection's messages in order, and a batch arriving after a later one
//! is what a restarted run looks like.) The model's
//! truth is simple: the pod holds its current run's batches, in seq order.
//! The machine's applied state (the batches applied since its last
//! `Restart`) must equal it whenever the machine does not say something
//! was lost, and always when nothing could be lost.

use std::collections::VecDeque;

use proptest::prelude::*;

use super::*;

#[derive(Clone, Copy, Debug)]
enum Op {
    /// The pod publishes its next batch, and the network delivers it...
    Publish(Fate),
    /// The engine restarts: a new run from seq 0 (its connection drops and
    /// comes back, so a catch-up follows when it has a replay endpoint).
    Restart,
    /// The connection drops and comes back (the pod did not restart).
    Reconnect,
    /// The oldest pending fetch is answered now, from the buffer as it is.
    Answer { fail: bool },
    /// A pending catch-up (after a reconnect) arrives now.
    CatchUp,
}

#[derive(Clone, Copy, Debug)]
enum Fate {
    Deliver,
    Drop,
    /// Received, then dropped by the owner, who says so (`Input::Dropped`).
    Noted,
    Twice,
}

fn op(replayable: bool) -> impl Strategy<Value = Op> {
    let fate = prop_oneof![
        6 => Just(Fate::Deliver),
        2 => Just(Fate::Drop),
        1 => Just(Fate::Noted),
        1 => Just(Fate::Twice),
    ];
    ops_of(fate, replayable)
}

/// Histories whose lost batches are all noted ones.
fn noted_op() -> impl Strategy<Value = Op> {
    let fate = prop_oneof![
        6 => Just(Fate::Deliver),
        3 => Just(Fate::Noted),
        1 => Just(Fate::Twice),
    ];
    ops_of(fate, true)
}

fn ops_of(
    fate: impl Strategy<Value = Fate> + 'static,
    replayable: bool,
) -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => fate.prop_map(Op::Publish),
        1 => Just(Op::Restart),
        1 => Just(Op::Reconnect),
        3 => any::<bool>().prop_map(move |fail| Op::Answer { fail: fail && replayable }),
        1 => Just(Op::CatchUp),
    ]
}

struct World {
    replayable: bool,
    /// The replay buffer's size (vLLM keeps the newest N batches).
    buffer: usize,
    /// The current run's batches (fingerprints), by seq.
    run: Vec<u64>,
    runs: u64,
    stream: Stream<u64>,
    now: Instant,
    /// Applied since the machine's last Restart: (seq, batch).
    applied: Vec<(u64, u64)>,
    lost_since_restart: bool,
    fetches: VecDeque<(u64, u32)>,
    catch_up_due: bool,
}

impl World {
    fn new(replayable: bool, buffer: usize) -> World {
        let now = Instant::now();
        World {
            replayable,
            buffer,
            run: Vec::new(),
            runs: 0,
            stream: Stream::new(StreamLimits::default(), replayable, None, now),
            now,
            applied: Vec::new(),
            lost_since_restart: false,
            fetches: VecDeque::new(),
            catch_up_due: false,
        }
    }

    fn feed(&mut self, input: Input<u64>) {
        let mut out = Vec::new();
        self.stream.handle(input, self.now, &mut out);
        for action in out {
            match action {
                Action::Restart => {
                    self.applied.clear();
                    self.lost_since_restart = false;
                }
                Action::Apply { seq, batch, .. } => self.applied.push((seq, batch)),
                Action::Lost { .. } | Action::Unverified => self.lost_since_restart = true,
                Action::Fetch { from, ticket, .. } => self.fetches.push_back((from, ticket)),
                Action::Forget => panic!("no expiry configured"),
                Action::Note(_) => {}
            }
        }
    }

    fn buffered_from(&self, from: u64) -> Vec<Numbered<u64>> {
        let start = self.run.len().saturating_sub(self.buffer);
        (start..self.run.len())
            .filter(|&s| s as u64 >= from)
            .map(|s| b(s as u64, self.run[s]))
            .collect()
    }

    fn deliver(&mut self, seq: u64, fp: u64) {
        self.feed(Input::Live(b(seq, fp)));
    }

    fn run(&mut self, op: Op) {
        match op {
            Op::Publish(fate) => {
                let seq = self.run.len() as u64;
                let fp = self.runs * 1_000_000 + seq + 1;
                self.run.push(fp);
                match fate {
                    Fate::Deliver => self.deliver(seq, fp),
                    Fate::Drop => {}
                    Fate::Noted => self.feed(Input::Dropped { seq }),
                    Fate::Twice => {
                        self.deliver(seq, fp);
                        self.deliver(seq, fp);
                    }
                }
            }
            Op::Restart => {
                self.runs += 1;
                self.run.clear();
                self.reconnect();
            }
            Op::Reconnect => self.reconnect(),
            Op::Answer { fail } => self.answer(fail),
            Op::CatchUp => {
                if std::mem::take(&mut self.catch_up_due) {
                    self.feed(Input::CatchUp(self.buffered_from(0)));
                }
            }
        }
    }

    fn reconnect(&mut self) {
        self.feed(Input::Connection { up: false });
        self.feed(Input::Connection { up: true });
        self.catch_up_due = self.replayable;
    }

    fn answer(&mut self, fail: bool) {
        let Some((from, ticket)) = self.fetches.pop_front() else {
            return;
        };
        let result = if fail {
            Err("timeout".to_owned())
        } else {
            Ok(self.buffered_from(from))
        };
        self.feed(Input::Replayed { ticket, result });
    }

    /// Quiet again: a last batch shows any gap at the end (unless
    /// `trailing` is false: the pod just goes quiet), a due catch-up
    /// arrives, every fetch is answered.
    fn settle(&mut self, trailing: bool) {
        if trailing {
            self.run(Op::Publish(Fate::Deliver));
        }
        self.run(Op::CatchUp);
        for _ in 0..1000 {
            if self.fetches.is_empty() {
                return;
            }
            self.answer(false);
        }
        panic!("fetches never ended");
    }

    fn truth(&self) -> Vec<(u64, u64)> {
        self.run
            .iter()
            .enumerate()
            .map(|(s, &fp)| (s as u64, fp))
            .collect()
    }
}

/// `must_be_exact`: nothing could be lost, so the end must equal the
/// truth. `complete_means_exact`: where the machine says nothing was lost,
/// it must equal the truth. (Without a replay endpoint, a restart whose
/// first batches were all dropped looks like a run that continues: no one
/// can tell, so only histories without drops are held to it.)
fn check(
    replayable: bool,
    buffer: usize,
    ops: &[Op],
    must_be_exact: bool,
    complete_means_exact: bool,
) {
    check_settled(
        replayable,
        buffer,
        ops,
        must_be_exact,
        complete_means_exact,
        true,
    );
}

/// `check`, the history ending with a last delivered batch or not.
fn check_settled(
    replayable: bool,
    buffer: usize,
    ops: &[Op],
    must_be_exact: bool,
    complete_means_exact: bool,
    trailing: bool,
) {
    let mut world = World::new(replayable, buffer);
    for &op in ops {
        world.run(op);
        // Always: one run's batches, in seq order, each once.
        assert!(
            world.applied.windows(2).all(|w| w[0].0 < w[1].0),
            "applied out of order: {:?}",
            world.applied
        );
    }
    world.settle(trailing);
    if must_be_exact {
        assert!(!world.lost_since_restart, "nothing was lost for good");
    }
    if complete_means_exact && !world.lost_since_restart {
        assert_eq!(world.applied, world.truth(), "complete means exact");
    }
}

/// The history CI's seed found: noted drops whose fetches all failed left
/// the machine holding none of them while saying nothing was lost.
#[test]
fn noted_drops_whose_fetches_fail_are_said_lost() {
    use Op::*;
    let ops = [
        Publish(Fate::Noted),
        Answer { fail: true },
        Publish(Fate::Noted),
        Answer { fail: true },
        Answer { fail: true },
        Publish(Fate::Noted),
        Answer { fail: true },
        Answer { fail: false },
    ];
    check_settled(true, 10_000, &ops, false, true, false);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// A replay buffer larger than anything published, fetches that fail
    /// at most now and then: every history ends exact.
    #[test]
    fn with_replay_every_history_ends_exact(
        ops in prop::collection::vec(op(true), 1..80),
    ) {
        // Answers fail at random; four in a row lose the range, which the
        // machine must then say. Exactness is required only when no
        // repair could have run out of attempts.
        let failures = ops.iter().filter(|o| matches!(o, Op::Answer { fail: true })).count();
        check(true, 10_000, &ops, failures < 4, true);
    }

    /// A small replay buffer: ranges go missing, and the machine must say
    /// so whenever its state is not the pod's.
    #[test]
    fn with_a_small_buffer_complete_means_exact(
        ops in prop::collection::vec(op(true), 1..80),
        buffer in 1usize..8,
    ) {
        check(true, buffer, &ops, false, true);
    }

    /// No replay endpoint: drops are lost (and said), restarts show by seq.
    #[test]
    fn without_replay_complete_means_exact(
        ops in prop::collection::vec(op(false), 1..80),
    ) {
        let drops = ops
            .iter()
            .any(|o| matches!(o, Op::Publish(Fate::Drop | Fate::Noted)));
        check(false, 0, &ops, !drops, !drops);
    }

    /// Every lost batch noted by the owner, and no last batch to show a
    /// gap at the end (the pod goes quiet): every history still ends
    /// exact, the noted drops fetched from the buffer.
    #[test]
    fn with_replay_noted_drops_end_exact_without_a_later_batch(
        ops in prop::collection::vec(noted_op(), 1..80),
    ) {
        let failures = ops.iter().filter(|o| matches!(o, Op::Answer { fail: true })).count();
        check_settled(true, 10_000, &ops, failures < 4, true, false);
    }
}
