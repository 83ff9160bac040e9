//! vLLM publisher topics: `kv@<pod>@<model>`.

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
}

/// Splits a topic at its first two `@`: the pod may contain `:` (host:port),
/// the model may contain `/` (and, after the second `@`, anything).
pub fn parse_topic(raw: &[u8]) -> Result<Topic<'_>, TopicError> {
    let s = std::str::from_utf8(raw).map_err(|_| TopicError::NotUtf8)?;
    let shape = || TopicError::Shape(s.chars().take(200).collect());
    let (_, rest) = s.split_once('@').ok_or_else(shape)?;
    let (pod, model) = rest.split_once('@').ok_or_else(shape)?;
    if pod.is_empty() || model.is_empty() {
        return Err(shape());
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
}
