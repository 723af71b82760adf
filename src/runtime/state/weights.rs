//! Initializers as tch tensors, read lazily and only in the parts a rank holds: in-memory bytes
//! (memory-mapped model files), external data (memory-mapped, offset and length checked
//! against the file), a checkpoint's shards (memory-mapped safetensors), or seeded random
//! values for graph-only models (each element a function of the seed, the initializer's name
//! and its index, so any part is generated alone and equals that part of the whole); and which
//! of them are trained.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use tch::{Kind, Tensor};

use crate::runtime::RuntimeError;
use super::checkpoint::{Loaded, Role};
use super::slice::{self, part_dims, runs};
use crate::runtime::kernels::executor::Weights;
use crate::runtime::kernels::tensor::{from_bytes, is_float_kind, kind_of};
use crate::ir::{DType, ExternalData, Graph, Storage, ValueId, ValueKind};
use crate::passes::figures::is_trainable;

pub use super::slice::Slice;

/// How initializers are materialised.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InitMode {
    /// Read every initializer (external files must exist and be complete).
    Load,
    /// External initializers get seeded random values without touching their files; in-memory
    /// ones are used as stored. Lets a graph-only model run.
    Random {
        /// Seed of the random values.
        seed: i64,
    },
}

impl Weights {
    /// Materialises every initializer and constant of `graph` whole. Float tensors are
    /// converted to `float_kind` when given.
    pub fn load(graph: &Graph, mode: InitMode, float_kind: Option<Kind>) -> Result<Weights, RuntimeError> {
        let source = Source::new(graph, mode, float_kind);
        Weights::of(&source, graph.value_ids())
    }

    /// The whole tensors of `ids` (those with data) from `source`.
    pub fn of(source: &Source<'_>, ids: impl IntoIterator<Item = ValueId>) -> Result<Weights, RuntimeError> {
        let mut tensors = HashMap::new();
        for id in ids {
            if let Some(t) = source.whole(id)? {
                tensors.insert(id, t);
            }
        }
        Ok(Weights { tensors })
    }
}

/// Bytes a [`Source`] has copied out of files (or generated), by what they were.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadBytes {
    /// Trained parameters.
    pub params: u64,
    /// Everything else (buffers, frozen weights, constants).
    pub other: u64,
}

/// Where a graph's initializers come from; reads any part of one on demand (docs/checkpoints.md,
/// "Only-own-shard weights"). Counts the bytes it reads.
pub struct Source<'g> {
    graph: &'g Graph,
    mode: InitMode,
    float_kind: Option<Kind>,
    ckpt: Option<&'g Loaded>,
    maps: RefCell<HashMap<PathBuf, Mmap>>,
    read: Cell<ReadBytes>,
    device: tch::Device,
}

impl<'g> Source<'g> {
    /// The initializers of `graph` as the model file holds them (or random, `mode`), floats
    /// converted to `float_kind` when given.
    pub fn new(graph: &'g Graph, mode: InitMode, float_kind: Option<Kind>) -> Source<'g> {
        Source { graph, mode, float_kind, ckpt: None, maps: RefCell::new(HashMap::new()), read: Cell::new(ReadBytes::default()), device: tch::Device::Cpu }
    }

    /// Float parts are handed over on `device` (read, converted and generated on the host
    /// first, so every device gets the same values).
    pub fn on(mut self, device: tch::Device) -> Source<'g> {
        self.device = device;
        self
    }

    /// The device float parts are handed over on.
    pub fn device(&self) -> tch::Device {
        self.device
    }

    /// Trained parameters and the buffers it holds come from checkpoint `ckpt` (by name and
    /// range, whatever plan wrote it).
    pub fn with_checkpoint(mut self, ckpt: &'g Loaded) -> Source<'g> {
        self.ckpt = Some(ckpt);
        self
    }

    /// The graph it reads for.
    pub fn graph(&self) -> &'g Graph {
        self.graph
    }

    /// The kind floats are converted to, if any.
    pub fn float_kind(&self) -> Option<Kind> {
        self.float_kind
    }

    /// The bytes read so far.
    pub fn bytes_read(&self) -> ReadBytes {
        self.read.get()
    }

    /// The whole tensor of `v`, or `None` when `v` has no data (not an initializer or
    /// constant).
    pub fn whole(&self, v: ValueId) -> Result<Option<Tensor>, RuntimeError> {
        let val = self.graph.value(v);
        if !matches!(val.kind, ValueKind::Initializer | ValueKind::Constant) || val.data.is_none() {
            return Ok(None);
        }
        self.read(v, &Slice::whole()).map(Some)
    }

    /// Part `part` of initializer `v` (shaped as the cut, or flat when `part.flat` is set), in
    /// `float_kind` for floats; reads only its bytes.
    pub fn read(&self, v: ValueId, part: &Slice) -> Result<Tensor, RuntimeError> {
        let val = self.graph.value(v);
        let werr = |message: String| RuntimeError::Weight { name: val.name.clone(), message };
        let data = val.data.as_ref().ok_or_else(|| werr("has no data to read".into()))?;
        let dims = &data.dims;
        let out_dims = part_dims(dims, part).map_err(werr)?;
        let trained = matches!(val.kind, ValueKind::Initializer) && is_trainable(self.graph, v);
        let t = match self.from_checkpoint(v, trained, part)? {
            Some(t) => t,
            None => match &data.storage {
                Storage::Raw(bytes) => self.copy_runs(data.dtype, dims, part, &out_dims, bytes).map_err(werr)?,
                Storage::Strings(_) => return Err(werr("string tensors are not supported by the libtorch runner".into())),
                Storage::External(ext) => match self.mode {
                    InitMode::Random { seed } => random_part(seed, &val.name, data.dtype, dims, part, &out_dims).map_err(werr)?,
                    InitMode::Load => {
                        let mut maps = self.maps.borrow_mut();
                        let bytes = external_bytes(&mut maps, ext, data.nbytes()).map_err(werr)?;
                        self.copy_runs(data.dtype, dims, part, &out_dims, bytes).map_err(werr)?
                    }
                },
            },
        };
        let mut r = self.read.get();
        let n = (t.numel() * t.kind().elt_size_in_bytes()) as u64;
        if trained {
            r.params += n;
        } else {
            r.other += n;
        }
        self.read.set(r);
        let t = match self.float_kind {
            Some(k) if is_float_kind(t.kind()) && t.kind() != k => t.f_to_kind(k)?,
            _ => t,
        };
        Ok(if is_float_kind(t.kind()) && t.device() != self.device { t.f_to_device(self.device)? } else { t })
    }

    /// The part from the checkpoint, for trained parameters and the buffers it holds.
    fn from_checkpoint(&self, v: ValueId, trained: bool, part: &Slice) -> Result<Option<Tensor>, RuntimeError> {
        let Some(ckpt) = self.ckpt else { return Ok(None) };
        let graph = self.graph;
        let dims = graph.value(v).data.as_ref().map(|d| d.dims.clone()).unwrap_or_default();
        let (name, role) = if trained {
            (slice::param_name(graph, v), Role::Param)
        } else if slice::is_buffer(graph, v) {
            let name = slice::buffer_name(graph, v);
            // older checkpoints may lack buffers: the model's values stay
            if !ckpt.manifest.tensors.iter().any(|e| e.name == name && e.role == Role::Buffer) {
                return Ok(None);
            }
            (name, Role::Buffer)
        } else {
            return Ok(None);
        };
        ckpt.read_part(&name, role, &dims, part).map(Some)
    }

    /// The elements of `part` of a tensor `dtype``dims` stored row-major in `bytes`.
    fn copy_runs(&self, dtype: DType, dims: &[i64], part: &Slice, out_dims: &[i64], bytes: &[u8]) -> Result<Tensor, String> {
        if *part == Slice::whole() {
            return from_bytes(dtype, dims, bytes);
        }
        if matches!(dtype, DType::I4 | DType::U4) {
            return Err("parts of 4-bit tensors cannot be read alone".into());
        }
        let size = dtype.size_bytes() as usize;
        let mut out = Vec::with_capacity(out_dims.iter().product::<i64>().max(0) as usize * size);
        for (start, len) in runs(dims, part)? {
            let (a, b) = (start as usize * size, (start + len) as usize * size);
            out.extend_from_slice(bytes.get(a..b).ok_or_else(|| format!("data shorter than element {}", start + len))?);
        }
        from_bytes(dtype, out_dims, &out)
    }
}

/// The bytes of an external tensor from its memory-mapped file, checked against the file.
fn external_bytes<'m>(maps: &'m mut HashMap<PathBuf, Mmap>, ext: &ExternalData, want: u64) -> Result<&'m [u8], String> {
    let path: &Path = &ext.path;
    if !path.is_file() {
        return Err(format!(
            "external data file `{}` ({}) does not exist; put it beside the model or run with `--init random`",
            ext.location,
            path.display()
        ));
    }
    if !maps.contains_key(path) {
        let file = File::open(path).map_err(|e| format!("cannot open external data `{}`: {e}", path.display()))?;
        // SAFETY: the map is read-only and lives as long as this loader; a file truncated by
        // another process while mapped is outside what the runner defends against.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| format!("cannot map `{}`: {e}", path.display()))?;
        maps.insert(path.to_path_buf(), map);
    }
    let map = &maps[path];
    let file_len = map.len() as u64;
    let length = if ext.length > 0 { ext.length } else { want };
    if length != want {
        return Err(format!("external data length {length} does not match the tensor's {want} bytes"));
    }
    let end = ext.offset.checked_add(length).ok_or("offset + length overflows")?;
    if end > file_len {
        return Err(format!(
            "external data `{}` is truncated: needs bytes {}..{end}, the file has {file_len}",
            path.display(),
            ext.offset
        ));
    }
    Ok(&map[ext.offset as usize..end as usize])
}

/// Seeded values for part `part` of a weight whose data is not read: N(0, 0.02) for weights,
/// 0 for biases, 1 for norm scales, 0 for integer tensors. Element `i` of the whole tensor is
/// a function of (seed, name, i) alone.
fn random_part(seed: i64, name: &str, dtype: DType, dims: &[i64], part: &Slice, out_dims: &[i64]) -> Result<Tensor, String> {
    let kind = kind_of(dtype)?;
    let opts = (kind, tch::Device::Cpu);
    let lower = name.to_lowercase();
    let t = if !is_float_kind(kind) || lower.ends_with("bias") {
        Tensor::f_zeros(out_dims, opts)
    } else if dims.len() == 1 && (lower.contains("norm") || lower.contains("ln")) {
        Tensor::f_ones(out_dims, opts)
    } else {
        let key = name.bytes().fold(0xcbf2_9ce4_8422_2325u64 ^ seed as u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3));
        let mut v: Vec<f32> = Vec::with_capacity(out_dims.iter().product::<i64>().max(0) as usize);
        for (start, len) in runs(dims, part)? {
            v.extend((start..start + len).map(|i| 0.02 * normal(key, i) as f32));
        }
        Tensor::f_from_slice(&v).and_then(|t| t.f_reshape(out_dims)).and_then(|t| t.f_to_kind(kind))
    };
    t.map_err(|e| e.to_string())
}

/// A standard normal draw for element `i` of the stream `key` (Box–Muller over two
/// splitmix64 outputs).
fn normal(key: u64, i: u64) -> f64 {
    let u1 = ((splitmix(key ^ splitmix(2 * i)) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    let u2 = ((splitmix(key ^ splitmix(2 * i + 1)) >> 11) as f64) / (1u64 << 53) as f64;
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_of_cuts_and_blocks_are_the_elements_a_narrow_gives() {
        let dims = [4i64, 6, 5];
        let whole = Tensor::arange(120, (Kind::Int64, tch::Device::Cpu)).reshape(dims);
        let part = Slice { axis: Some(1), ranges: vec![[1, 3], [4, 6]], flat: Some([7, 33]), experts: None };
        let cut = Tensor::cat(&[whole.narrow(1, 1, 2), whole.narrow(1, 4, 2)], 1).reshape([-1]).narrow(0, 7, 26);
        let want: Vec<i64> = Vec::try_from(&cut).unwrap();
        let got: Vec<i64> = runs(&dims, &part).unwrap().into_iter().flat_map(|(s, l)| (s..s + l).map(|i| i as i64)).collect();
        assert_eq!(got, want);
        assert_eq!(runs(&dims, &Slice::whole()).unwrap(), vec![(0, 120)]);
        assert!(runs(&dims, &Slice { axis: Some(1), ranges: vec![[0, 7]], flat: None, experts: None }).is_err());
        // experts 1..3 of axis 0 first, then the cut and the block
        let part = Slice { axis: Some(1), ranges: vec![[1, 3], [4, 6]], flat: Some([3, 11]), experts: Some([1, 3]) };
        let held = whole.narrow(0, 1, 2);
        let cut = Tensor::cat(&[held.narrow(1, 1, 2), held.narrow(1, 4, 2)], 1).reshape([-1]).narrow(0, 3, 8);
        let want: Vec<i64> = Vec::try_from(&cut).unwrap();
        let got: Vec<i64> = runs(&dims, &part).unwrap().into_iter().flat_map(|(s, l)| (s..s + l).map(|i| i as i64)).collect();
        assert_eq!(got, want);
        assert!(runs(&dims, &Slice { experts: Some([3, 5]), ..Slice::whole() }).is_err());
    }

    #[test]
    fn a_random_part_equals_that_part_of_the_whole() {
        let dims = [6i64, 8];
        let whole = random_part(3, "w", DType::F64, &dims, &Slice::whole(), &dims).unwrap();
        let part = Slice { axis: Some(1), ranges: vec![[2, 6]], flat: Some([3, 17]), experts: None };
        let got = random_part(3, "w", DType::F64, &dims, &part, &[14]).unwrap();
        let want = whole.narrow(1, 2, 4).reshape([-1]).narrow(0, 3, 14);
        assert!(got.equal(&want));
        let std = f64::try_from(random_part(3, "big", DType::F64, &[4000], &Slice::whole(), &[4000]).unwrap().std(true)).unwrap();
        assert!((std - 0.02).abs() < 0.002, "std {std}");
    }
}
