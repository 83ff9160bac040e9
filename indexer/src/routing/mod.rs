//! Routing feedback: what the router did with our answers.
//!
//! After the router picks a pod it tells us (`RecordRouting`). Until that
//! pod's first `BlockStored` for the prompt arrives (milliseconds to a few
//! hundred ms later: vLLM stores blocks when it schedules the request), the
//! exact index cannot know where the prompt went, and a burst of requests
//! sharing a new prefix would scatter. So:
//! - `speculative`: the pod's blocks of the prompt become speculative
//!   entries beside the exact index (never in it), with a TTL;
//! - `ttl`: fixed, or learned per pod from how fast its stores follow;
//! - `tracker`: each routing ends in one outcome (confirmed, mismatch,
//!   unconfirmed) once the pod's stores arrive or its TTL passes;
//! - `diagnose`: when the pod stored the prompt under other keys, how its
//!   tokens differ from ours (a BOS, the block size, LoRA or salt, other
//!   tokens): the silent tokenization-parity failure made visible;
//! - `approximate`: for models whose pods publish nothing, routing history
//!   is the index (llm-d's approximate producer).

pub mod approximate;
pub mod diagnose;
pub mod speculative;
pub mod tracker;
pub mod ttl;
