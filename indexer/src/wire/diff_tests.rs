//! `decode_batch` (fast path plus fallback) against `decode_batch_reference`
//! (serde only) on every input: vLLM-shaped batches in each release's form,
//! events of arbitrary field types and key orders, random mutations of both,
//! and the recorded vLLM streams. Results must be identical, errors
//! included; vLLM's own shapes must never need the fallback.

use std::path::PathBuf;

use base64::Engine;
use proptest::collection::vec;
use proptest::prelude::*;

use super::fast::{self, FALLBACKS};
use super::vllm_encode::{encode_batch, Event, Form, Hash, Key, Stored};
use super::{decode_batch, decode_batch_reference};

/// Both decoders' answers, compared as their `Debug` text so that NaN
/// timestamps and float keys compare equal to themselves (and -0.0 does not
/// equal 0.0).
fn assert_same(payload: &[u8]) {
    let fast = format!("{:?}", decode_batch(payload));
    let reference = format!("{:?}", decode_batch_reference(payload));
    assert_eq!(fast, reference, "payload {payload:02x?}");
}

/// How many events of `payload` went to the reference decoder, or `None`
/// when the fast path gave up on the payload as a whole.
fn fallbacks(payload: &[u8]) -> Option<usize> {
    FALLBACKS.with(|n| n.set(0));
    fast::decode_batch(payload)?;
    Some(FALLBACKS.with(|n| n.get()))
}

// ---- vLLM-shaped batches, through the same encoder the bench uses ----

fn hash() -> impl Strategy<Value = Hash> {
    prop_oneof![
        4 => any::<u64>().prop_map(Hash::Int),
        // Small values take the short int markers.
        1 => (0u64..70_000).prop_map(Hash::Int),
        2 => vec(any::<u8>(), 32).prop_map(Hash::Bytes),
        1 => vec(any::<u8>(), 1..40).prop_map(Hash::Bytes),
    ]
}

fn token() -> impl Strategy<Value = u32> {
    prop_oneof![
        6 => 0u32..152_000,
        1 => 0u32..256,
        1 => any::<u32>(),
    ]
}

fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("GPU".to_string()),
        Just("CPU".to_string()),
        Just("full_attention".to_string()),
        "[a-z-]{0,12}",
        // Long enough for str8 / str16 headers.
        "[a-zA-Z0-9 é]{30,40}",
        "x{300}",
    ]
}

fn key() -> impl Strategy<Value = Key> {
    prop_oneof![name().prop_map(Key::Str), any::<i64>().prop_map(Key::Int)]
}

fn stored() -> impl Strategy<Value = Event> {
    (
        (
            vec(hash(), 0..24),
            proptest::option::of(hash()),
            vec(token(), 0..400),
            0u32..300,
            proptest::option::of(any::<i64>()),
        ),
        (
            proptest::option::of(name()),
            proptest::option::of(name()),
            proptest::option::of(vec(proptest::option::of(vec(key(), 0..3)), 0..24)),
            any::<u32>(),
            name(),
        ),
    )
        .prop_map(
            |(
                (hashes, parent, tokens, block_size, lora_id),
                (medium, lora_name, extra_keys, group_idx, kind),
            )| {
                Event::Stored(Stored {
                    hashes,
                    parent,
                    tokens,
                    block_size,
                    lora_id,
                    medium,
                    lora_name,
                    extra_keys,
                    group_idx,
                    kind,
                })
            },
        )
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        4 => stored(),
        3 => (vec(hash(), 0..8), proptest::option::of(name()), any::<u32>()).prop_map(
            |(hashes, medium, group_idx)| Event::Removed {
                hashes,
                medium,
                group_idx,
            }
        ),
        1 => Just(Event::Cleared),
    ]
}

fn form() -> impl Strategy<Value = Form> {
    prop_oneof![
        Just(Form::Map),
        Just(Form::ArrayV023),
        Just(Form::ArrayV011)
    ]
}

/// One batch as a publisher of one release writes it.
fn vllm_batch() -> impl Strategy<Value = Vec<u8>> {
    (
        any::<f64>(),
        vec(event(), 0..6),
        form(),
        proptest::option::of(any::<u32>()),
    )
        .prop_map(|(ts, events, form, rank)| encode_batch(ts, &events, form, rank))
}

// ---- events of arbitrary shape: every field, any type, any encoding ----

/// An int in one of the encodings that can hold it (msgpack allows
/// non-minimal ones, and serde treats signed and unsigned markers apart).
fn int_bytes(v: i128, pick: u8) -> Vec<u8> {
    let mut forms: Vec<Vec<u8>> = Vec::new();
    if (0..=0x7f).contains(&v) {
        forms.push(vec![v as u8]);
    }
    if (-32..0).contains(&v) {
        forms.push(vec![v as i8 as u8]);
    }
    let mut push = |marker: u8, bytes: &[u8]| {
        let mut f = vec![marker];
        f.extend_from_slice(bytes);
        forms.push(f);
    };
    if let Ok(x) = u8::try_from(v) {
        push(0xcc, &x.to_be_bytes());
    }
    if let Ok(x) = u16::try_from(v) {
        push(0xcd, &x.to_be_bytes());
    }
    if let Ok(x) = u32::try_from(v) {
        push(0xce, &x.to_be_bytes());
    }
    if let Ok(x) = u64::try_from(v) {
        push(0xcf, &x.to_be_bytes());
    }
    if let Ok(x) = i8::try_from(v) {
        push(0xd0, &x.to_be_bytes());
    }
    if let Ok(x) = i16::try_from(v) {
        push(0xd1, &x.to_be_bytes());
    }
    if let Ok(x) = i32::try_from(v) {
        push(0xd2, &x.to_be_bytes());
    }
    if let Ok(x) = i64::try_from(v) {
        push(0xd3, &x.to_be_bytes());
    }
    forms.swap_remove(usize::from(pick) % forms.len())
}

fn int() -> impl Strategy<Value = Vec<u8>> {
    (
        prop_oneof![
            any::<i64>().prop_map(i128::from),
            any::<u64>().prop_map(i128::from),
            (-40i128..300),
            (0i128..200_000),
            Just(i128::from(u32::MAX) + 1),
        ],
        any::<u8>(),
    )
        .prop_map(|(v, pick)| int_bytes(v, pick))
}

/// Mostly a `u32`, in any encoding that holds it; sometimes any int.
fn u32_int() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        8 => (
            prop_oneof![0i128..300, 0i128..200_000, 0..=i128::from(u32::MAX)],
            any::<u8>()
        )
            .prop_map(|(v, pick)| int_bytes(v, pick)),
        1 => int(),
    ]
}

fn with_len(small: u8, markers: [u8; 3], len: usize, pick: u8) -> Vec<u8> {
    let mut out = Vec::new();
    match pick % 4 {
        0 if len < 32 && small != 0 => out.push(small | len as u8),
        0 | 1 if len < 256 => out.extend([markers[0], len as u8]),
        0..=2 if len < 65_536 => {
            out.push(markers[1]);
            out.extend((len as u16).to_be_bytes());
        }
        _ => {
            out.push(markers[2]);
            out.extend((len as u32).to_be_bytes());
        }
    }
    out
}

fn str_bytes(s: &[u8], pick: u8) -> Vec<u8> {
    let mut out = with_len(0xa0, [0xd9, 0xda, 0xdb], s.len(), pick);
    out.extend_from_slice(s);
    out
}

fn bin_bytes(b: &[u8], pick: u8) -> Vec<u8> {
    let mut out = with_len(0, [0xc4, 0xc5, 0xc6], b.len(), pick);
    out.extend_from_slice(b);
    out
}

fn array_bytes(items: &[Vec<u8>], pick: u8) -> Vec<u8> {
    let mut out = if items.len() < 16 && pick.is_multiple_of(3) {
        vec![0x90 | items.len() as u8]
    } else if pick % 3 == 1 {
        let mut h = vec![0xdc];
        h.extend((items.len() as u16).to_be_bytes());
        h
    } else {
        let mut h = vec![0xdd];
        h.extend((items.len() as u32).to_be_bytes());
        h
    };
    out.extend(items.iter().flatten());
    out
}

fn map_bytes(entries: &[(Vec<u8>, Vec<u8>)], pick: u8) -> Vec<u8> {
    let mut out = if entries.len() < 16 && pick % 3 != 2 {
        vec![0x80 | entries.len() as u8]
    } else if pick.is_multiple_of(2) {
        let mut h = vec![0xde];
        h.extend((entries.len() as u16).to_be_bytes());
        h
    } else {
        let mut h = vec![0xdf];
        h.extend((entries.len() as u32).to_be_bytes());
        h
    };
    for (k, v) in entries {
        out.extend(k);
        out.extend(v);
    }
    out
}

/// The field names the decoder knows, ignores or has never seen.
const NAMES: &[&str] = &[
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "locality",
    "kv_cache_spec_sliding_window",
    "ownership",
    "block_mm_infos",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "GPU",
    "new_field",
];

fn text() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => proptest::sample::select(NAMES).prop_map(|s| s.as_bytes().to_vec()),
        1 => "[a-z_]{0,8}".prop_map(String::into_bytes),
        // Not UTF-8.
        1 => vec(any::<u8>(), 0..6).prop_map(|mut b| {
            b.push(0xff);
            b
        }),
    ]
}

fn scalar() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        2 => Just(vec![0xc0]),
        1 => any::<bool>().prop_map(|b| vec![0xc2 | u8::from(b)]),
        4 => int(),
        1 => any::<f32>().prop_map(|f| {
            let mut v = vec![0xca];
            v.extend(f.to_bits().to_be_bytes());
            v
        }),
        1 => any::<f64>().prop_map(|f| {
            let mut v = vec![0xcb];
            v.extend(f.to_bits().to_be_bytes());
            v
        }),
        3 => (text(), any::<u8>()).prop_map(|(s, p)| str_bytes(&s, p)),
        2 => (vec(any::<u8>(), 0..40), any::<u8>()).prop_map(|(b, p)| bin_bytes(&b, p)),
        1 => (any::<u8>(), vec(any::<u8>(), 0..3)).prop_map(|(tag, b)| {
            // fixext1 or ext8.
            if b.len() == 1 {
                vec![0xd4, tag, b[0]]
            } else {
                let mut v = vec![0xc7, b.len() as u8, tag];
                v.extend(b);
                v
            }
        }),
    ]
}

/// The scalars an `ExtraKey` can hold.
fn key_scalar() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(vec![0xc0]),
        any::<bool>().prop_map(|b| vec![0xc2 | u8::from(b)]),
        int(),
        any::<f32>().prop_map(|f| {
            let mut v = vec![0xca];
            v.extend(f.to_bits().to_be_bytes());
            v
        }),
        any::<f64>().prop_map(|f| {
            let mut v = vec![0xcb];
            v.extend(f.to_bits().to_be_bytes());
            v
        }),
        (text(), any::<u8>()).prop_map(|(s, p)| str_bytes(&s, p)),
        (vec(any::<u8>(), 0..40), any::<u8>()).prop_map(|(b, p)| bin_bytes(&b, p)),
    ]
}

fn value() -> impl Strategy<Value = Vec<u8>> {
    scalar().prop_recursive(5, 48, 6, |inner| {
        prop_oneof![
            3 => (vec(inner.clone(), 0..6), any::<u8>()).prop_map(|(v, p)| array_bytes(&v, p)),
            1 => (vec((inner.clone(), inner), 0..4), any::<u8>())
                .prop_map(|(e, p)| map_bytes(&e, p)),
        ]
    })
}

/// A value that fits `field` most of the time, and anything otherwise.
fn field_value(field: &'static str) -> BoxedStrategy<Vec<u8>> {
    let hash = prop_oneof![
        8 => int(),
        3 => (vec(any::<u8>(), 0..36), any::<u8>()).prop_map(|(b, p)| bin_bytes(&b, p)),
        1 => (vec(0u8..=255, 0..4), any::<u8>()).prop_map(|(b, p)| {
            let items: Vec<Vec<u8>> = b.iter().map(|x| int_bytes(i128::from(*x), p)).collect();
            array_bytes(&items, p)
        }),
        1 => value(),
    ];
    let opt = |s: BoxedStrategy<Vec<u8>>| prop_oneof![1 => Just(vec![0xc0]), 3 => s].boxed();
    let string = (text(), any::<u8>())
        .prop_map(|(s, p)| str_bytes(&s, p))
        .boxed();
    let typed: BoxedStrategy<Vec<u8>> = match field {
        "type" => string,
        "block_hashes" => (vec(hash, 0..6), any::<u8>())
            .prop_map(|(v, p)| array_bytes(&v, p))
            .boxed(),
        "parent_block_hash" => opt(hash.boxed()),
        "token_ids" => (vec(u32_int(), 0..12), any::<u8>())
            .prop_map(|(v, p)| array_bytes(&v, p))
            .boxed(),
        "block_size" | "group_idx" => opt(u32_int().boxed()),
        "lora_id" => opt(int().boxed()),
        "extra_keys" => {
            // Per block: nil, a tuple of scalars (or deeper), a lone scalar.
            let entry = prop_oneof![
                2 => Just(vec![0xc0]),
                3 => (vec(prop_oneof![3 => key_scalar(), 1 => value()], 0..4), any::<u8>())
                    .prop_map(|(v, p)| array_bytes(&v, p)),
                2 => key_scalar(),
                1 => value(),
            ];
            opt((vec(entry, 0..4), any::<u8>())
                .prop_map(|(v, p)| array_bytes(&v, p))
                .boxed())
        }
        _ => opt(string),
    };
    prop_oneof![12 => typed, 1 => value()].boxed()
}

/// An event tag: one of the three, a new one, one written as bin (serde
/// takes UTF-8 bin as a string), or any value; with the slot names the
/// positional form of that type has.
fn tag() -> impl Strategy<Value = (Vec<u8>, &'static [&'static str])> {
    prop_oneof![
        6 => (
            proptest::sample::select(&["BlockStored", "BlockRemoved", "AllBlocksCleared"][..]),
            any::<u8>(),
        )
            .prop_map(|(t, p)| (str_bytes(t.as_bytes(), p), slots(t))),
        1 => (proptest::sample::select(&["BlockStored", "BlockPinned"][..]), any::<u8>())
            .prop_map(|(t, p)| (bin_bytes(t.as_bytes(), p), slots(t))),
        1 => value().prop_map(|v| (v, STORED_SLOTS)),
    ]
}

fn slots(tag: &str) -> &'static [&'static str] {
    match tag {
        "BlockRemoved" => &["block_hashes", "medium", "group_idx"],
        "AllBlocksCleared" => &[],
        _ => STORED_SLOTS,
    }
}

/// The fields of the stored event's positional form, in order.
const STORED_SLOTS: &[&str] = &[
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
];

fn odd_event() -> impl Strategy<Value = Vec<u8>> {
    // Every field the decoder reads, typed (mostly), as a base half the time,
    // so that whole events often survive for the fast path to decide.
    let all_fields: Vec<_> = STORED_SLOTS
        .iter()
        .chain(&["locality"])
        .map(|k| (Just(*k), field_value(k), any::<u8>()))
        .collect();
    let map_event = (
        proptest::option::of(all_fields),
        vec(
            proptest::sample::select(NAMES)
                .prop_flat_map(|k| (Just(k), field_value(k), any::<u8>())),
            0..5,
        ),
        tag().prop_map(|(t, _)| t),
        0usize..16,
        any::<u8>(),
        // Sometimes a key that is bin or not a string at all.
        proptest::option::of((
            prop_oneof![
                (text(), any::<u8>()).prop_map(|(s, p)| bin_bytes(&s, p)),
                int()
            ],
            value(),
        )),
    )
        .prop_map(|(base, fields, tag, at, pick, odd)| {
            let mut entries: Vec<(Vec<u8>, Vec<u8>)> = base
                .into_iter()
                .flatten()
                .chain(fields)
                .map(|(k, v, p)| (str_bytes(k.as_bytes(), p), v))
                .collect();
            entries.insert(at.min(entries.len()), (str_bytes(b"type", pick), tag));
            if let Some(kv) = odd.filter(|_| pick % 4 == 0) {
                entries.insert(usize::from(pick) % entries.len(), kv);
            }
            map_bytes(&entries, pick)
        });
    let array_event = (tag(), prop_oneof![0usize..14, 8usize..14], any::<u8>())
        .prop_flat_map(|((tag, names), n, pick)| {
            // Each slot typed for its place most of the time.
            let slots: Vec<BoxedStrategy<Vec<u8>>> = (0..n)
                .map(|i| field_value(names.get(i).copied().unwrap_or("new_field")))
                .collect();
            (Just(tag), slots, Just(pick))
        })
        .prop_map(|(tag, slots, pick)| {
            let mut items = vec![tag];
            items.extend(slots);
            array_bytes(&items, pick)
        });
    prop_oneof![3 => map_event, 2 => array_event, 1 => value()]
}

fn odd_batch() -> impl Strategy<Value = Vec<u8>> {
    (
        prop_oneof![
            4 => any::<f64>().prop_map(|f| {
                let mut v = vec![0xcb];
                v.extend(f.to_bits().to_be_bytes());
                v
            }),
            2 => int(),
            1 => value(),
        ],
        vec(odd_event(), 0..5),
        prop_oneof![
            Just(None),
            Just(Some(vec![0xc0])),
            int().prop_map(Some),
            value().prop_map(Some)
        ],
        vec(value(), 0..2),
        any::<u8>(),
    )
        .prop_map(|(ts, events, rank, extra, pick)| {
            let mut outer = vec![ts, array_bytes(&events, pick)];
            if let Some(rank) = rank {
                outer.push(rank);
                outer.extend(extra);
            }
            array_bytes(&outer, pick / 3)
        })
}

// ---- mutations: what a hostile or broken peer sends ----

#[derive(Clone, Debug)]
enum Mutation {
    Truncate(usize),
    Set(usize, u8),
    Insert(usize, Vec<u8>),
    Remove(usize, usize),
    /// Replaces a byte by a length-like header claiming far too much.
    Lie(usize, u8),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
        (any::<usize>(), vec(any::<u8>(), 1..6)).prop_map(|(i, b)| Mutation::Insert(i, b)),
        (any::<usize>(), 1usize..8).prop_map(|(i, n)| Mutation::Remove(i, n)),
        (
            any::<usize>(),
            proptest::sample::select(&[0xdc, 0xdd, 0xde, 0xdf, 0xc6, 0xdb][..])
        )
            .prop_map(|(i, m)| Mutation::Lie(i, m)),
    ]
}

fn mutate(mut p: Vec<u8>, m: &Mutation) -> Vec<u8> {
    if p.is_empty() {
        return p;
    }
    match m {
        Mutation::Truncate(i) => p.truncate(i % p.len()),
        Mutation::Set(i, b) => {
            let n = p.len();
            p[i % n] = *b;
        }
        Mutation::Insert(i, b) => {
            let at = i % (p.len() + 1);
            p.splice(at..at, b.iter().copied());
        }
        Mutation::Remove(i, n) => {
            let at = i % p.len();
            let end = (at + n).min(p.len());
            p.drain(at..end);
        }
        Mutation::Lie(i, marker) => {
            let at = i % p.len();
            p.splice(at..(at + 1), [*marker, 0xff, 0xff, 0xff, 0xf0]);
        }
    }
    p
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    /// vLLM's shapes: identical results, and never a fallback.
    #[test]
    fn vllm_batches_decode_identically_without_fallback(payload in vllm_batch()) {
        assert_same(&payload);
        prop_assert_eq!(fallbacks(&payload), Some(0));
    }

    #[test]
    fn mutated_vllm_batches_decode_identically(
        payload in vllm_batch(),
        mutations in vec(mutation(), 1..4),
    ) {
        assert_same_at_each_mutation(payload, &mutations);
    }

    /// Any field of any type in any order, ints in every encoding, odd keys,
    /// odd tags, odd outer parts.
    #[test]
    fn arbitrary_events_decode_identically(payload in odd_batch()) {
        assert_same(&payload);
    }

    #[test]
    fn mutated_arbitrary_events_decode_identically(
        payload in odd_batch(),
        mutations in vec(mutation(), 1..4),
    ) {
        assert_same_at_each_mutation(payload, &mutations);
    }
}

/// Applies `mutations` in turn, both decoders compared after each.
fn assert_same_at_each_mutation(mut payload: Vec<u8>, mutations: &[Mutation]) {
    for m in mutations {
        payload = mutate(payload, m);
        assert_same(&payload);
    }
}

/// The shapes ingest sees most, at full size: a 2,048-block, 32K-token
/// prefill in each form and hash kind.
#[test]
fn full_size_prefills_decode_identically_without_fallback() {
    let mut x = 7u64;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for bytes in [false, true] {
        for form in [Form::Map, Form::ArrayV023, Form::ArrayV011] {
            let mut hash = || {
                if bytes {
                    Hash::Bytes((0..4).flat_map(|_| rnd().to_be_bytes()).collect())
                } else {
                    Hash::Int(rnd())
                }
            };
            let stored = Stored {
                hashes: (0..2048).map(|_| hash()).collect(),
                parent: Some(hash()),
                tokens: (0..32_768).map(|i| (i * 7919) % 151_000).collect(),
                block_size: 16,
                lora_id: Some(3),
                medium: Some("GPU".into()),
                lora_name: Some("chat-lora".into()),
                extra_keys: Some(vec![Some(vec![Key::Str("chat-lora".into())]); 2048]),
                group_idx: 0,
                kind: "full_attention".into(),
            };
            let payload = encode_batch(1.0, &[Event::Stored(stored)], form, Some(0));
            assert_same(&payload);
            assert_eq!(fallbacks(&payload), Some(0));
            let batch = decode_batch(&payload).unwrap();
            assert_eq!(batch.events.len(), 1);
            // Every truncation is the reference's error.
            for cut in (0..payload.len()).step_by(997) {
                assert_same(&payload[..cut]);
            }
        }
    }
}

/// Every recorded vLLM stream, in all three forms: identical, all fast.
#[test]
fn recorded_vllm_streams_decode_identically_without_fallback() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/vllm-events");
    let mut payloads = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if !path.to_string_lossy().ends_with(".frames.jsonl") {
            continue;
        }
        for line in std::fs::read_to_string(&path).unwrap().lines() {
            let frame: serde_json::Value = serde_json::from_str(line).unwrap();
            let payload = base64::engine::general_purpose::STANDARD
                .decode(frame["payload_b64"].as_str().unwrap())
                .unwrap();
            assert_same(&payload);
            assert_eq!(fallbacks(&payload), Some(0), "{}", path.display());
            // And a few mutations of each.
            for i in 0..4usize {
                let m = match i {
                    0 => Mutation::Truncate(payload.len() / 2 + line.len()),
                    1 => Mutation::Set(line.len() * 31, 0xc1),
                    2 => Mutation::Lie(line.len() * 7, 0xdd),
                    _ => Mutation::Insert(line.len() * 13, vec![0xc0]),
                };
                assert_same(&mutate(payload.clone(), &m));
            }
            payloads += 1;
        }
    }
    assert!(payloads > 2000, "only {payloads} payloads found");
}

/// Hand-picked edges the generators reach only by luck.
#[test]
fn edge_cases_decode_identically() {
    let cases: &[&[u8]] = &[
        &[],
        &[0x92, 0x00, 0x90],
        &[0x93, 0x00, 0x90, 0xc0],
        &[0x94, 0x00, 0x90, 0x00, 0xc1],
        &[0x94, 0x00, 0x90, 0x00, 0x90],
        &[0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x90],
        // Map event without "type"; with a bin key; with an int key.
        &[0x92, 0x00, 0x91, 0x81, 0xa1, b'x', 0x00],
        &[
            0x92, 0x00, 0x91, 0x81, 0xc4, 4, b't', b'y', b'p', b'e', 0xa1, b'x',
        ],
        &[0x92, 0x00, 0x91, 0x81, 0x01, 0x00],
        // Array event: empty; tag only; tag and a nil where hashes belong.
        &[0x92, 0x00, 0x91, 0x90],
        &[
            0x92, 0x00, 0x91, 0x91, 0xab, b'B', b'l', b'o', b'c', b'k', b'S', b't', b'o', b'r',
            b'e', b'd',
        ],
        &[
            0x92, 0x00, 0x91, 0x92, 0xab, b'B', b'l', b'o', b'c', b'k', b'S', b't', b'o', b'r',
            b'e', b'd', 0xc0,
        ],
        // A hash of one byte; an empty hash.
        &[
            0x92, 0x00, 0x91, 0x92, 0xac, b'B', b'l', b'o', b'c', b'k', b'R', b'e', b'm', b'o',
            b'v', b'e', b'd', 0x91, 0xc4, 1, 9,
        ],
        &[
            0x92, 0x00, 0x91, 0x92, 0xac, b'B', b'l', b'o', b'c', b'k', b'R', b'e', b'm', b'o',
            b'v', b'e', b'd', 0x91, 0xc4, 0,
        ],
    ];
    for case in cases {
        assert_same(case);
    }
    // The existing hostile inputs: nesting far past the limit, huge claims.
    let mut deep = vec![0x92, 0x00, 0x91, 0x82, 0xa4, b't', b'y', b'p', b'e', 0xab];
    deep.extend_from_slice(b"BlockStored");
    deep.extend_from_slice(&[0xaa]);
    deep.extend_from_slice(b"extra_keys");
    for depth in [1, 13, 14, 15, 16, 17, 30, 60_000] {
        let mut p = deep.clone();
        p.extend(std::iter::repeat_n(0x91, depth));
        p.push(0xc0);
        assert_same(&p);
        // The same depth inside an ignored field and a trailing slot.
        let mut q = vec![0x92, 0x00, 0x91, 0x82, 0xa4, b't', b'y', b'p', b'e', 0xb0];
        q.extend_from_slice(b"AllBlocksCleared");
        q.extend_from_slice(&[0xa9]);
        q.extend_from_slice(b"ownership");
        q.extend(std::iter::repeat_n(0x91, depth));
        q.push(0xc0);
        assert_same(&q);
    }
}
