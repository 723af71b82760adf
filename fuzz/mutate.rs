//! Mutators: structure-aware ones for each file format (JSON values, TOML keys and values,
//! ONNX protobuf fields, safetensors and npy headers, npz members, token files), the byte
//! mutations of libFuzzer beneath them, and mutations of a case's set of files. Which one a
//! file gets is decided by its name.

use std::collections::BTreeSet;

use prost::Message;
use smp_partition::frontend::onnx::proto::{self, ModelProto, NodeProto, TensorProto};
use smp_partition::ir::OpKind;

use crate::case::Case;

/// A small fast generator (xorshift64*), seeded per worker.
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed` (any value).
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    /// 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 { 0 } else { (self.next() % n as u64) as usize }
    }
    /// True with probability `1/n`.
    pub fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }
    /// One element of `xs`.
    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> Option<&'a T> {
        xs.get(self.below(xs.len()))
    }
}

/// Integers that break size arithmetic: bounds of every width, powers of two and their
/// neighbours, small values, and negatives.
const INTERESTING: &[i64] = &[
    0, 1, -1, 2, -2, 3, 4, 7, 8, 15, 16, 17, 31, 32, 63, 64, 65, 100, 127, 128, -128, 255, 256, 1000,
    1023, 1024, 4095, 4096, 32767, 32768, -32768, 65535, 65536, i32::MAX as i64, i32::MIN as i64,
    u32::MAX as i64, 1 << 32, 1 << 40, (1 << 47) - 1, 1 << 48, 1 << 53, 1 << 62, i64::MAX, i64::MAX - 1,
    i64::MIN, i64::MIN + 1,
];

/// One interesting integer, or the given one nudged.
pub fn interesting(rng: &mut Rng, near: i64) -> i64 {
    match rng.below(4) {
        0 => near.wrapping_add(rng.below(5) as i64 - 2),
        1 => near.wrapping_neg(),
        2 => near.wrapping_mul(2),
        _ => *rng.pick(INTERESTING).unwrap_or(&0),
    }
}

fn interesting_f64(rng: &mut Rng, near: f64) -> f64 {
    *rng.pick(&[0.0, -0.0, 1.0, -1.0, 0.5, 1e-300, -1e-300, 1e300, -1e300, f64::MAX, f64::MIN_POSITIVE, near * 2.0, -near, near + 1.0, 1e19, 1.8446744073709552e19])
        .unwrap_or(&0.0)
}

/// Strings every format gets as dictionary entries: paths that leave a directory or name a
/// device, empty and long names, odd characters.
const STRINGS: &[&str] = &[
    "", " ", "0", "-1", "../x", "../../etc/passwd", "/etc/passwd", "/dev/zero", "/proc/self/maps", "/", ".", "a/b", "NaN",
    "inf", "null", "true", "\u{0}", "é", "\u{202e}", "%s%n", "*", "**", "[", "{", "\\", "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
];

/// What the mutators draw names from: the target's dictionary and strings seen in its corpus.
#[derive(Default)]
pub struct Dict {
    /// Words (keys, enum values, op types, file names).
    pub words: Vec<String>,
}

impl Dict {
    /// Adds words, keeping them unique.
    pub fn extend(&mut self, words: impl IntoIterator<Item = String>) {
        let mut set: BTreeSet<String> = self.words.drain(..).collect();
        set.extend(words.into_iter().filter(|w| w.len() <= 64));
        self.words = set.into_iter().collect();
    }
    fn word(&self, rng: &mut Rng) -> String {
        if self.words.is_empty() || rng.one_in(4) {
            return rng.pick(STRINGS).copied().unwrap_or("").to_string();
        }
        rng.pick(&self.words).cloned().unwrap_or_default()
    }
}

/// Words of a file, harvested for the dictionary: JSON keys and strings, TOML keys, ONNX
/// op types, attribute and value names.
pub fn harvest(name: &str, bytes: &[u8]) -> Vec<String> {
    let mut out = Vec::new();
    if name.ends_with(".json") {
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(bytes) {
            json_words(&v, &mut out);
        }
    } else if name.ends_with(".toml") {
        if let Ok(t) = std::str::from_utf8(bytes).map_err(|_| ()).and_then(|s| s.parse::<toml::Table>().map_err(|_| ())) {
            toml_words(&toml::Value::Table(t), &mut out);
        }
    } else if name.ends_with(".onnx") {
        if let Ok(m) = ModelProto::decode(bytes) {
            for n in m.graph.iter().flat_map(|g| &g.node) {
                out.extend(n.op_type.clone());
                out.extend(n.attribute.iter().filter_map(|a| a.name.clone()));
            }
        }
    }
    out.truncate(4096);
    out
}

fn json_words(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::String(s) => out.push(s.clone()),
        serde_json::Value::Array(a) => a.iter().for_each(|x| json_words(x, out)),
        serde_json::Value::Object(o) => {
            for (k, x) in o {
                out.push(k.clone());
                json_words(x, out);
            }
        }
        _ => {}
    }
}

fn toml_words(v: &toml::Value, out: &mut Vec<String>) {
    match v {
        toml::Value::String(s) => out.push(s.clone()),
        toml::Value::Array(a) => a.iter().for_each(|x| toml_words(x, out)),
        toml::Value::Table(t) => {
            for (k, x) in t {
                out.push(k.clone());
                toml_words(x, out);
            }
        }
        _ => {}
    }
}

/// Mutates `case` in place with 1–4 stacked mutations; `other` (another corpus case) feeds
/// splices.
pub fn mutate_case(rng: &mut Rng, case: &mut Case, other: &Case, dict: &Dict) {
    let rounds = 1 + rng.below(4).min(rng.below(4));
    for _ in 0..rounds {
        if case.files.is_empty() || rng.one_in(25) {
            mutate_files(rng, case, other, dict);
            continue;
        }
        let i = rng.below(case.files.len());
        let (name, bytes) = &mut case.files[i];
        let out = mutate_file(rng, name, bytes, other.get(name), dict);
        *bytes = out.into();
    }
}

/// Adds, drops, renames or copies a file of the case.
fn mutate_files(rng: &mut Rng, case: &mut Case, other: &Case, dict: &Dict) {
    match rng.below(4) {
        0 if !case.files.is_empty() => {
            let i = rng.below(case.files.len());
            case.files.remove(i);
        }
        1 if !case.files.is_empty() => {
            let i = rng.below(case.files.len());
            let name = dict.word(rng);
            if !name.is_empty() && !name.contains("..") && !name.starts_with('/') && !name.contains('\n') {
                case.files[i].0 = name.trim_matches('/').to_string();
                if case.files[i].0.is_empty() || case.files[i].0.split('/').any(|p| p.is_empty() || p == ".") {
                    case.files[i].0 = format!("f{i}");
                }
            }
        }
        2 => {
            if let Some(f) = rng.pick(&other.files) {
                let f = f.clone();
                match case.files.iter_mut().find(|(n, _)| *n == f.0) {
                    Some(mine) => *mine = f,
                    None => case.files.push(f),
                }
            }
        }
        _ => {
            if let Some(f) = rng.pick(&case.files) {
                let mut f = f.clone();
                f.0 = format!("copy{}-{}", rng.below(4), f.0.rsplit('/').next().unwrap_or("f"));
                case.files.push(f);
            }
        }
    }
}

/// One mutation of a file, chosen by its name.
pub fn mutate_file(rng: &mut Rng, name: &str, bytes: &[u8], twin: Option<&[u8]>, dict: &Dict) -> Vec<u8> {
    let structured = if rng.one_in(6) {
        None
    } else if name.ends_with(".json") {
        mutate_json(rng, bytes, twin, dict)
    } else if name.ends_with(".toml") {
        mutate_toml(rng, bytes, dict)
    } else if name.ends_with(".onnx") {
        mutate_onnx(rng, bytes, dict)
    } else if name.ends_with(".safetensors") {
        mutate_safetensors(rng, bytes, dict)
    } else if name.ends_with(".npy") {
        mutate_npy(rng, bytes)
    } else if name.ends_with(".npz") {
        mutate_npz(rng, bytes)
    } else if name.ends_with(".bin") {
        Some(mutate_tokens(rng, bytes))
    } else {
        None
    };
    structured.unwrap_or_else(|| mutate_bytes(rng, bytes, twin, dict))
}

/// libFuzzer's byte mutations: bit flips, random and interesting bytes and integers, insert,
/// erase, copy, dictionary words, splices with `twin`.
pub fn mutate_bytes(rng: &mut Rng, bytes: &[u8], twin: Option<&[u8]>, dict: &Dict) -> Vec<u8> {
    let mut b = bytes.to_vec();
    let len = b.len();
    match rng.below(10) {
        0 if len > 0 => {
            let i = rng.below(len);
            b[i] ^= 1 << rng.below(8);
        }
        1 if len > 0 => {
            let i = rng.below(len);
            b[i] = rng.next() as u8;
        }
        2 if len > 0 => {
            // an interesting integer of 1, 2, 4 or 8 bytes, either endianness
            let width = 1 << rng.below(4);
            let v = interesting(rng, 0).to_le_bytes();
            let at = rng.below(len);
            let end = (at + width).min(len);
            let big = rng.one_in(2);
            for (k, slot) in b[at..end].iter_mut().enumerate() {
                *slot = if big { v[width - 1 - k] } else { v[k] };
            }
        }
        3 => {
            let at = rng.below(len + 1);
            let n = 1 + rng.below(16);
            let fill: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
            b.splice(at..at, fill);
        }
        4 if len > 0 => {
            let at = rng.below(len);
            let n = 1 + rng.below((len - at).min(64));
            b.drain(at..at + n);
        }
        5 if len > 1 => {
            let from = rng.below(len);
            let n = 1 + rng.below((len - from).min(64));
            let chunk = b[from..from + n].to_vec();
            let to = rng.below(len + 1);
            b.splice(to..to, chunk);
        }
        6 => {
            let word = dict.word(rng).into_bytes();
            let at = rng.below(len + 1);
            if rng.one_in(2) {
                b.splice(at..at, word);
            } else {
                let end = (at + word.len()).min(len);
                b.splice(at..end, word);
            }
        }
        7 if len > 0 => {
            // cut short, as a partly written file is
            b.truncate(rng.below(len));
        }
        8 => {
            if let Some(t) = twin.filter(|t| !t.is_empty()) {
                let cut = rng.below(len + 1);
                let from = rng.below(t.len());
                b.truncate(cut);
                b.extend_from_slice(&t[from..]);
            }
        }
        _ => {
            // a run of one byte, as a mangled number or padding
            let at = rng.below(len + 1);
            let n = 1 + rng.below(32);
            let byte = *rng.pick(b"09 -.\xff\x00\"}]eE").unwrap_or(&b'9');
            b.splice(at..at, std::iter::repeat_n(byte, n));
        }
    }
    b
}

// ---- JSON ----------------------------------------------------------------------------------

/// A path to a node of a JSON value.
type JPath = Vec<JStep>;

#[derive(Clone)]
enum JStep {
    Key(String),
    Index(usize),
}

/// Nodes of a JSON value (itself included).
fn json_count(v: &serde_json::Value) -> usize {
    1 + match v {
        serde_json::Value::Array(a) => a.iter().map(json_count).sum(),
        serde_json::Value::Object(o) => o.values().map(json_count).sum(),
        _ => 0,
    }
}

/// The `k`-th node in pre-order (counting down `k`), with its path.
fn json_nth<'a>(v: &'a mut serde_json::Value, k: &mut usize, path: &mut JPath) -> Option<&'a mut serde_json::Value> {
    if *k == 0 {
        return Some(v);
    }
    *k -= 1;
    match v {
        serde_json::Value::Array(a) => {
            for (i, x) in a.iter_mut().enumerate() {
                let n = json_count(x);
                if *k < n {
                    path.push(JStep::Index(i));
                    return json_nth(x, k, path);
                }
                *k -= n;
            }
            None
        }
        serde_json::Value::Object(o) => {
            for (key, x) in o.iter_mut() {
                let n = json_count(x);
                if *k < n {
                    path.push(JStep::Key(key.clone()));
                    return json_nth(x, k, path);
                }
                *k -= n;
            }
            None
        }
        _ => None,
    }
}

fn json_get<'a>(v: &'a serde_json::Value, path: &[JStep]) -> Option<&'a serde_json::Value> {
    let mut cur = v;
    for s in path {
        cur = match (s, cur) {
            (JStep::Key(k), serde_json::Value::Object(o)) => o.get(k)?,
            (JStep::Index(i), serde_json::Value::Array(a)) => a.get(*i)?,
            _ => return None,
        };
    }
    Some(cur)
}

fn json_number(rng: &mut Rng, near: &serde_json::Number) -> serde_json::Value {
    if rng.one_in(4) {
        let f = interesting_f64(rng, near.as_f64().unwrap_or(1.0));
        return serde_json::Number::from_f64(f).map(serde_json::Value::Number).unwrap_or(serde_json::Value::Null);
    }
    if rng.one_in(6) {
        return serde_json::Value::from(u64::MAX - rng.below(2) as u64);
    }
    serde_json::Value::from(interesting(rng, near.as_i64().unwrap_or(near.as_f64().unwrap_or(0.0) as i64)))
}

fn json_scalar(rng: &mut Rng, dict: &Dict) -> serde_json::Value {
    match rng.below(6) {
        0 => serde_json::Value::Null,
        1 => serde_json::Value::Bool(rng.one_in(2)),
        2 => serde_json::Value::from(interesting(rng, 1)),
        3 => serde_json::Value::Array(Vec::new()),
        4 => serde_json::Value::Object(serde_json::Map::new()),
        _ => serde_json::Value::String(dict.word(rng)),
    }
}

/// A structural mutation of a JSON document: one node changed, dropped, duplicated, retyped or
/// replaced by the node at the same place in `twin`.
fn mutate_json(rng: &mut Rng, bytes: &[u8], twin: Option<&[u8]>, dict: &Dict) -> Option<Vec<u8>> {
    let mut v: serde_json::Value = serde_json::from_slice(bytes).ok()?;
    let mut k = rng.below(json_count(&v));
    let mut path = Vec::new();
    let node = json_nth(&mut v, &mut k, &mut path)?;
    // the node at the same place in another input, for a splice
    let twin_value: Option<serde_json::Value> = twin.filter(|_| rng.one_in(4)).and_then(|t| serde_json::from_slice(t).ok());
    let donor = twin_value.as_ref().and_then(|t| json_get(t, &path)).cloned();
    match rng.below(8) {
        0 => *node = json_scalar(rng, dict),
        1 if donor.is_some() => *node = donor.unwrap_or_default(),
        _ => match node {
            serde_json::Value::Number(n) => *node = json_number(rng, n),
            serde_json::Value::String(s) => {
                *s = match rng.below(4) {
                    0 => dict.word(rng),
                    1 => format!("{s}{}", dict.word(rng)),
                    2 => s.chars().rev().collect(),
                    _ => s.repeat(1 + rng.below((65536 / s.len().max(1)).clamp(1, 64))),
                }
            }
            serde_json::Value::Bool(b) => *b = !*b,
            serde_json::Value::Null => *node = json_scalar(rng, dict),
            serde_json::Value::Array(a) => {
                let n = a.len();
                match rng.below(5) {
                    0 if n > 0 => {
                        a.remove(rng.below(n));
                    }
                    1 if n > 0 => {
                        let x = a[rng.below(n)].clone();
                        a.insert(rng.below(n + 1), x);
                    }
                    2 if n > 1 => a.swap(rng.below(n), rng.below(n)),
                    3 => a.truncate(rng.below(n + 1)),
                    _ => a.push(json_scalar(rng, dict)),
                }
            }
            serde_json::Value::Object(o) => {
                let keys: Vec<String> = o.keys().cloned().collect();
                match rng.below(3) {
                    0 if !keys.is_empty() => {
                        o.remove(&keys[rng.below(keys.len())]);
                    }
                    1 if !keys.is_empty() => {
                        let k = &keys[rng.below(keys.len())];
                        if let Some(x) = o.remove(k) {
                            o.insert(dict.word(rng), x);
                        }
                    }
                    _ => {
                        let value = json_scalar(rng, dict);
                        o.insert(dict.word(rng), value);
                    }
                }
            }
        },
    }
    Some(if rng.one_in(2) { serde_json::to_vec_pretty(&v).ok()? } else { serde_json::to_vec(&v).ok()? })
}

// ---- TOML ----------------------------------------------------------------------------------

fn toml_mutate_value(rng: &mut Rng, v: &mut toml::Value, dict: &Dict, depth: usize) {
    match v {
        toml::Value::Table(t) if depth < 8 && !t.is_empty() && !rng.one_in(5) => {
            let keys: Vec<String> = t.keys().cloned().collect();
            let k = &keys[rng.below(keys.len())];
            match rng.below(6) {
                0 => {
                    t.remove(k);
                }
                1 => {
                    if let Some(x) = t.remove(k) {
                        t.insert(dict.word(rng), x);
                    }
                }
                2 => {
                    t.insert(dict.word(rng), toml::Value::Integer(interesting(rng, 1)));
                }
                _ => {
                    if let Some(x) = t.get_mut(k) {
                        toml_mutate_value(rng, x, dict, depth + 1);
                    }
                }
            }
        }
        toml::Value::Array(a) if depth < 8 && !a.is_empty() && !rng.one_in(4) => {
            let i = rng.below(a.len());
            match rng.below(3) {
                0 => {
                    a.remove(i);
                }
                1 => a.push(a[i].clone()),
                _ => toml_mutate_value(rng, &mut a[i], dict, depth + 1),
            }
        }
        toml::Value::Integer(n) => *n = interesting(rng, *n),
        toml::Value::Float(f) => *f = interesting_f64(rng, *f),
        toml::Value::Boolean(b) => *b = !*b,
        toml::Value::String(s) => *s = dict.word(rng),
        _ => {
            *v = match rng.below(4) {
                0 => toml::Value::Integer(interesting(rng, 1)),
                1 => toml::Value::Float(interesting_f64(rng, 1.0)),
                2 => toml::Value::String(dict.word(rng)),
                _ => toml::Value::Boolean(rng.one_in(2)),
            }
        }
    }
}

fn mutate_toml(rng: &mut Rng, bytes: &[u8], dict: &Dict) -> Option<Vec<u8>> {
    let table: toml::Table = std::str::from_utf8(bytes).ok()?.parse().ok()?;
    let mut v = toml::Value::Table(table);
    toml_mutate_value(rng, &mut v, dict, 0);
    toml::to_string(&v).ok().map(String::into_bytes)
}

// ---- ONNX ----------------------------------------------------------------------------------

/// Attribute names ops read, for adding one a node lacks.
const ATTRS: &[&str] = &[
    "axis", "axes", "keepdims", "perm", "split", "num_outputs", "to", "transA", "transB", "kernel_shape", "strides",
    "pads", "dilations", "group", "auto_pad", "ceil_mode", "allowzero", "start", "end", "epsilon", "stash_type",
    "batch_dims", "noop_with_empty_axes", "value", "value_int", "value_ints", "value_float", "fmod", "mode", "upper",
    "scale",
];

fn op_name(rng: &mut Rng, dict: &Dict) -> String {
    match rng.below(6) {
        0 => dict.word(rng),
        1 => (*rng.pick(&["Loop", "If", "Scan", "Custom", "Einsum", "NonZero", "Resize"]).unwrap_or(&"Loop")).to_string(),
        _ => rng.pick(OpKind::ALL).map(|k| k.name().to_string()).unwrap_or_default(),
    }
}

fn mutate_attribute(rng: &mut Rng, a: &mut proto::AttributeProto, dict: &Dict) {
    match rng.below(9) {
        0 => a.i = Some(interesting(rng, a.i.unwrap_or(0))),
        1 => {
            if a.ints.is_empty() || rng.one_in(3) {
                a.ints.push(interesting(rng, 0));
            } else {
                let i = rng.below(a.ints.len());
                a.ints[i] = interesting(rng, a.ints[i]);
            }
        }
        2 => a.ints.truncate(rng.below(a.ints.len() + 1)),
        3 => a.f = Some(*rng.pick(&[f32::NAN, f32::INFINITY, -1.0, 0.0, 1e30, -1e-30]).unwrap_or(&0.0)),
        4 => a.s = Some(dict.word(rng).into_bytes()),
        // the declared type and the field that holds the value disagree
        5 => a.r#type = Some(rng.below(16) as i32),
        6 => {
            if let Some(t) = a.t.as_mut() {
                mutate_tensor(rng, t, dict);
            } else {
                a.t = Some(TensorProto { dims: vec![interesting(rng, 1)], data_type: Some(7), ..Default::default() });
            }
        }
        7 => a.name = Some(rng.pick(ATTRS).copied().unwrap_or("axis").to_string()),
        _ => a.floats.push(f32::NAN),
    }
}

fn mutate_tensor(rng: &mut Rng, t: &mut TensorProto, dict: &Dict) {
    match rng.below(9) {
        0 if !t.dims.is_empty() => {
            let i = rng.below(t.dims.len());
            t.dims[i] = interesting(rng, t.dims[i]);
        }
        1 => {
            if rng.one_in(2) {
                t.dims.pop();
            } else {
                t.dims.push(interesting(rng, 1));
            }
        }
        2 => t.data_type = Some(rng.below(26) as i32),
        3 => {
            if let Some(raw) = &t.raw_data {
                let keep = rng.below(raw.len() + 1);
                t.raw_data = Some(raw.slice(..keep));
            }
        }
        4 => {
            t.raw_data = None;
            match rng.below(3) {
                0 => t.int64_data.push(interesting(rng, 0)),
                1 => t.float_data.push(f32::NAN),
                _ => t.int32_data.push(interesting(rng, 0) as i32),
            }
        }
        5 => {
            t.data_location = Some(1);
            t.raw_data = None;
            let key = *rng.pick(&["location", "offset", "length", "checksum", "basepath"]).unwrap_or(&"location");
            let value = if key == "location" { dict.word(rng) } else { interesting(rng, 64).to_string() };
            match t.external_data.iter_mut().find(|e| e.key.as_deref() == Some(key)) {
                Some(e) => e.value = Some(value),
                None => t.external_data.push(proto::StringStringEntryProto { key: Some(key.into()), value: Some(value) }),
            }
        }
        6 => t.data_location = Some(interesting(rng, 0) as i32),
        7 => {
            let key = *rng.pick(&["smp.param", "smp.module", "smp.transform", "smp.tied", "smp.gather"]).unwrap_or(&"smp.param");
            let value = match rng.below(3) {
                0 => dict.word(rng),
                1 => format!("{{\"dims\": [{}], \"rows\": [{}]}}", interesting(rng, 2), interesting(rng, 0)),
                _ => "true".to_string(),
            };
            t.metadata_props.push(proto::StringStringEntryProto { key: Some(key.into()), value: Some(value) });
        }
        _ => t.name = Some(dict.word(rng)),
    }
}

fn mutate_value_info(rng: &mut Rng, vi: &mut proto::ValueInfoProto, dict: &Dict) {
    use proto::tensor_shape_proto::{Dimension, dimension::Value as D};
    use proto::type_proto::Value as T;
    let Some(T::TensorType(t)) = vi.r#type.as_mut().and_then(|t| t.value.as_mut()) else {
        vi.r#type = None;
        return;
    };
    match rng.below(4) {
        0 => t.elem_type = Some(rng.below(26) as i32),
        1 => t.shape = None,
        _ => {
            let shape = t.shape.get_or_insert_with(Default::default);
            let d = if rng.one_in(3) { D::DimParam(dict.word(rng)) } else { D::DimValue(interesting(rng, 1)) };
            if shape.dim.is_empty() || rng.one_in(4) {
                shape.dim.push(Dimension { value: Some(d), ..Default::default() });
            } else {
                let i = rng.below(shape.dim.len());
                if rng.one_in(4) {
                    shape.dim.remove(i);
                } else {
                    shape.dim[i].value = Some(d);
                }
            }
        }
    }
}

fn mutate_node(rng: &mut Rng, n: &mut NodeProto, names: &[String], dict: &Dict) {
    match rng.below(8) {
        0 | 1 => {
            if n.attribute.is_empty() || rng.one_in(4) {
                let name = rng.pick(ATTRS).copied().unwrap_or("axis");
                n.attribute.push(proto::AttributeProto { name: Some(name.into()), r#type: Some(2), i: Some(interesting(rng, 0)), ..Default::default() });
            } else {
                let i = rng.below(n.attribute.len());
                if rng.one_in(5) {
                    n.attribute.remove(i);
                } else {
                    mutate_attribute(rng, &mut n.attribute[i], dict);
                }
            }
        }
        2 => n.op_type = Some(op_name(rng, dict)),
        3 => {
            let name = rng.pick(names).cloned().unwrap_or_default();
            if n.input.is_empty() || rng.one_in(3) {
                n.input.push(name);
            } else {
                let i = rng.below(n.input.len());
                n.input[i] = if rng.one_in(4) { String::new() } else { name };
            }
        }
        4 if !n.input.is_empty() => {
            let i = rng.below(n.input.len());
            n.input.remove(i);
        }
        5 => {
            let name = rng.pick(names).cloned().unwrap_or_default();
            if n.output.is_empty() || rng.one_in(3) {
                n.output.push(name);
            } else {
                let i = rng.below(n.output.len());
                n.output[i] = name;
            }
        }
        6 => n.domain = Some(*rng.pick(&["", "ai.onnx", "com.microsoft", "pkg.custom"]).unwrap_or(&"")).map(str::to_string),
        _ => n.output.truncate(rng.below(n.output.len() + 1)),
    }
}

/// A field-level mutation of an ONNX model: a node's op, attributes, inputs or outputs, an
/// initializer's dims, type, data or external-data record, a graph input's type, the opsets.
fn mutate_onnx(rng: &mut Rng, bytes: &[u8], dict: &Dict) -> Option<Vec<u8>> {
    let mut m = ModelProto::decode(prost::bytes::Bytes::copy_from_slice(bytes)).ok()?;
    let g = m.graph.get_or_insert_with(Default::default);
    let mut names: Vec<String> = g.node.iter().flat_map(|n| n.output.iter().cloned()).collect();
    names.extend(g.initializer.iter().filter_map(|t| t.name.clone()));
    names.extend(g.input.iter().filter_map(|v| v.name.clone()));
    match rng.below(12) {
        0..=4 if !g.node.is_empty() => {
            let i = rng.below(g.node.len());
            mutate_node(rng, &mut g.node[i], &names, dict);
        }
        5 if !g.node.is_empty() => {
            let i = rng.below(g.node.len());
            match rng.below(3) {
                0 => {
                    g.node.remove(i);
                }
                1 => {
                    let n = g.node[i].clone();
                    g.node.insert(rng.below(g.node.len() + 1), n);
                }
                _ => {
                    let j = rng.below(g.node.len());
                    g.node.swap(i, j);
                }
            }
        }
        6 | 7 if !g.initializer.is_empty() => {
            let i = rng.below(g.initializer.len());
            mutate_tensor(rng, &mut g.initializer[i], dict);
        }
        8 if !g.input.is_empty() => {
            let i = rng.below(g.input.len());
            mutate_value_info(rng, &mut g.input[i], dict);
        }
        9 => {
            let vs = if rng.one_in(2) { &mut g.output } else { &mut g.value_info };
            if !vs.is_empty() {
                let i = rng.below(vs.len());
                mutate_value_info(rng, &mut vs[i], dict);
            }
        }
        10 => {
            if let Some(f) = m.functions.iter_mut().next().filter(|f| !f.node.is_empty()) {
                let i = rng.below(f.node.len());
                mutate_node(rng, &mut f.node[i], &names, dict);
            } else if let Some(o) = m.opset_import.first_mut() {
                o.version = Some(interesting(rng, o.version.unwrap_or(18)));
            }
        }
        _ => {
            if rng.one_in(2) {
                m.ir_version = Some(interesting(rng, m.ir_version.unwrap_or(8)));
            } else if let Some(o) = m.opset_import.first_mut() {
                o.version = Some(rng.below(26) as i64);
            }
        }
    }
    Some(m.encode_to_vec())
}

// ---- safetensors, npy, npz, token files ----------------------------------------------------

/// Mutates a safetensors file through its JSON header (dtype, shape, data_offsets, metadata),
/// written back with its length (mostly) right, or its data cut or extended.
fn mutate_safetensors(rng: &mut Rng, bytes: &[u8], dict: &Dict) -> Option<Vec<u8>> {
    let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?) as usize;
    let header = bytes.get(8..8usize.checked_add(n)?)?;
    let data = &bytes[8 + n..];
    let (header, data) = match rng.below(4) {
        0 => (header.to_vec(), {
            let mut d = data.to_vec();
            d.truncate(rng.below(d.len() + 1));
            d
        }),
        1 => (header.to_vec(), {
            let mut d = data.to_vec();
            d.extend(std::iter::repeat_n(0u8, 1 + rng.below(64)));
            d
        }),
        _ => (mutate_json(rng, header, None, dict)?, data.to_vec()),
    };
    let len = if rng.one_in(10) { interesting(rng, header.len() as i64) as u64 } else { header.len() as u64 };
    let mut out = len.to_le_bytes().to_vec();
    out.extend_from_slice(&header);
    out.extend_from_slice(&data);
    Some(out)
}

/// Mutates an npy file's header dict (its shape numbers, descr, order) or its data length.
fn mutate_npy(rng: &mut Rng, bytes: &[u8]) -> Option<Vec<u8>> {
    if !bytes.starts_with(b"\x93NUMPY") || bytes.len() < 10 {
        return None;
    }
    let (hstart, hlen) = if bytes[6] == 1 { (10, u16::from_le_bytes([bytes[8], bytes[9]]) as usize) } else { (12, u32::from_le_bytes(bytes.get(8..12)?.try_into().ok()?) as usize) };
    let header = std::str::from_utf8(bytes.get(hstart..hstart + hlen)?).ok()?;
    let data = &bytes[hstart + hlen..];
    let mut h = header.trim_end().to_string();
    let mut d = data.to_vec();
    match rng.below(5) {
        0 => {
            // one number of the shape tuple
            let open = h.find("'shape': (")? + 10;
            let close = open + h[open..].find(')')?;
            let mut dims: Vec<String> = h[open..close].split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect();
            match rng.below(3) {
                0 if !dims.is_empty() => {
                    let i = rng.below(dims.len());
                    dims[i] = interesting(rng, dims[i].parse().unwrap_or(1)).to_string();
                }
                1 => dims.push(interesting(rng, 1).to_string()),
                _ => {
                    dims.pop();
                }
            }
            let tuple = if dims.len() == 1 { format!("{},", dims[0]) } else { dims.join(", ") };
            h.replace_range(open..close, &tuple);
        }
        1 => {
            let descr = *rng.pick(&["<f4", "<f8", "<f2", "|b1", "<i8", "<u8", "<i4", "|u1", ">f4", "<c8", "<U4", "|O", "<V8", "<M8"]).unwrap_or(&"<f4");
            let open = h.find("'descr': '")? + 10;
            let close = open + h[open..].find('\'')?;
            h.replace_range(open..close, descr);
        }
        2 => h = h.replace("False", "True"),
        3 => d.truncate(rng.below(d.len() + 1)),
        _ => d.extend(std::iter::repeat_n(0u8, 1 + rng.below(16))),
    }
    let unpadded = hstart + h.len() + 1;
    h.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    h.push('\n');
    let mut out = bytes[..hstart].to_vec();
    if hstart == 10 {
        out[8..10].copy_from_slice(&(h.len() as u16).to_le_bytes());
    } else {
        out[8..12].copy_from_slice(&(h.len() as u32).to_le_bytes());
    }
    out.extend_from_slice(h.as_bytes());
    out.extend_from_slice(&d);
    Some(out)
}

/// The members of a zip (stored or deflated), each read up to 16 MiB.
fn unzip(bytes: &[u8]) -> Option<Vec<(String, Vec<u8>)>> {
    use std::io::Read;
    let mut zip = zip::ZipArchive::new(std::io::Cursor::new(bytes)).ok()?;
    let mut out = Vec::with_capacity(zip.len());
    for i in 0..zip.len() {
        let member = zip.by_index(i).ok()?;
        let name = member.name().to_string();
        let mut data = Vec::new();
        member.take(16 << 20).read_to_end(&mut data).ok()?;
        out.push((name, data));
    }
    Some(out)
}

/// Mutates one member of an npz (as npy), its name, or the member list, and zips it again.
fn mutate_npz(rng: &mut Rng, bytes: &[u8]) -> Option<Vec<u8>> {
    let mut members = unzip(bytes)?;
    if members.is_empty() {
        return None;
    }
    let i = rng.below(members.len());
    match rng.below(6) {
        0 => members[i].0 = (*rng.pick(&["input_ids.npy", "x.npy", "labels.npy", "attention_mask.npy", "a", "", "input_ids"]).unwrap_or(&"x.npy")).to_string(),
        1 => {
            let m = members[i].clone();
            members.push(m);
        }
        2 if members.len() > 1 => {
            members.remove(i);
        }
        _ => members[i].1 = mutate_npy(rng, &members[i].1)?,
    }
    smp_partition::runtime::formats::npz::stored_zip(&members).ok()
}

/// Token data: cut to an odd length, extended with ids, or ids set past any vocabulary.
fn mutate_tokens(rng: &mut Rng, bytes: &[u8]) -> Vec<u8> {
    let mut b = bytes.to_vec();
    match rng.below(4) {
        0 => b.truncate(rng.below(b.len() + 1)),
        1 => b.extend((0..2 * (1 + rng.below(64))).map(|_| rng.next() as u8)),
        2 if b.len() >= 2 => {
            let at = rng.below(b.len() / 2) * 2;
            b[at] = 0xff;
            b[at + 1] = 0xff;
        }
        _ => b.push(rng.next() as u8),
    }
    b
}
