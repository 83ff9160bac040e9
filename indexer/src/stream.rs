//! One pod stream's protocol, as a pure state machine: every seq rule and
//! the pod's lifecycle, with no sockets, threads or clocks of its own.
//!
//! A stream is what one vLLM publisher (a pod, or one DP rank of it) sends
//! under one topic: batches numbered by a seq that starts at 0 when the
//! engine starts and grows by one per batch. The ingest worker that owns
//! the stream feeds it [`Input`]s (a live batch, a catch-up or replay
//! reply, a connection going up or down, a clock tick) and executes the
//! [`Action`]s it returns, in order (apply this batch, the publisher
//! restarted, fetch a replay from this seq, these batches are lost, forget
//! the pod). Nothing here can block, fail or allocate without bound, so
//! every rule is tested by feeding inputs and reading actions, and a
//! property test drives random histories against a reference model.
//!
//! The rules, in one place:
//! - **In order.** The next seq applies. A seq further ahead is a gap: with
//!   a replay endpoint, later live batches are buffered (at most
//!   `max_buffered`) while the missing range is fetched; replayed and
//!   buffered batches are merged by seq and applied once each. Without one,
//!   the batch applies and the gap is reported lost. A batch the owner
//!   received but dropped ([`Input::Dropped`]: its queue was full) is a gap
//!   known before any later batch shows it, and is fetched the same way;
//!   a reply that ends before it is asked again (its live copy will not
//!   come).
//! - **Duplicates are recognised by content, not by seq alone.** Each batch
//!   comes with a fingerprint (a hash of its payload). A batch whose seq and
//!   fingerprint equal one already applied (one of the last few, or one applied
//!   from a replay whose live copy may still arrive) is a duplicate.
//! - **Restart.** A seq below the next one (or, while repairing, not past
//!   the newest buffered one) that is not a duplicate means
//!   the publisher restarted (vLLM's cache starts empty, its seq at 0):
//!   report [`Action::Restart`], then treat the batch as a new stream's
//!   first. This holds with a repair pending (the repair is cancelled: its
//!   reply would describe the old run) and right after a catch-up (whose
//!   batches' live copies carry the same fingerprints; a restarted
//!   publisher's do not). A restart the seq cannot show (the new run had
//!   already passed the old seq when we heard from it again) is caught by
//!   the pod's buffer: each repair asks from the last applied seq, and a
//!   catch-up after a reconnect must still hold the newest batch received
//!   before the connection dropped; a different batch there is a restart
//!   ([`Action::Unverified`] when the buffer no longer reaches back that
//!   far). A stream restored from a snapshot remembers the snapshot's last
//!   batch as applied, and checks it the same way. Live batches buffered
//!   before a restart showed are not trusted: the pod's buffer is asked
//!   for their seqs again.
//! - **Bounded repair.** A failed fetch is retried `max_attempts` times
//!   with backoff; a reply only covers what the pod had published when it
//!   answered, so a range past it is asked again, `max_rounds` times at
//!   most. What is still missing then is lost: reported, never waited for.
//!   Replies are matched by ticket: a reply to a cancelled or superseded
//!   fetch is ignored.
//! - **Lifecycle.** A stream whose connection is down and that has been
//!   silent for `expiry` is forgotten; a connected but quiet one is kept (an
//!   idle vLLM still holds its cache).
//!
//! Why one file of ~800 lines: these rules depend on each other (a gap's
//! repair, a restart and a duplicate are told apart by the same state), and
//! reading them together is how one checks that none contradicts another;
//! the tests are in `stream/tests.rs`.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

/// A hash of a batch's payload bytes: what tells a duplicate from a
/// restarted publisher's batch with the same seq.
pub type Fingerprint = u64;

/// Applied batches remembered per stream (16 bytes each): more than a
/// catch-up's race with live batches spans.
const RECENT: usize = 32;

/// Bounds of one stream's state.
#[derive(Clone, Copy, Debug)]
pub struct StreamLimits {
    /// Live batches held while a gap is repaired. vLLM's replay buffer
    /// holds 10,000 batches by default, so more could not be replayed
    /// either.
    pub max_buffered: usize,
    /// Fetches per repair round before the missing range is taken as lost.
    pub max_attempts: u32,
    /// Replay rounds per repair.
    pub max_rounds: u32,
    /// Backoff before the second fetch; doubled for each later one.
    pub retry_base: Duration,
    /// Forget a disconnected, silent stream this long after; `None`: never.
    pub expiry: Option<Duration>,
}

impl Default for StreamLimits {
    fn default() -> Self {
        StreamLimits {
            max_buffered: 10_000,
            max_attempts: 4,
            max_rounds: 8,
            retry_base: Duration::from_millis(200),
            expiry: None,
        }
    }
}

/// One batch with its seq, as a catch-up or replay reply carries it.
#[derive(Clone, Debug, PartialEq)]
pub struct Numbered<B> {
    pub seq: u64,
    pub fingerprint: Fingerprint,
    pub batch: B,
}

/// What the owner of a stream feeds it. `B` is the decoded batch (the
/// machine never looks inside).
#[derive(Debug)]
pub enum Input<B> {
    /// A batch from the live connection.
    Live(Numbered<B>),
    /// The pod's replay buffer, fetched when a connection came up.
    CatchUp(Vec<Numbered<B>>),
    /// The reply to [`Action::Fetch`] with this ticket.
    Replayed {
        ticket: u32,
        result: Result<Vec<Numbered<B>>, String>,
    },
    /// The connection the stream arrives on went up or down.
    Connection { up: bool },
    /// A live batch of this stream, `seq`, was received but dropped before
    /// it reached the stream (its worker's queue was full). What is missing
    /// is known now, not only when a later batch shows the gap: a pod that
    /// goes quiet after the drop would show it only when it next publishes.
    Dropped { seq: u64 },
    /// Time passed (expiry is checked).
    Tick,
}

/// What the owner must do, in the order given.
#[derive(Debug, PartialEq)]
pub enum Action<B> {
    /// The publisher restarted: drop everything the pod holds (and mark
    /// it complete again) before applying what follows.
    Restart,
    /// Apply this batch to the pod. Its fingerprint goes into the pod's
    /// snapshot with its seq: a restored stream checks the pod's buffer
    /// still holds that batch (see `Stream::restored_batch`).
    Apply {
        seq: u64,
        fingerprint: Fingerprint,
        batch: B,
    },
    /// These many batches are gone for good: the pod's answers may be low.
    Lost { missing: u64 },
    /// The pod's replay buffer no longer holds the last batch applied, so
    /// whether its run continued or restarted cannot be checked: its
    /// answers may be wrong until it restarts (flag it incomplete).
    Unverified,
    /// Fetch the pod's replay buffer from `from` on, after `delay`, and
    /// feed the reply back as [`Input::Replayed`] with `ticket`.
    Fetch {
        from: u64,
        ticket: u32,
        delay: Duration,
    },
    /// Forget the pod: it left.
    Forget,
    /// Something worth counting or logging; changes nothing.
    Note(Note),
}

/// Countable events of a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Note {
    /// A seq gap: `from..to` did not arrive live.
    Gap { from: u64, to: u64 },
    /// A batch seen before, skipped.
    Duplicate,
    /// A live batch dropped because the repair buffer was full.
    BufferFull,
    /// A replay fetch failed and is retried.
    ReplayRetry { attempt: u32 },
    /// A replay fetch failed for good.
    ReplayFailed,
    /// A repair (or catch-up) applied this many batches from a replay.
    Replayed { batches: u64 },
    /// A reply ended before the gap; asking again.
    NextRound { from: u64, round: u32 },
}

/// The state of one stream. See the module docs for the rules.
#[derive(Debug)]
pub struct Stream<B> {
    limits: StreamLimits,
    /// Whether gaps can be repaired (the pod's replay endpoint is known).
    replayable: bool,
    /// The seq of the last batch applied (or restored from a snapshot);
    /// `None` before the first. Kept as the last seq, not the next one,
    /// so `u64::MAX` needs no successor: any seq after it is backwards.
    upto: Option<u64>,
    /// The last batches applied, newest last (at most `RECENT`): a
    /// catch-up or repair reply that shows one of them changed, or a live
    /// batch equal to one, is told apart by these.
    recent: VecDeque<(u64, Fingerprint)>,
    /// Batches applied from a replay whose live copies may still arrive.
    replayed: BTreeMap<u64, Fingerprint>,
    repair: Option<Repair<B>>,
    /// Increments with every fetch: only the latest one's reply counts.
    ticket: u32,
    connected: bool,
    down_since: Option<Instant>,
    last_seen: Instant,
    /// The last batch applied when the connection last went down: the
    /// next catch-up must still hold it, or the pod may have restarted
    /// meanwhile without a seq that shows it.
    verify: Option<(u64, Fingerprint)>,
}

#[derive(Debug)]
struct Repair<B> {
    /// The first missing seq.
    from: u64,
    /// The last batch applied before the gap, which the reply must still
    /// show unchanged (else the publisher restarted meanwhile).
    check: Option<(u64, Fingerprint)>,
    attempt: u32,
    round: u32,
    /// Live batches that arrived meanwhile, by seq.
    buffered: BTreeMap<u64, (Fingerprint, B)>,
    /// Live batches up to this seq arrived but were not trusted (they came
    /// before a restart was seen, so may be the old run's): the reply
    /// supplies them, and their live copies will not come again.
    seen: Option<u64>,
    /// Batches of this run up to this seq were received and not kept (a
    /// full queue or buffer dropped them): a reply that ends before it
    /// (asked for before they were published) is asked again. Unlike
    /// `seen`, known to exist in the run the repair is about.
    owed: Option<u64>,
}

impl<B> Stream<B> {
    /// A new stream, first seen at `now` on a live connection. `upto` is
    /// the last seq of a pod restored from a snapshot (`None`: a new pod).
    pub fn new(limits: StreamLimits, replayable: bool, upto: Option<u64>, now: Instant) -> Self {
        Stream {
            limits,
            replayable,
            upto,
            recent: VecDeque::new(),
            replayed: BTreeMap::new(),
            repair: None,
            ticket: 0,
            connected: true,
            down_since: None,
            last_seen: now,
            verify: None,
        }
    }

    /// A stream restored from a snapshot (`upto` given to `new`), whose
    /// last batch had `fingerprint`: it is remembered as applied, so a
    /// catch-up or repair reply that holds another batch under its seq
    /// shows the pod restarted while we were down, as it would have if we
    /// had never stopped. Without it, a new run that had passed the
    /// snapshot's seq by the time we came back looked like the old run
    /// going on.
    pub fn restored_batch(mut self, fingerprint: Fingerprint) -> Self {
        if let Some(seq) = self.upto {
            self.recent.clear();
            self.recent.push_back((seq, fingerprint));
        }
        self
    }

    /// The last seq applied, if any.
    pub fn last_seq(&self) -> Option<u64> {
        self.upto
    }

    /// The first seq not applied yet; `None` after `u64::MAX`.
    fn expected(&self) -> Option<u64> {
        self.upto.map_or(Some(0), |s| s.checked_add(1))
    }

    /// Whether `seq` is at or below what was applied: a restart, unless
    /// it is a duplicate.
    fn backwards(&self, seq: u64) -> bool {
        self.upto.is_some_and(|upto| seq <= upto)
    }

    pub fn repairing(&self) -> bool {
        self.repair.is_some()
    }

    pub fn connected(&self) -> bool {
        self.connected
    }

    /// Whether a replay endpoint is known; learning one later (a dialed
    /// pod's socket) makes future gaps repairable.
    pub fn set_replayable(&mut self, replayable: bool) {
        self.replayable = replayable;
    }

    /// Feeds one input; pushes the actions to execute, in order, onto `out`.
    pub fn handle(&mut self, input: Input<B>, now: Instant, out: &mut Vec<Action<B>>) {
        match input {
            Input::Live(b) => {
                self.last_seen = now;
                self.live(b, out);
            }
            Input::CatchUp(items) => {
                self.last_seen = now;
                self.catch_up(items, out);
            }
            Input::Replayed { ticket, result } => self.replayed_reply(ticket, result, out),
            Input::Connection { up } => {
                self.connected = up;
                if up {
                    self.down_since = None;
                } else {
                    self.down_since.get_or_insert(now);
                    // The oldest batch not verified since wins: a second
                    // drop before any catch-up must not hide the first.
                    if self.replayable {
                        // The newest batch received, applied or buffered.
                        let buffered = self.repair.as_ref().and_then(|r| {
                            r.buffered.iter().next_back().map(|(s, (fp, _))| (*s, *fp))
                        });
                        let newest = self.recent.back().copied().max(buffered);
                        self.verify = self.verify.or(newest);
                    }
                }
            }
            Input::Dropped { seq } => self.dropped(seq, out),
            Input::Tick => {
                if self.expired(now) {
                    out.push(Action::Forget);
                }
            }
        }
    }

    fn expired(&self, now: Instant) -> bool {
        let (Some(after), Some(down)) = (self.limits.expiry, self.down_since) else {
            return false;
        };
        !self.connected
            && now.saturating_duration_since(down) >= after
            && now.saturating_duration_since(self.last_seen) >= after
    }

    fn is_duplicate(&self, seq: u64, fingerprint: Fingerprint) -> bool {
        self.recent.contains(&(seq, fingerprint)) || self.replayed.get(&seq) == Some(&fingerprint)
    }

    fn live(&mut self, b: Numbered<B>, out: &mut Vec<Action<B>>) {
        if let Some(repair) = &mut self.repair {
            // A connection delivers in order: a batch at or below one
            // buffered from it is a restarted run's (unless it is the same).
            let newest = repair.buffered.keys().next_back().copied();
            let in_order = newest.is_none_or(|n| b.seq > n);
            if b.seq >= repair.from && !in_order {
                if repair.buffered.get(&b.seq).map(|(fp, _)| *fp) == Some(b.fingerprint) {
                    out.push(Action::Note(Note::Duplicate));
                    return;
                }
            } else if b.seq >= repair.from {
                if repair.buffered.len() >= self.limits.max_buffered {
                    // The reply, or a later round, must reach it.
                    repair.owe(b.seq);
                    out.push(Action::Note(Note::BufferFull));
                } else {
                    repair.buffered.insert(b.seq, (b.fingerprint, b.batch));
                }
                return;
            }
        }
        if self.is_duplicate(b.seq, b.fingerprint) {
            // Its live copies come in order: older replayed ones won't.
            self.replayed = self.replayed.split_off(&b.seq);
            out.push(Action::Note(Note::Duplicate));
            return;
        }
        if self.backwards(b.seq) || self.repair.is_some() {
            self.restart(out);
        }
        let expected = self.expected().unwrap_or(0);
        if b.seq > expected {
            out.push(Action::Note(Note::Gap {
                from: expected,
                to: b.seq,
            }));
            if self.replayable {
                let mut buffered = BTreeMap::new();
                buffered.insert(b.seq, (b.fingerprint, b.batch));
                self.start_repair(expected, 1, buffered, None, out);
                return;
            }
            out.push(Action::Lost {
                missing: b.seq - expected,
            });
        }
        if self.replayed.keys().next_back().is_some_and(|&r| b.seq > r) {
            self.replayed.clear();
        }
        self.apply(b.seq, b.fingerprint, b.batch, out);
    }

    /// A live batch dropped on its way here: with a replay endpoint, it is
    /// fetched as a gap is (or the pending repair is told to reach it).
    /// Without one, the next batch reports it lost, as any gap. At or below
    /// what was applied there is nothing to fetch (a new run's first batch
    /// shows itself when the next one arrives).
    fn dropped(&mut self, seq: u64, out: &mut Vec<Action<B>>) {
        if !self.replayable || self.backwards(seq) {
            return;
        }
        if let Some(repair) = &mut self.repair {
            if seq >= repair.from {
                repair.owe(seq);
            }
            return;
        }
        let Some(from) = self.expected() else {
            return;
        };
        out.push(Action::Note(Note::Gap {
            from,
            to: seq.saturating_add(1),
        }));
        self.start_repair(from, 1, BTreeMap::new(), None, out);
        if let Some(repair) = &mut self.repair {
            repair.owe(seq);
        }
    }

    /// The publisher restarted: everything known about its old run goes.
    fn restart(&mut self, out: &mut Vec<Action<B>>) {
        out.push(Action::Restart);
        self.upto = None;
        self.recent.clear();
        self.verify = None;
        self.replayed.clear();
        // Its reply, if one comes, is about the old run.
        self.repair = None;
    }

    fn apply(&mut self, seq: u64, fingerprint: Fingerprint, batch: B, out: &mut Vec<Action<B>>) {
        self.upto = Some(seq);
        if self.recent.len() == RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back((seq, fingerprint));
        out.push(Action::Apply {
            seq,
            fingerprint,
            batch,
        });
    }

    fn start_repair(
        &mut self,
        from: u64,
        round: u32,
        buffered: BTreeMap<u64, (Fingerprint, B)>,
        seen: Option<u64>,
        out: &mut Vec<Action<B>>,
    ) {
        let check = self
            .recent
            .back()
            .copied()
            .filter(|(seq, _)| seq.checked_add(1) == Some(from));
        self.repair = Some(Repair {
            from,
            check,
            attempt: 1,
            round,
            buffered,
            seen,
            owed: None,
        });
        self.fetch(Duration::ZERO, out);
    }

    fn fetch(&mut self, delay: Duration, out: &mut Vec<Action<B>>) {
        let Some(repair) = &self.repair else { return };
        self.ticket = self.ticket.wrapping_add(1);
        // From the last applied batch, when there is one: the reply shows
        // whether it is still the pod's (see `check`).
        let from = repair.check.map_or(repair.from, |(seq, _)| seq);
        out.push(Action::Fetch {
            from,
            ticket: self.ticket,
            delay,
        });
    }

    /// A connection's catch-up: the pod's whole replay buffer.
    fn catch_up(&mut self, mut items: Vec<Numbered<B>>, out: &mut Vec<Action<B>>) {
        items.sort_by_key(|b| b.seq);
        items.dedup_by_key(|b| b.seq);
        let verify = self.verify.take();
        let Some(newest) = items.last().map(|b| b.seq) else {
            // An empty buffer no longer holds what we applied before the
            // connection dropped: a new run that has published nothing yet.
            if verify.is_some() {
                self.repair = None;
                self.restart(out);
            }
            return;
        };
        let changed = self.run_changed(&items, newest, verify);
        if changed
            || self
                .repair
                .as_ref()
                .is_some_and(|r| conflicts(&items, &r.buffered))
        {
            let buffered = self.repair.take().map(|r| r.buffered);
            self.restart_from(items, buffered, out);
            return;
        }
        let unverified = verify.is_some_and(|(seq, _)| {
            items.binary_search_by_key(&seq, |b| b.seq).is_err() && items[0].seq > seq
        });
        if unverified {
            out.push(Action::Unverified);
        }
        if let Some(repair) = &mut self.repair {
            // The pending fetch merges them (it asks again past them).
            for b in items {
                if b.seq >= repair.from && repair.buffered.len() < self.limits.max_buffered {
                    repair
                        .buffered
                        .entry(b.seq)
                        .or_insert((b.fingerprint, b.batch));
                }
            }
            return;
        }
        if !unverified && self.unverifiable(&items) {
            out.push(Action::Unverified);
        }
        let Some(from) = self.expected() else {
            return;
        };
        let applied = self.apply_run(from, items.into_iter(), out, true);
        out.push(Action::Note(Note::Replayed { batches: applied }));
    }

    /// Whether a buffer (sorted) starts after the last seq applied, so
    /// that batch cannot be compared.
    fn unverifiable(&self, items: &[Numbered<B>]) -> bool {
        match (self.upto, items.first()) {
            (Some(upto), Some(oldest)) => oldest.seq > upto,
            _ => false,
        }
    }

    /// The pod restarted, as its buffer `items` shows: they are the new
    /// run so far; buffered live batches past them follow, as live ones.
    fn restart_from(
        &mut self,
        items: Vec<Numbered<B>>,
        buffered: Option<BTreeMap<u64, (Fingerprint, B)>>,
        out: &mut Vec<Action<B>>,
    ) {
        self.restart(out);
        // Live batches buffered before the restart showed may be the old
        // run's: not trusted. The pod's buffer is asked for their seqs.
        let seen = buffered.and_then(|b| b.keys().next_back().copied());
        if items.first().is_some_and(|b| b.seq == 0) || !self.replayable {
            // The new run from its start: applied now.
            let newest = items.last().map(|b| b.seq);
            self.catch_up(items, out);
            if self.replayable && seen.is_some_and(|s| newest.is_none_or(|n| s > n)) {
                if let Some(from) = self.expected() {
                    self.start_repair(from, 1, BTreeMap::new(), seen, out);
                }
            }
            return;
        }
        // Only part of the new run: fetch it from its start.
        let mut buffered: BTreeMap<u64, (Fingerprint, B)> = items
            .into_iter()
            .map(|b| (b.seq, (b.fingerprint, b.batch)))
            .collect();
        while buffered.len() > self.limits.max_buffered {
            buffered.pop_last();
        }
        self.start_repair(0, 1, buffered, seen, out);
    }

    /// Whether a replay buffer (sorted, `newest` last) belongs to a new
    /// run of the publisher: it holds another batch under a seq we applied,
    /// or it ends before what we applied further back than a live batch
    /// can overtake a reply (the buffer answered before the live batches
    /// we applied since were published: not a restart).
    fn run_changed(
        &self,
        items: &[Numbered<B>],
        newest: u64,
        verify: Option<(u64, Fingerprint)>,
    ) -> bool {
        let differs = self.recent.iter().chain(&verify).any(|&(seq, fp)| {
            items
                .binary_search_by_key(&seq, |b| b.seq)
                .is_ok_and(|at| items[at].fingerprint != fp)
        });
        let oldest_recent = self.recent.front().map(|&(seq, _)| seq);
        let behind = match (self.upto, oldest_recent) {
            (Some(upto), Some(oldest)) => newest < upto && newest < oldest,
            // Restored from a snapshot: nothing to compare.
            (Some(upto), None) => newest < upto,
            _ => false,
        };
        // Ends before the batch applied when the connection dropped.
        let short = verify.is_some_and(|(seq, _)| newest < seq);
        differs || behind || short
    }

    /// Applies `batches` (sorted by seq) from `from` on; what is missing in
    /// between is reported lost. `from_replay`: their live copies may
    /// still arrive. Returns the batches applied.
    fn apply_run(
        &mut self,
        from: u64,
        batches: impl Iterator<Item = Numbered<B>>,
        out: &mut Vec<Action<B>>,
        from_replay: bool,
    ) -> u64 {
        let (mut expected, mut missing, mut applied) = (from, 0, 0);
        for b in batches.filter(|b| b.seq >= from) {
            missing += b.seq - expected;
            if from_replay {
                self.remember_replayed(b.seq, b.fingerprint);
            }
            expected = b.seq.saturating_add(1);
            self.apply(b.seq, b.fingerprint, b.batch, out);
            applied += 1;
        }
        if missing > 0 {
            out.push(Action::Lost { missing });
        }
        applied
    }

    fn remember_replayed(&mut self, seq: u64, fingerprint: Fingerprint) {
        if self.replayed.len() >= self.limits.max_buffered {
            self.replayed.pop_first();
        }
        self.replayed.insert(seq, fingerprint);
    }

    fn replayed_reply(
        &mut self,
        ticket: u32,
        result: Result<Vec<Numbered<B>>, String>,
        out: &mut Vec<Action<B>>,
    ) {
        if ticket != self.ticket {
            return;
        }
        let Some(repair) = &mut self.repair else {
            return;
        };
        let mut failed = false;
        let mut items = match result {
            Ok(items) => items,
            Err(_) if repair.attempt < self.limits.max_attempts => {
                let delay = self.limits.retry_base * 2u32.saturating_pow(repair.attempt - 1);
                repair.attempt += 1;
                out.push(Action::Note(Note::ReplayRetry {
                    attempt: repair.attempt,
                }));
                self.fetch(delay, out);
                return;
            }
            Err(_) => {
                out.push(Action::Note(Note::ReplayFailed));
                failed = true;
                Vec::new()
            }
        };
        items.sort_by_key(|b| b.seq);
        items.dedup_by_key(|b| b.seq);
        let Some(repair) = self.repair.take() else {
            return;
        };
        let at_check = repair
            .check
            .map(|(seq, fp)| (fp, items.binary_search_by_key(&seq, |b| b.seq)));
        let restarted = matches!(at_check, Some((fp, Ok(at))) if items[at].fingerprint != fp)
            || conflicts(&items, &repair.buffered);
        if restarted {
            // The pod's buffer is a new run: take it as a catch-up, then
            // its live batches as they come.
            self.restart_from(items, Some(repair.buffered), out);
            return;
        }
        if matches!(at_check, Some((_, Err(_)))) && !items.is_empty() {
            out.push(Action::Unverified);
        }
        // Replayed batches past the newest buffered live one are still on
        // their way live.
        let upto = repair
            .buffered
            .keys()
            .next_back()
            .copied()
            .max(repair.seen)
            .unwrap_or(repair.from);
        // The newest seq the pod had when it answered: gaps up to it are
        // really gone from its buffer; gaps past it were not published yet.
        let covered = items.last().map(|b| b.seq);
        // Nothing to ask again for: the pod is unreachable, or its buffer
        // holds nothing from `from` on.
        let last_round = failed || items.is_empty() || repair.round >= self.limits.max_rounds;
        let mut merged: BTreeMap<u64, (Fingerprint, B, bool)> = BTreeMap::new();
        for (seq, (fp, batch)) in repair.buffered {
            merged.insert(seq, (fp, batch, false));
        }
        let mut recovered = 0;
        for b in items {
            if b.seq >= repair.from && b.seq <= upto && !merged.contains_key(&b.seq) {
                merged.insert(b.seq, (b.fingerprint, b.batch, true));
                recovered += 1;
            }
        }
        out.push(Action::Note(Note::Replayed { batches: recovered }));
        // Apply up to the first gap past the reply's coverage; from there,
        // ask again.
        let covered = covered.unwrap_or(repair.from.saturating_sub(1));
        let mut expected = repair.from;
        let split = merged
            .keys()
            .find(|&&seq| {
                let uncovered_gap = seq > expected && expected > covered;
                expected = seq.saturating_add(1);
                uncovered_gap
            })
            .copied();
        let later = match split {
            Some(at) if !last_round => Some(merged.split_off(&at)),
            _ => None,
        };
        let mut replayed = Vec::new();
        let now = merged.into_iter().map(|(seq, (fingerprint, batch, r))| {
            if r {
                replayed.push((seq, fingerprint));
            }
            Numbered {
                seq,
                fingerprint,
                batch,
            }
        });
        self.apply_run(repair.from, now, out, false);
        for (seq, fp) in replayed {
            self.remember_replayed(seq, fp);
        }
        if let Some(later) = later {
            let from = self.expected().unwrap_or(repair.from);
            let round = repair.round + 1;
            out.push(Action::Note(Note::NextRound { from, round }));
            let buffered = later
                .into_iter()
                .map(|(seq, (fp, batch, _))| (seq, (fp, batch)))
                .collect();
            self.start_repair(
                from,
                round,
                buffered,
                repair.seen.filter(|s| *s >= from),
                out,
            );
            if let (Some(owed), Some(next)) = (repair.owed.filter(|s| *s >= from), &mut self.repair)
            {
                next.owe(owed);
            }
            return;
        }
        // Batches up to `owed` were received and not kept: their live
        // copies will not come again. A reply that ended before them (it
        // was asked for before they were published) is asked again. When
        // the pod could not be reached they are lost, as a gap's batches
        // are when its fetches fail: said now (the pod may stay quiet, and
        // no later batch would show them), and passed, so that the pod's
        // next batch applies in order instead of fetching and counting
        // them again. (Replies that keep ending before them, or hold
        // nothing from `from` on, are a restarted run's: the dropped
        // batches were the old run's, and the next batch tells.)
        let Some(owed) = repair.owed.filter(|s| self.upto.is_none_or(|u| u < *s)) else {
            return;
        };
        if failed {
            let first_missing = self.expected().unwrap_or(repair.from);
            out.push(Action::Lost {
                missing: (owed - first_missing).saturating_add(1),
            });
            self.upto = Some(owed);
            return;
        }
        if last_round {
            return;
        }
        let from = self.expected().unwrap_or(repair.from);
        let round = repair.round + 1;
        out.push(Action::Note(Note::NextRound { from, round }));
        self.start_repair(from, round, BTreeMap::new(), None, out);
        if let Some(repair) = &mut self.repair {
            repair.owe(owed);
        }
    }
}

impl<B> Repair<B> {
    /// Batch `seq` of this run was received and not kept: the reply must
    /// reach it (see `owed`).
    fn owe(&mut self, seq: u64) {
        self.seen = self.seen.max(Some(seq));
        self.owed = self.owed.max(Some(seq));
    }
}

/// Whether a replay buffer (sorted) holds another batch under a seq of a
/// buffered live one: one of them is from a restarted run.
fn conflicts<B>(items: &[Numbered<B>], buffered: &BTreeMap<u64, (Fingerprint, B)>) -> bool {
    items.iter().any(|b| {
        buffered
            .get(&b.seq)
            .is_some_and(|(fp, _)| *fp != b.fingerprint)
    })
}

#[cfg(test)]
mod tests;
