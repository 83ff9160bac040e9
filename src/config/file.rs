//! Reading the `--config` file into `Settings`, with the same parsers as
//! the flags: each YAML value becomes text (`FileValue`), which the
//! setting's type parses with its `FromStr`. Errors name the key.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use humantime::Duration;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;

use super::values::*;
use super::{ConfigError, FileConfig};

pub(super) fn read_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    if text.trim().is_empty() {
        return Ok(FileConfig::default());
    }
    // The path (`max_memory`, `tier_weight[1]`) names the setting, as clap
    // names a flag; serde's own errors only say where.
    serde_path_to_error::deserialize(serde_norway::Deserializer::from_str(&text)).map_err(
        |source| ConfigError::Parse {
            path: path.to_owned(),
            source,
        },
    )
}

/// A setting's YAML value, before its type parses it: a scalar's text
/// (numbers and booleans included, so `block_size: 16` and
/// `block_size: "16"` both work), or a list's entries. A map is a list of
/// `KEY=VALUE` entries: the older keys (`tier_weights: {gpu: 1.0}`) and
/// the flags' own spelling (`tier_weight: ["gpu=1"]`) become the same.
pub(super) enum FileValue {
    One(String),
    Many(Vec<String>),
}

/// Parses a file value with the type's own `FromStr`, as clap does a flag's.
pub(super) trait FromFile: Sized {
    fn from_file(value: FileValue) -> Result<Self, String>;
}

macro_rules! from_file_by_from_str {
    ($($t:ty),* $(,)?) => {$(
        impl FromFile for $t {
            fn from_file(value: FileValue) -> Result<Self, String> {
                one(value)
            }
        }
    )*};
}
// Every scalar type in the table (a blanket impl over `FromStr` would
// collide with the one for lists). A new type fails to compile until added.
from_file_by_from_str!(
    SocketAddr,
    PathBuf,
    String,
    bool,
    u32,
    usize,
    Duration,
    Size,
    LogFormat,
    IngestPriority,
    IncompletePods,
    KeyModeName,
    HashAlgoName,
    ExtraKeys,
    f64,
    SpeculativeTtl,
);

impl<T: FromStr> FromFile for OrNone<T>
where
    T::Err: std::fmt::Display,
{
    fn from_file(value: FileValue) -> Result<Self, String> {
        one(value)
    }
}

impl<T: FromStr> FromFile for Vec<T>
where
    T::Err: std::fmt::Display,
{
    fn from_file(value: FileValue) -> Result<Self, String> {
        match value {
            FileValue::Many(entries) => entries.iter().map(|e| parse(e)).collect(),
            FileValue::One(_) => Err("want a list".into()),
        }
    }
}

fn one<T: FromStr>(value: FileValue) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    match value {
        FileValue::One(text) => parse(&text),
        FileValue::Many(_) => Err("want a single value, not a list or map".into()),
    }
}

fn parse<T: FromStr>(text: &str) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    text.parse()
        .map_err(|e| format!("invalid value {text:?}: {e}"))
}

/// serde's `deserialize_with` for every setting: YAML null is "not given".
pub(super) fn from_file<'de, D: Deserializer<'de>, T: FromFile>(
    d: D,
) -> Result<Option<T>, D::Error> {
    match Option::<FileValue>::deserialize(d)? {
        None => Ok(None),
        Some(value) => T::from_file(value).map(Some).map_err(de::Error::custom),
    }
}

impl<'de> Deserialize<'de> for FileValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = FileValue;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a value, a list or a map")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<FileValue, A::Error> {
                let mut entries = Vec::new();
                while let Some(Text(entry)) = seq.next_element()? {
                    entries.push(entry);
                }
                Ok(FileValue::Many(entries))
            }
            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<FileValue, A::Error> {
                let mut entries = Vec::new();
                while let Some((Text(k), Text(v))) = map.next_entry()? {
                    entries.push(format!("{k}={v}"));
                }
                Ok(FileValue::Many(entries))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<FileValue, E> {
                TextVisitor.visit_str(v).map(FileValue::One)
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<FileValue, E> {
                TextVisitor.visit_bool(v).map(FileValue::One)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<FileValue, E> {
                TextVisitor.visit_i64(v).map(FileValue::One)
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<FileValue, E> {
                TextVisitor.visit_u64(v).map(FileValue::One)
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<FileValue, E> {
                TextVisitor.visit_f64(v).map(FileValue::One)
            }
        }
        d.deserialize_any(V)
    }
}

/// One scalar as text; null is blank (a blank list entry is skipped).
struct Text(String);

struct TextVisitor;

impl<'de> Visitor<'de> for TextVisitor {
    type Value = String;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a string, a number or a boolean")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<String, E> {
        Ok(v.to_owned())
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<String, E> {
        Ok(v.to_string())
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<String, E> {
        Ok(v.to_string())
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<String, E> {
        Ok(v.to_string())
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<String, E> {
        Ok(v.to_string())
    }
    fn visit_unit<E: de::Error>(self) -> Result<String, E> {
        Ok(String::new())
    }
}

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(TextVisitor).map(Text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Settings;

    #[test]
    fn file_values_are_parsed_like_flags() {
        let s: Settings = serde_norway::from_str(
            "block_size: '32'\nadmin: true\nmax_memory: 4GiB\nmetrics_addr: none\n\
             tier_weights: {gpu: 1.0, cpu: 0.5}\nzmq_allow: [10.0.0.0/8, '::1']\n\
             zmq_connect: ['tcp://a:1', '']\n\
             engine_hash_seed: 7\ntokenizers_dir: ~\n",
        )
        .unwrap();
        assert_eq!(s.block_size, Some(32));
        assert_eq!(s.admin, Some(true));
        assert_eq!(s.max_memory, Some(Size(4 << 30)));
        assert_eq!(s.metrics_addr, Some(OrNone(None)));
        assert_eq!(s.engine_hash_seed.as_deref(), Some("7"));
        assert_eq!(s.tokenizers_dir, None);
        let weights = items(s.tier_weight);
        assert_eq!(weights.len(), 2);
        assert_eq!((weights[1].tier, weights[1].weight), (1, 0.5));
        assert_eq!(items(s.zmq_allow).len(), 2);
        assert_eq!(items(s.zmq_connect).len(), 1);
    }

    #[test]
    fn file_errors_say_what_is_wrong() {
        let err = serde_norway::from_str::<Settings>("zmq_connect: tcp://a:1\n").unwrap_err();
        assert!(err.to_string().contains("want a list"), "{err}");
        let err = serde_norway::from_str::<Settings>("block_size: [1]\n").unwrap_err();
        assert!(err.to_string().contains("single value"), "{err}");
        let err =
            serde_norway::from_str::<Settings>("tier_weight: [gpu=1]\ntier_weights: {gpu: 1}\n")
                .unwrap_err();
        assert!(err.to_string().contains("tier_weight"), "{err}");
    }
}
