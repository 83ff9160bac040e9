//! What every request goes through before its work: admission under
//! `--max-inflight`, the client's deadline (`grpc-timeout`), the size
//! limits, and the observation of the handler (latency, outcome, a panic
//! answered INTERNAL).

use super::*;

/// When a request stops being worth answering (`grpc-timeout`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Deadline(pub(super) Option<Instant>);

/// How much earlier than the client's `grpc-timeout` we stop, at most (a
/// tenth of the timeout below 1 s): tonic's transport also enforces that
/// header, and when its timer wins the client hears CANCELLED ("Timeout
/// expired") instead of DEADLINE_EXCEEDED and what we were waiting for.
/// Our answer must beat that timer by the time the runtime takes to wake
/// the waiting task and write the reply: 20 ms lost that race when the
/// machine was busy (32 waiters at once on 2 loaded cores, in a test).
pub(super) const DEADLINE_MARGIN: Duration = Duration::from_millis(100);

impl Deadline {
    /// Fails if the deadline has passed: work that cannot be used is not started.
    pub(super) fn check(self, before: &'static str) -> Result<(), ApiError> {
        match self.0 {
            Some(d) if Instant::now() >= d => Err(ApiError::DeadlineExceeded(before)),
            _ => Ok(()),
        }
    }
}

/// `--max-prompt` (`limit` bytes) for `what`, of `bytes`.
pub(super) fn within_max_prompt(
    what: &'static str,
    bytes: usize,
    limit: usize,
) -> Result<(), ApiError> {
    if bytes > limit {
        return Err(ApiError::TooLarge {
            what,
            got: bytes,
            limit,
            flag: "max-prompt",
        });
    }
    Ok(())
}

/// `grpc-timeout`: digits then H, M, S, m (ms), u (us) or n (ns).
pub(super) fn parse_grpc_timeout(v: &str) -> Option<Duration> {
    let (num, unit) = v.split_at(v.len().checked_sub(1)?);
    let n: u64 = num.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

impl KvIndexerService {
    /// Admits a scoring request or refuses it at once: under overload the
    /// answer is RESOURCE_EXHAUSTED now, not a queue that grows. Event
    /// ingestion runs on its own threads and is never slowed by queries.
    pub(crate) fn admit(
        &self,
        metadata: &tonic::metadata::MetadataMap,
    ) -> Result<(OwnedSemaphorePermit, Deadline), ApiError> {
        let permit = self.inflight.clone().try_acquire_owned().map_err(|_| {
            self.metrics.rejected_overload.inc();
            ApiError::Overloaded(self.limits.max_inflight)
        })?;
        let deadline = metadata
            .get("grpc-timeout")
            .and_then(|v| v.to_str().ok())
            .and_then(parse_grpc_timeout)
            .map(|d| Instant::now() + d.saturating_sub(DEADLINE_MARGIN.min(d / 10)));
        Ok((permit, Deadline(deadline)))
    }

    /// `--max-prompt`, for a text prompt or chat body (`what`) of `bytes`.
    pub(super) fn check_prompt_bytes(
        &self,
        what: &'static str,
        bytes: usize,
    ) -> Result<(), ApiError> {
        within_max_prompt(what, bytes, self.limits.max_prompt_bytes)
    }

    pub(super) fn check_tokens(&self, n: usize) -> Result<(), ApiError> {
        if n > self.limits.max_prompt_tokens {
            return Err(ApiError::TooLarge {
                what: "the prompt's token count",
                got: n,
                limit: self.limits.max_prompt_tokens,
                flag: "max-prompt-tokens",
            });
        }
        Ok(())
    }

    pub(super) fn check_candidates(&self, n: usize) -> Result<(), ApiError> {
        if n > self.limits.max_candidate_pods {
            return Err(ApiError::TooLarge {
                what: "the number of candidate pods",
                got: n,
                limit: self.limits.max_candidate_pods,
                flag: "max-candidate-pods",
            });
        }
        Ok(())
    }
}

impl KvIndexerService {
    /// Runs a scoring future inside its span, recording latency and
    /// outcome. A panic in the work becomes INTERNAL (and is counted): one
    /// bad request never takes the server down.
    pub(crate) async fn observed<T>(
        &self,
        kind: &'static str,
        span: tracing::Span,
        work: impl std::future::Future<Output = Result<T, ApiError>>,
    ) -> Result<T, ApiError> {
        let started = Instant::now();
        let result = tracing::Instrument::instrument(
            std::panic::AssertUnwindSafe(work).catch_unwind(),
            span.clone(),
        )
        .await
        .unwrap_or_else(|panic| {
            self.metrics.handler_panics.inc();
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            tracing::error!(panic = %what, "request handler panicked");
            Err(ApiError::Internal("the request handler panicked".into()))
        });
        let code = result
            .as_ref()
            .map_or_else(ApiError::code, |_| tonic::Code::Ok);
        self.metrics.observe_score(kind, code, started.elapsed());
        span.in_scope(|| {
            tracing::debug!(
                ?code,
                elapsed_us = started.elapsed().as_micros() as u64,
                "score"
            )
        });
        result
    }
}
