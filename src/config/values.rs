//! What one setting's value looks like. Each type parses the text of a
//! flag, an environment variable or a YAML scalar (`FromStr`), so the three
//! sources accept exactly the same spellings. Whether a well-formed value is
//! acceptable (a range, another setting it needs) is for `validate.rs`.

use std::fmt::Display;
use std::net::IpAddr;
use std::path::PathBuf;
use std::str::FromStr;

use clap::ValueEnum;
use indexer::keys::engine_hash::{ExtraKeyStyle, HashAlgo};
use ipnet::IpNet;

/// Sizes above this are refused: every size setting bounds memory that one
/// process holds (the index, a cache, one message), so a terabyte is a typo
/// (`T` for `G`) rather than a wish, and is better caught at start.
const MAX_SIZE: u64 = 1 << 40;

/// `1234`, `64KiB`, `256MiB`, `4GiB` (parse-size). `K`/`KB`, `M`/`MB`,
/// `G`/`GB` are powers of 1024 here, as they have always been: a limit
/// written `16MB` keeps its meaning instead of shrinking to 16,000,000.
/// `None` above 1 TiB (see [`MAX_SIZE`]).
pub fn parse_bytes(raw: &str) -> Option<usize> {
    let n = parse_size::Config::new()
        .with_binary()
        .parse_size(raw.trim())
        .ok()?;
    usize::try_from(n).ok().filter(|_| n <= MAX_SIZE)
}

/// A byte size, e.g. `16MiB` (see [`parse_bytes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Size(pub usize);

impl FromStr for Size {
    type Err = String;
    fn from_str(raw: &str) -> Result<Self, String> {
        parse_bytes(raw)
            .map(Size)
            .ok_or_else(|| "want a size such as 1234, 64KiB, 16MiB or 4GiB (at most 1TiB)".into())
    }
}

/// A value, or `none` / `off` (any case) or blank for none: how a listener
/// or a timer is switched off.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OrNone<T>(pub Option<T>);

impl<T: FromStr> FromStr for OrNone<T> {
    type Err = T::Err;
    fn from_str(raw: &str) -> Result<Self, T::Err> {
        let s = raw.trim();
        if s.is_empty() || s.eq_ignore_ascii_case("none") || s.eq_ignore_ascii_case("off") {
            Ok(OrNone(None))
        } else {
            s.parse().map(|v| OrNone(Some(v)))
        }
    }
}

/// `--speculative-ttl`: `auto` or a duration longer than zero.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SpeculativeTtl(pub indexer::routing::ttl::TtlPolicy);

impl FromStr for SpeculativeTtl {
    type Err = String;
    fn from_str(raw: &str) -> Result<Self, String> {
        use indexer::routing::ttl::TtlPolicy;
        let s = raw.trim();
        if s.eq_ignore_ascii_case("auto") {
            return Ok(SpeculativeTtl(TtlPolicy::Auto));
        }
        match humantime::parse_duration(s) {
            Ok(d) if !d.is_zero() => Ok(SpeculativeTtl(TtlPolicy::Fixed(d))),
            Ok(_) => Err("must be longer than 0".into()),
            Err(e) => Err(format!("want `auto` or a duration such as 2s ({e})")),
        }
    }
}

/// One entry of a repeatable setting. A blank entry (a trailing delimiter in
/// an environment variable, an empty variable from a template) is no entry,
/// as it always was, rather than an error.
#[derive(Clone, Debug, PartialEq)]
pub struct Item<T>(pub Option<T>);

impl<T: FromStr> FromStr for Item<T> {
    type Err = T::Err;
    fn from_str(raw: &str) -> Result<Self, T::Err> {
        match raw.trim() {
            "" => Ok(Item(None)),
            s => s.parse().map(|v| Item(Some(v))),
        }
    }
}

/// The entries of a repeatable setting, blanks left out.
pub fn items<T>(list: Option<Vec<Item<T>>>) -> Vec<T> {
    list.into_iter().flatten().filter_map(|i| i.0).collect()
}

/// `KEY=VALUE`, both sides trimmed; `shape` names them in the error.
pub(super) fn split_pair<'a>(raw: &'a str, shape: &str) -> Result<(&'a str, &'a str), String> {
    match raw.trim().split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim(), v.trim())),
        _ => Err(format!("want {shape}")),
    }
}

/// `--tier-weight TIER=WEIGHT`: `tier` is an index into `TierWeights`.
#[derive(Clone, Debug, PartialEq)]
pub struct TierWeight {
    pub tier: usize,
    pub weight: f64,
}

impl FromStr for TierWeight {
    type Err = String;
    fn from_str(raw: &str) -> Result<Self, String> {
        let (tier, weight) = split_pair(raw, "TIER=WEIGHT")?;
        let tier = match tier.to_ascii_lowercase().as_str() {
            "gpu" => 0,
            "cpu" => 1,
            "storage" => 2,
            _ => return Err(format!("tier {tier:?} must be gpu, cpu or storage")),
        };
        let weight = weight
            .parse()
            .map_err(|_| format!("weight {weight:?} must be a number in [0, 1]"))?;
        Ok(TierWeight { tier, weight })
    }
}

/// `--lora-path NAME=PATH`: the path as given to vLLM (hashed, never read).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoraPath {
    pub name: String,
    pub path: String,
}

impl FromStr for LoraPath {
    type Err = String;
    fn from_str(raw: &str) -> Result<Self, String> {
        let (name, path) = split_pair(raw, "NAME=PATH")?;
        Ok(LoraPath {
            name: name.to_owned(),
            path: path.to_owned(),
        })
    }
}

/// `--render-url MODEL=URL`: a model's vLLM render server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RenderUrl {
    pub model: String,
    /// Without a trailing slash.
    pub url: String,
}

impl FromStr for RenderUrl {
    type Err = String;
    fn from_str(raw: &str) -> Result<Self, String> {
        let (model, url) = split_pair(raw, "MODEL=URL")?;
        let Some(rest) = url.strip_prefix("http://").or(url.strip_prefix("https://")) else {
            return Err("want an http:// or https:// URL".into());
        };
        // Credentials would reach error messages and logs with the URL.
        if rest
            .split('/')
            .next()
            .is_some_and(|host| host.contains('@'))
        {
            return Err("credentials in the URL are not supported".into());
        }
        Ok(RenderUrl {
            model: model.to_owned(),
            url: url.trim_end_matches('/').to_owned(),
        })
    }
}

/// `--tokenizer MODEL=PATH`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenizerPath {
    pub model: String,
    pub path: PathBuf,
}

impl FromStr for TokenizerPath {
    type Err = String;
    fn from_str(raw: &str) -> Result<Self, String> {
        let (model, path) = split_pair(raw, "MODEL=PATH")?;
        Ok(TokenizerPath {
            model: model.to_owned(),
            path: PathBuf::from(path),
        })
    }
}

/// `--engine-hash-algo`: vLLM's `--prefix-caching-hash-algo` names, as the
/// indexer crate spells them (one list of names, there).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HashAlgoName(pub HashAlgo);

impl FromStr for HashAlgoName {
    type Err = String;
    fn from_str(raw: &str) -> Result<Self, String> {
        HashAlgo::parse(raw.trim())
            .map(HashAlgoName)
            .ok_or_else(|| {
                "want sha256, sha256_cbor, xxhash, xxhash_cbor (vLLM) or sglang, sglang_dynamo (SGLang)"
                    .into()
            })
    }
}

/// The mode half of `--model-key-mode MODEL=token|engine[:ALGO[:SEED]]`;
/// an engine mode's missing algorithm and seed are the global ones.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyModeSpec {
    Token,
    Engine {
        algo: Option<HashAlgo>,
        seed: Option<String>,
    },
}

/// `--model-key-mode MODEL=MODE`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelKeyMode {
    pub model: String,
    pub mode: KeyModeSpec,
}

impl FromStr for ModelKeyMode {
    type Err = String;
    fn from_str(raw: &str) -> Result<Self, String> {
        const SHAPE: &str = "MODEL=token or MODEL=engine[:ALGO[:SEED]]";
        let (model, spec) = split_pair(raw, SHAPE)?;
        let mut parts = spec.splitn(3, ':');
        let mode = match (parts.next(), parts.next(), parts.next()) {
            (Some("token"), None, _) => KeyModeSpec::Token,
            (Some("engine"), algo, seed) => KeyModeSpec::Engine {
                algo: algo
                    .map(|a| a.parse::<HashAlgoName>().map(|a| a.0))
                    .transpose()?,
                seed: seed.map(str::to_owned),
            },
            _ => return Err(format!("want {SHAPE}")),
        };
        Ok(ModelKeyMode {
            model: model.to_owned(),
            mode,
        })
    }
}

/// `--zmq-allow`: a network (`10.0.0.0/8`, `fd00::/8`) or one address
/// (`10.1.2.3`, meaning /32, or /128 for IPv6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Network(pub IpNet);

impl FromStr for Network {
    type Err = String;
    fn from_str(raw: &str) -> Result<Self, String> {
        let s = raw.trim();
        s.parse::<IpNet>()
            .or_else(|_| s.parse::<IpAddr>().map(IpNet::from))
            .map(Network)
            .map_err(|_| "want a network such as 10.0.0.0/8 or an address such as 10.1.2.3".into())
    }
}

/// `--log-format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// `--ingest-priority`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum IngestPriority {
    Normal,
    Idle,
}

/// `--incomplete-pods`: what scoring does with a pod whose gaps replay
/// could not fill.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum IncompletePods {
    Score,
    Drop,
}

/// `--key-mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum KeyModeName {
    Token,
    Engine,
}

/// `--engine-extra-keys`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ExtraKeys {
    Tagged,
    Bare,
}

impl From<ExtraKeys> for ExtraKeyStyle {
    fn from(k: ExtraKeys) -> Self {
        match k {
            ExtraKeys::Tagged => ExtraKeyStyle::Tagged,
            ExtraKeys::Bare => ExtraKeyStyle::Bare,
        }
    }
}

/// The names clap accepts for a `ValueEnum`, for the file's values too (clap
/// itself picks `ValueEnum` over `FromStr`, and lists the names in `--help`).
fn value_enum<T: ValueEnum>(raw: &str) -> Result<T, String> {
    T::from_str(raw.trim(), false).map_err(|_| {
        let names: Vec<String> = T::value_variants()
            .iter()
            .filter_map(|v| v.to_possible_value())
            .map(|p| p.get_name().to_owned())
            .collect();
        format!("want {}", names.join(" or "))
    })
}

macro_rules! from_str_by_value_enum {
    ($($t:ty),*) => {$(
        impl FromStr for $t {
            type Err = String;
            fn from_str(raw: &str) -> Result<Self, String> {
                value_enum(raw)
            }
        }
    )*};
}
from_str_by_value_enum!(
    LogFormat,
    IngestPriority,
    IncompletePods,
    KeyModeName,
    ExtraKeys
);

/// A default as written in the settings table, parsed like any other value;
/// the tests resolve every default, so a typo there fails `cargo test`.
pub(super) fn parse_default<T: FromStr>(setting: &str, text: &str) -> T
where
    T::Err: Display,
{
    text.parse()
        .unwrap_or_else(|e| panic!("the default of {setting}, {text:?}, does not parse: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_keep_their_binary_units() {
        assert_eq!(parse_bytes("16MB"), Some(16 << 20));
        assert_eq!(parse_bytes("4 GiB"), Some(4 << 30));
        assert_eq!(parse_bytes("1TiB"), Some(1 << 40));
        assert_eq!(parse_bytes("1025GiB"), None);
        assert_eq!(parse_bytes("-1"), None);
    }

    #[test]
    fn none_and_blank_entries() {
        assert_eq!("off".parse::<OrNone<Size>>().unwrap(), OrNone(None));
        assert_eq!("NONE".parse::<OrNone<Size>>().unwrap(), OrNone(None));
        assert_eq!(
            "2KiB".parse::<OrNone<Size>>().unwrap(),
            OrNone(Some(Size(2048)))
        );
        assert_eq!(" ".parse::<Item<Size>>().unwrap(), Item(None));
        assert_eq!(
            items(Some(vec![Item(Some(1)), Item(None), Item(Some(2))])),
            [1, 2]
        );
    }

    #[test]
    fn pairs_and_specs() {
        let w: TierWeight = " CPU = 0.5 ".parse().unwrap();
        assert_eq!((w.tier, w.weight), (1, 0.5));
        assert!("gpu"
            .parse::<TierWeight>()
            .unwrap_err()
            .contains("TIER=WEIGHT"));
        assert!("=1".parse::<TierWeight>().is_err());
        let m: ModelKeyMode = "org/b=engine:xxhash:42".parse().unwrap();
        assert_eq!(
            m.mode,
            KeyModeSpec::Engine {
                algo: Some(HashAlgo::Xxhash),
                seed: Some("42".into())
            }
        );
        assert!("m=token:x".parse::<ModelKeyMode>().is_err());
        assert!("m=engine:sha1".parse::<ModelKeyMode>().is_err());
    }

    #[test]
    fn networks_take_bare_addresses_as_hosts() {
        let n: Network = "10.1.2.3".parse().unwrap();
        assert_eq!(n.0, "10.1.2.3/32".parse::<IpNet>().unwrap());
        let n: Network = "fd00::1".parse().unwrap();
        assert_eq!(n.0.prefix_len(), 128);
        let n: Network = "10.0.0.0/8".parse().unwrap();
        assert!(n.0.contains(&"10.9.9.9".parse::<IpAddr>().unwrap()));
        assert!("10.0.0.0/33".parse::<Network>().is_err());
    }

    #[test]
    fn enums_name_their_values() {
        assert_eq!("json".parse::<LogFormat>().unwrap(), LogFormat::Json);
        assert_eq!("xml".parse::<LogFormat>().unwrap_err(), "want text or json");
    }
}
