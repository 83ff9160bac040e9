//! vLLM publisher topics: `kv@<pod>@<model>`.
//!
//! A topic comes from whoever reaches the event port, and its pod and model
//! names end up as map keys, metric labels and log fields: it is bounded
//! here, once, before anything keeps a copy of it.

/// Pod and model named by a topic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topic<'a> {
    pub pod: &'a str,
    pub model: &'a str,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TopicError {
    #[error("topic is not UTF-8")]
    NotUtf8,
    #[error("topic {0:?} is not of the form <prefix>@<pod>@<model>")]
    Shape(String),
    #[error("topic is {0} bytes, over the {MAX_TOPIC_BYTES}-byte limit")]
    TooLong(usize),
    #[error("topic {0:?} has a control or non-printable character in its pod or model name")]
    Unprintable(String),
}

/// Longest topic accepted. vLLM's are `kv@<pod>@<model>`: a pod name (a
/// Kubernetes name is at most 253 bytes, an `IP:port` far less) and a model
/// name (a Hugging Face repo id is at most 96 bytes), with room to spare.
pub const MAX_TOPIC_BYTES: usize = 512;

/// A name that goes into logs and metric labels must not carry control
/// characters (newlines forge log lines, escapes reach terminals) or
/// invisible formatting characters that make two names look alike.
fn printable(name: &str) -> bool {
    name.chars().all(|c| {
        !c.is_control()
            && !matches!(c,
                '\u{200B}'..='\u{200F}' // zero-width spaces, direction marks
                | '\u{2028}'..='\u{202E}' // line/paragraph separators, embeddings
                | '\u{2060}'..='\u{206F}' // word joiner, invisible operators
                | '\u{FEFF}' // byte order mark
            )
    })
}

/// Splits a topic at its first two `@`: the pod may contain `:` (host:port),
/// the model may contain `/` (and, after the second `@`, anything).
pub fn parse_topic(raw: &[u8]) -> Result<Topic<'_>, TopicError> {
    if raw.len() > MAX_TOPIC_BYTES {
        return Err(TopicError::TooLong(raw.len()));
    }
    let s = std::str::from_utf8(raw).map_err(|_| TopicError::NotUtf8)?;
    let shape = || TopicError::Shape(s.chars().take(200).collect());
    let (_, rest) = s.split_once('@').ok_or_else(shape)?;
    let (pod, model) = rest.split_once('@').ok_or_else(shape)?;
    if pod.is_empty() || model.is_empty() {
        return Err(shape());
    }
    if !printable(pod) || !printable(model) {
        return Err(TopicError::Unprintable(
            s.escape_debug().take(200).collect(),
        ));
    }
    Ok(Topic { pod, model })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_pod_and_model() {
        assert_eq!(
            parse_topic(b"kv@pod-0@Qwen/Qwen3-8B"),
            Ok(Topic {
                pod: "pod-0",
                model: "Qwen/Qwen3-8B"
            })
        );
        assert_eq!(
            parse_topic(b"kv@10.0.0.7:8000@org/m@v2"),
            Ok(Topic {
                pod: "10.0.0.7:8000",
                model: "org/m@v2"
            })
        );
    }

    #[test]
    fn rejects_malformed_topics() {
        for bad in [&b"kv"[..], b"kv@pod", b"kv@@m", b"kv@pod@", b"\xff@a@b"] {
            assert!(parse_topic(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn bounds_length_and_refuses_unprintable_names() {
        let at_limit = format!("kv@{}@m", "p".repeat(MAX_TOPIC_BYTES - 5));
        assert!(parse_topic(at_limit.as_bytes()).is_ok());
        let over = format!("kv@{}@m", "p".repeat(MAX_TOPIC_BYTES - 4));
        assert_eq!(
            parse_topic(over.as_bytes()),
            Err(TopicError::TooLong(MAX_TOPIC_BYTES + 1))
        );
        for bad in [
            "kv@pod\n@m",
            "kv@pod@m\r\nINFO forged",
            "kv@po\u{1b}[31md@m",
            "kv@pod@m\u{200B}",
            "kv@\u{7f}@m",
        ] {
            assert!(
                matches!(parse_topic(bad.as_bytes()), Err(TopicError::Unprintable(_))),
                "{bad:?}"
            );
        }
        // Non-ASCII printable names are fine (model names are often not ASCII).
        assert!(parse_topic("kv@pod-é@模型/v1".as_bytes()).is_ok());
    }
}
