//! Training checkpoints (docs/checkpoints.md): each rank writes its shard as safetensors
//! (parameters and AdamW moments, each piece with the slice of the whole tensor it holds), and
//! rank 0 then writes a JSON manifest listing every piece. Files are written atomically (temp
//! file, fsync, rename) and the manifest last, so a checkpoint without a manifest is never
//! loaded. Loading reassembles whole tensors from names and ranges, whatever plan wrote them,
//! so a run can resume under another plan.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::runtime::RuntimeError;
use super::slice::{Slice, buffer_name, is_buffer, param_name, part_dims, runs, slice_shape};
use crate::runtime::kernels::tensor::{from_bytes, to_bytes};
use crate::ir::{DType, Graph, ValueId};
use crate::passes::params::ParamOptions;

/// The loss scale between steps (what a checkpoint keeps of a `GradScaler`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScaleState {
    /// The scale the next step multiplies its loss by.
    pub scale: f64,
    /// Steps in a row without inf/NaN since the scale last changed.
    pub growth_tracker: u64,
}

/// Version of the manifest format.
pub const FORMAT: u32 = 1;
/// The manifest's file name inside a checkpoint directory.
pub const MANIFEST: &str = "manifest.json";
/// Environment variable of the test-only fault hook: `RANK:STEP` makes rank RANK abort right
/// after writing its shard of the checkpoint at step STEP, before the manifest exists.
pub const FAULT_ENV: &str = "SMP_CHECKPOINT_FAULT";

/// What a checkpointed tensor is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// A trained parameter.
    Param,
    /// AdamW's first moment of a parameter (`exp_avg`, as `torch.optim.AdamW` names it).
    ExpAvg,
    /// AdamW's second moment (`exp_avg_sq`).
    ExpAvgSq,
    /// A module buffer (frozen, as the model holds it).
    Buffer,
}

impl Role {
    fn key(self) -> &'static str {
        match self {
            Role::Param => "param",
            Role::ExpAvg => "exp_avg",
            Role::ExpAvgSq => "exp_avg_sq",
            Role::Buffer => "buffer",
        }
    }
}

/// One piece of a tensor held by a rank.
pub struct Piece {
    /// Checkpoint name (docs/checkpoints.md: the module parameter name, or the initializer's).
    pub name: String,
    /// What it is.
    pub role: Role,
    /// Shape of the whole tensor, as the model's initializer stores it.
    pub shape: Vec<i64>,
    /// The initializer stores the module tensor transposed.
    pub transposed: bool,
    /// Which part of the whole this is.
    pub slice: Slice,
    /// The values (shaped as the cut tensor, or flat for a `flat` part).
    pub tensor: Tensor,
}

/// One tensor piece in the manifest.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Entry {
    /// Shard file (in the checkpoint directory).
    pub file: String,
    /// Key inside the file.
    pub key: String,
    /// Checkpoint name.
    pub name: String,
    /// What it is.
    pub role: Role,
    /// Shape of the whole tensor (the initializer's layout).
    pub shape: Vec<i64>,
    /// The initializer stores the module tensor transposed (export transposes it back).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub transposed: bool,
    /// The part of the whole tensor the piece holds.
    #[serde(flatten)]
    pub slice: Slice,
}

/// What a checkpoint records besides its tensors.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunState {
    /// Optimizer steps taken.
    pub step: usize,
    /// The next global batch to read (step k reads batch k; the order is a function of the
    /// seed and the step alone).
    pub next_batch: usize,
    /// The seed of the sample order, of random initialisation and of Dropout masks (each mask
    /// a function of the seed, the step, the node and the sample; the runner draws no other
    /// random numbers during training).
    pub seed: i64,
    /// sha256 of the plan (none: a single-process `train` run).
    pub plan_hash: Option<String>,
    /// The plan's mesh, for people reading the manifest (`pp2 dp1 tp2 zero0`).
    pub mesh: String,
    /// sha256 of the model file.
    pub model_sha256: String,
    /// The model file the run trained (`export` reads it).
    pub model_path: String,
    /// The run's `--trainable` patterns (what `export` and a resume must decide alike).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub trainable: Vec<String>,
    /// The run's `--frozen` patterns.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub frozen: Vec<String>,
    /// Ranks that wrote shards.
    pub world: usize,
    /// Optimizer: AdamW's step count (every moment of the checkpoint has taken this many).
    pub adamw_step: usize,
    /// The loss scale of an fp16 mixed-precision run (absent before it existed, and in other
    /// runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<LossScaleState>,
}

/// The manifest of a complete checkpoint.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT`].
    pub format: u32,
    /// The run's state.
    #[serde(flatten)]
    pub state: RunState,
    /// Every shard file.
    pub files: Vec<String>,
    /// Every piece.
    pub tensors: Vec<Entry>,
}

fn ferr(path: &Path, m: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::File { path: path.display().to_string(), message: m.to_string() }
}

/// The directory of the checkpoint at `step` under `root`.
pub fn step_dir(root: &Path, step: usize) -> PathBuf {
    root.join(format!("step-{step:08}"))
}

fn shard_name(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}

fn index_name(rank: usize) -> String {
    format!("rank-{rank:05}.json")
}

/// Writes `bytes` to `path` atomically: a temp file beside it, fsync, rename, fsync of the
/// directory.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), RuntimeError> {
    let tmp = path.with_extension(format!("{}.tmp", path.extension().and_then(|e| e.to_str()).unwrap_or("")));
    let io = |what: &str, e: std::io::Error| {
        // a partial temporary file is never read, and would only hold the space a retry needs
        let _ = std::fs::remove_file(&tmp);
        if e.kind() == std::io::ErrorKind::StorageFull {
            ferr(&tmp, format!("cannot {what}: no space left on the device ({e})"))
        } else {
            ferr(&tmp, format!("cannot {what}: {e}"))
        }
    };
    let mut f = File::create(&tmp).map_err(|e| io("create", e))?;
    f.write_all(bytes).map_err(|e| io("write", e))?;
    f.sync_all().map_err(|e| io("fsync", e))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(|e| ferr(path, format!("cannot rename {} to it: {e}", tmp.display())))?;
    sync_dir(path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new(".")))
}

fn sync_dir(dir: &Path) -> Result<(), RuntimeError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| ferr(dir, format!("cannot fsync the directory: {e}")))
}

/// Prepares `dir` for a checkpoint: creates it and removes a manifest an earlier run left
/// there (its shard files are about to be overwritten). Rank 0 calls this before any rank
/// writes.
pub fn begin(dir: &Path) -> Result<(), RuntimeError> {
    std::fs::create_dir_all(dir).map_err(|e| ferr(dir, format!("cannot create the checkpoint directory: {e}")))?;
    let m = dir.join(MANIFEST);
    if m.exists() {
        std::fs::remove_file(&m).map_err(|e| ferr(&m, format!("cannot remove the old manifest: {e}")))?;
        sync_dir(dir)?;
    }
    Ok(())
}

fn st_dtype(d: DType) -> Option<Dtype> {
    Some(match d {
        DType::F64 => Dtype::F64,
        DType::F32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I64 => Dtype::I64,
        DType::I32 => Dtype::I32,
        DType::I16 => Dtype::I16,
        DType::I8 => Dtype::I8,
        DType::U8 => Dtype::U8,
        DType::Bool => Dtype::BOOL,
        _ => return None,
    })
}

fn ir_dtype(d: Dtype) -> Option<DType> {
    Some(match d {
        Dtype::F64 => DType::F64,
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::I64 => DType::I64,
        Dtype::I32 => DType::I32,
        Dtype::I16 => DType::I16,
        Dtype::I8 => DType::I8,
        Dtype::U8 => DType::U8,
        Dtype::BOOL => DType::Bool,
        _ => return None,
    })
}

/// Serialises named tensors as safetensors bytes.
pub fn safetensors_bytes(tensors: &[(String, Tensor)]) -> Result<Vec<u8>, RuntimeError> {
    let mut raw: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::with_capacity(tensors.len());
    for (key, t) in tensors {
        let (dt, dims, bytes) = to_bytes(t).map_err(|m| RuntimeError::Train(format!("tensor `{key}`: {m}")))?;
        let st = st_dtype(dt).ok_or_else(|| RuntimeError::Train(format!("tensor `{key}`: element type {dt:?} has no safetensors type")))?;
        raw.push((key.clone(), st, dims.iter().map(|&d| d as usize).collect(), bytes));
    }
    let views: Vec<(String, TensorView<'_>)> = raw
        .iter()
        .map(|(k, dt, shape, bytes)| TensorView::new(*dt, shape.clone(), bytes).map(|v| (k.clone(), v)))
        .collect::<Result<_, _>>()
        .map_err(|e| RuntimeError::Train(format!("safetensors: {e}")))?;
    safetensors::serialize(views, None).map_err(|e| RuntimeError::Train(format!("safetensors: {e}")))
}

/// Writes rank `rank`'s pieces into `dir` (its shard, then its index), atomically.
pub fn write_shard(dir: &Path, rank: usize, pieces: &[Piece]) -> Result<(), RuntimeError> {
    let file = shard_name(rank);
    let mut keyed: Vec<(String, Tensor)> = Vec::with_capacity(pieces.len());
    let mut entries: Vec<Entry> = Vec::with_capacity(pieces.len());
    let mut seen: HashMap<String, usize> = HashMap::new();
    for p in pieces {
        let base = format!("{}/{}", p.role.key(), p.name);
        let n = seen.entry(base.clone()).or_insert(0);
        let key = if *n == 0 { base } else { format!("{base}#{n}") };
        *n += 1;
        keyed.push((key.clone(), p.tensor.shallow_clone()));
        entries.push(Entry {
            file: file.clone(),
            key,
            name: p.name.clone(),
            role: p.role,
            shape: p.shape.clone(),
            transposed: p.transposed,
            slice: p.slice.clone(),
        });
    }
    write_atomic(&dir.join(&file), &safetensors_bytes(&keyed)?)?;
    let index = serde_json::to_vec(&entries).map_err(|e| RuntimeError::Train(e.to_string()))?;
    write_atomic(&dir.join(index_name(rank)), &index)
}

/// Rank 0, once every rank's shard is written: writes the manifest (the commit point) from
/// the ranks' indexes.
pub fn write_manifest(dir: &Path, state: RunState) -> Result<PathBuf, RuntimeError> {
    let mut tensors = Vec::new();
    let mut files = Vec::new();
    for r in 0..state.world {
        let p = dir.join(index_name(r));
        let text = std::fs::read(&p).map_err(|e| ferr(&p, format!("rank {r} wrote no shard index: {e}")))?;
        let mut es: Vec<Entry> = serde_json::from_slice(&text).map_err(|e| ferr(&p, format!("damaged shard index: {e}")))?;
        files.push(shard_name(r));
        tensors.append(&mut es);
    }
    let m = Manifest { format: FORMAT, state, files, tensors };
    let path = dir.join(MANIFEST);
    let bytes = serde_json::to_vec_pretty(&m).map_err(|e| RuntimeError::Train(e.to_string()))?;
    write_atomic(&path, &bytes)?;
    Ok(path)
}

/// The complete checkpoints under `root` (directories with a manifest), by step.
pub fn complete(root: &Path) -> Vec<(usize, PathBuf)> {
    let mut out: Vec<(usize, PathBuf)> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let step: usize = name.strip_prefix("step-")?.parse().ok()?;
            e.path().join(MANIFEST).is_file().then(|| (step, e.path()))
        })
        .collect();
    out.sort();
    out
}

/// Keeps the `keep` newest complete checkpoints under `root`, and removes incomplete ones
/// older than the newest complete one.
pub fn prune(root: &Path, keep: usize) -> Result<(), RuntimeError> {
    let done = complete(root);
    let Some(&(newest, _)) = done.last() else { return Ok(()) };
    let kept: Vec<usize> = done.iter().rev().take(keep.max(1)).map(|(s, _)| *s).collect();
    for e in std::fs::read_dir(root).map_err(|e| ferr(root, e))?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(step) = name.strip_prefix("step-").and_then(|s| s.parse::<usize>().ok()) else { continue };
        if step < newest && !kept.contains(&step) {
            std::fs::remove_dir_all(e.path()).map_err(|err| ferr(&e.path(), format!("cannot remove an old checkpoint: {err}")))?;
        }
    }
    Ok(())
}

/// The checkpoint `--resume PATH` names: PATH itself when it holds a manifest, else the newest
/// complete checkpoint under it.
pub fn resolve(path: &Path) -> Result<PathBuf, RuntimeError> {
    if path.join(MANIFEST).is_file() {
        return Ok(path.to_path_buf());
    }
    if !path.is_dir() {
        return Err(ferr(path, "no such checkpoint directory"));
    }
    complete(path).pop().map(|(_, p)| p).ok_or_else(|| {
        ferr(path, "holds no complete checkpoint (no `step-N/manifest.json`; a checkpoint whose manifest is missing was interrupted and is never loaded)")
    })
}

/// A checkpoint read back: its manifest and shard files, headers checked.
pub struct Loaded {
    /// The checkpoint directory.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
    /// Each shard: its bytes and parsed header (where its data starts, each tensor's info).
    files: HashMap<String, Shard>,
}

struct Shard {
    /// The file, memory-mapped (a rank reads only the pieces it needs).
    bytes: memmap2::Mmap,
    data_start: usize,
    tensors: HashMap<String, safetensors::tensor::TensorInfo>,
}

impl Loaded {
    /// Reads the checkpoint `--resume PATH` names ([`resolve`]); refuses a damaged manifest or
    /// safetensors header, or a piece missing from its file, naming the file.
    pub fn open(path: &Path) -> Result<Loaded, RuntimeError> {
        let dir = resolve(path)?;
        let mpath = dir.join(MANIFEST);
        let text = std::fs::read(&mpath).map_err(|e| ferr(&mpath, format!("cannot read: {e}")))?;
        let manifest: Manifest =
            serde_json::from_slice(&text).map_err(|e| ferr(&mpath, format!("damaged checkpoint manifest ({e}); resume from an older checkpoint directory")))?;
        if manifest.format != FORMAT {
            return Err(ferr(&mpath, format!("checkpoint format {} is not this runner's {FORMAT}", manifest.format)));
        }
        let mut files = HashMap::new();
        for f in &manifest.files {
            let p = dir.join(f);
            if f.contains('/') || f.contains("..") {
                return Err(ferr(&mpath, format!("names shard file `{f}` outside the checkpoint directory")));
            }
            let file = File::open(&p).map_err(|e| ferr(&p, format!("cannot read the shard: {e}")))?;
            // SAFETY: read-only; a shard rewritten while mapped is outside what the runner
            // defends against (checkpoints are written to new files and renamed)
            let bytes = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ferr(&p, format!("cannot map the shard: {e}")))?;
            let damaged = |e: safetensors::SafeTensorError| ferr(&p, format!("damaged safetensors header ({e}); resume from an older checkpoint directory"));
            // the parse checks the header against the file's length
            let (n, meta) = SafeTensors::read_metadata(&bytes).map_err(damaged)?;
            let tensors = meta.tensors().into_iter().map(|(k, i)| (k, i.clone())).collect();
            files.insert(f.clone(), Shard { bytes, data_start: 8 + n, tensors });
        }
        let loaded = Loaded { dir, manifest, files };
        for e in &loaded.manifest.tensors {
            loaded.info(e)?;
        }
        Ok(loaded)
    }

    /// A piece's shard, and its header entry checked against the manifest.
    fn info(&self, e: &Entry) -> Result<(&Shard, &safetensors::tensor::TensorInfo), RuntimeError> {
        let p = self.dir.join(&e.file);
        let shard = self
            .files
            .get(&e.file)
            .ok_or_else(|| ferr(&self.dir.join(MANIFEST), format!("piece `{}` names file `{}`, which the manifest does not list", e.key, e.file)))?;
        let info = shard.tensors.get(&e.key).ok_or_else(|| ferr(&p, format!("has no tensor `{}`", e.key)))?;
        let want = piece_numel(e).map_err(|m| ferr(&p, format!("tensor `{}`: {m}", e.key)))?;
        if info.shape.iter().product::<usize>() as i64 != want {
            return Err(ferr(&p, format!("tensor `{}` holds {:?}, but the manifest's ranges give {want} elements", e.key, info.shape)));
        }
        if ir_dtype(info.dtype).is_none() {
            return Err(ferr(&p, format!("tensor `{}` has unsupported type {:?}", e.key, info.dtype)));
        }
        Ok((shard, info))
    }

    /// Part `part` of the tensor `name` of `role` (whole shape `dims`, the model's), read from
    /// the pieces that hold its elements and nothing else: a rank resuming under any plan reads
    /// only what it holds. Refused when the pieces disagree on the shape or miss an element.
    pub fn read_part(&self, name: &str, role: Role, dims: &[i64], part: &Slice) -> Result<Tensor, RuntimeError> {
        let mpath = self.dir.join(MANIFEST);
        let entries: Vec<&Entry> = self.manifest.tensors.iter().filter(|e| e.name == name && e.role == role).collect();
        let Some(first) = entries.first() else {
            return Err(ferr(
                &mpath,
                format!("has no {} `{name}` of this model; was it written for another model or other --trainable/--frozen flags?", role.key()),
            ));
        };
        let bad = |m: String| ferr(&mpath, format!("`{name}` ({}): {m}", role.key()));
        if first.shape != dims {
            return Err(bad(format!("is {:?} there, but {dims:?} in the model", first.shape)));
        }
        // every piece's elements as runs of the whole tensor: (start, len, piece, offset in it)
        let mut index: Vec<(u64, u64, usize, u64)> = Vec::new();
        let mut dtype = None;
        let mut infos = Vec::with_capacity(entries.len());
        for (k, e) in entries.iter().enumerate() {
            if e.shape != first.shape {
                return Err(bad(format!("pieces disagree on its shape ({:?} vs {:?})", e.shape, first.shape)));
            }
            let (shard, info) = self.info(e)?;
            let dt = ir_dtype(info.dtype).ok_or_else(|| bad(format!("unsupported type {:?}", info.dtype)))?;
            if *dtype.get_or_insert(dt) != dt {
                return Err(bad("pieces disagree on the element type".into()));
            }
            infos.push((shard, info));
            let mut off = 0u64;
            for (s, l) in runs(&e.shape, &e.slice).map_err(bad)? {
                index.push((s, l, k, off));
                off += l;
            }
        }
        index.sort_by_key(|r| r.0);
        let dt = dtype.unwrap_or(DType::F32);
        let size = dt.size_bytes() as usize;
        let out_dims = part_dims(dims, part).map_err(bad)?;
        // a part larger than all its pieces together misses elements: refused before allocating
        let held: u64 = index.iter().map(|r| r.1).sum();
        let wanted = out_dims.iter().try_fold(1u64, |n, &d| n.checked_mul(u64::try_from(d).ok()?));
        let wanted = match wanted {
            Some(n) if n <= held => n,
            _ => return Err(bad(format!("its pieces hold {held} elements, fewer than the {out_dims:?} asked for: some element is in no shard"))),
        };
        let mut out: Vec<u8> = Vec::with_capacity(wanted as usize * size);
        for (start, len) in runs(dims, part).map_err(bad)? {
            let mut at = start;
            while at < start + len {
                let i = index.partition_point(|r| r.0 <= at);
                let hit = i.checked_sub(1).map(|i| index[i]).filter(|r| at < r.0 + r.1);
                let Some((s, l, k, off)) = hit else {
                    return Err(bad(format!("element {at} is in no shard")));
                };
                let end = (start + len).min(s + l);
                let (shard, info) = infos[k];
                let a = shard.data_start + info.data_offsets.0 + (off + at - s) as usize * size;
                let b = a + (end - at) as usize * size;
                let bytes = shard.bytes.get(a..b).ok_or_else(|| ferr(&self.dir.join(&entries[k].file), format!("tensor `{}` lies outside the file", entries[k].key)))?;
                out.extend_from_slice(bytes);
                at = end;
            }
        }
        from_bytes(dt, &out_dims, &out).map_err(bad)
    }

    /// The names of the checkpoint's tensors of `role`, with their whole shapes and whether
    /// they are stored transposed.
    pub fn names(&self, role: Role) -> BTreeMap<String, (Vec<i64>, bool)> {
        self.manifest.tensors.iter().filter(|e| e.role == role).map(|e| (e.name.clone(), (e.shape.clone(), e.transposed))).collect()
    }

    /// The whole tensor `name` of `role`, reassembled from its pieces (in the initializer's
    /// layout, whatever tensor-parallel, expert-parallel or ZeRO parts they are); refused when
    /// the pieces do not cover it.
    pub fn assemble(&self, name: &str, role: Role) -> Result<Tensor, RuntimeError> {
        let first = self.manifest.tensors.iter().find(|e| e.name == name && e.role == role);
        let Some(first) = first else {
            return Err(ferr(&self.dir.join(MANIFEST), format!("holds no {} of `{name}`", role.key())));
        };
        let shape = first.shape.clone();
        self.read_part(name, role, &shape, &Slice::whole())
    }
}

fn piece_numel(e: &Entry) -> Result<i64, String> {
    let s = slice_shape(&e.shape, &e.slice)?;
    let n = s.iter().try_fold(1i64, |n, &d| n.checked_mul(d)).ok_or_else(|| format!("shape {s:?} has more elements than memory holds"))?;
    match e.slice.flat {
        None => Ok(n),
        Some([a, b]) if a <= b && b <= n as u64 => Ok((b - a) as i64),
        Some(f) => Err(format!("element range {f:?} exceeds the {n} elements of its cut")),
    }
}

/// The module buffers of `graph` that `held` gives a tensor for, with the part of the buffer
/// it is (whole, or a tensor-parallel cut). BatchNorm's running statistics move during
/// training, so each must come from the copy that trained: the caller's `held` answers only
/// for buffers whose live copy it holds (each part written once per world).
pub fn buffer_pieces(graph: &Graph, held: impl Fn(ValueId) -> Option<(Tensor, Slice)>) -> Result<Vec<Piece>, RuntimeError> {
    let mut out = Vec::new();
    for v in graph.initializers().filter(|&v| is_buffer(graph, v)) {
        let Some((w, slice)) = held(v).filter(|(w, _)| w.numel() > 0) else { continue };
        let shape = graph.value(v).data.as_ref().map(|d| d.dims.clone()).unwrap_or_else(|| w.size());
        out.push(Piece { name: buffer_name(graph, v), role: Role::Buffer, shape, transposed: false, slice, tensor: w.f_detach()? });
    }
    Ok(out)
}

/// The fault hook ([`FAULT_ENV`]): aborts the process if it names this rank and step.
pub fn fault_point(rank: usize, step: usize) {
    if let Ok(v) = std::env::var(FAULT_ENV) {
        if v.split_once(':').and_then(|(r, s)| Some((r.trim().parse::<usize>().ok()?, s.trim().parse::<usize>().ok()?))) == Some((rank, step)) {
            let _ = writeln!(std::io::stderr(), "smp-runner: {FAULT_ENV}={v}: rank {rank} aborts after writing its shard of step {step}");
            std::process::abort();
        }
    }
}

/// Replaces the trained initializers of `graph` in `weights` by the checkpoint's values
/// (converted to each weight's kind); refuses a checkpoint that lacks one or disagrees on its
/// shape.
pub fn restore_params(ckpt: &Loaded, graph: &Graph, weights: &mut HashMap<ValueId, Tensor>) -> Result<(), RuntimeError> {
    let mpath = ckpt.dir.join(MANIFEST);
    for v in graph.initializers() {
        if !crate::passes::figures::is_trainable(graph, v) {
            continue;
        }
        let Some(w) = weights.get(&v) else { continue };
        let name = param_name(graph, v);
        let t = ckpt.assemble(&name, Role::Param).map_err(|e| match e {
            RuntimeError::File { message, .. } if message.starts_with("holds no") => ferr(
                &mpath,
                format!("has no parameter `{name}` of this model; was it written for another model or other --trainable/--frozen flags?"),
            ),
            e => e,
        })?;
        if t.size() != w.size() {
            return Err(ferr(&mpath, format!("parameter `{name}` is {:?} there, but {:?} in the model", t.size(), w.size())));
        }
        let t = t.f_to_kind(w.kind())?;
        weights.insert(v, t);
    }
    // buffers as training left them (running statistics); older checkpoints may lack them
    for v in graph.initializers().filter(|&v| is_buffer(graph, v)) {
        let Some(w) = weights.get(&v) else { continue };
        let name = buffer_name(graph, v);
        if !ckpt.manifest.tensors.iter().any(|e| e.name == name && e.role == Role::Buffer) {
            continue;
        }
        let t = ckpt.assemble(&name, Role::Buffer)?;
        if t.size() != w.size() {
            return Err(ferr(&mpath, format!("buffer `{name}` is {:?} there, but {:?} in the model", t.size(), w.size())));
        }
        let t = t.f_to_kind(w.kind())?;
        weights.insert(v, t);
    }
    Ok(())
}

/// The AdamW moments of trained initializers in a checkpoint, whole, by value (kind `kind`).
pub fn restore_moments(ckpt: &Loaded, graph: &Graph, ids: &[ValueId], kind: Kind) -> Result<HashMap<ValueId, (Tensor, Tensor)>, RuntimeError> {
    let mut out = HashMap::new();
    for &v in ids {
        let name = param_name(graph, v);
        let m = ckpt.assemble(&name, Role::ExpAvg)?.f_to_kind(kind)?;
        let s = ckpt.assemble(&name, Role::ExpAvgSq)?.f_to_kind(kind)?;
        out.insert(v, (m, s));
    }
    Ok(out)
}

/// Where and how often a run writes checkpoints, with what the manifest records of the run.
#[derive(Clone, Debug)]
pub struct SaveConfig {
    /// The checkpoint directory (`step-N/` under it).
    pub root: PathBuf,
    /// Write one after every `every`-th step.
    pub every: usize,
    /// Keep only the newest `keep` complete checkpoints.
    pub keep: Option<usize>,
    /// The run's seed.
    pub seed: i64,
    /// sha256 of the plan.
    pub plan_hash: Option<String>,
    /// The plan's mesh in words.
    pub mesh: String,
    /// sha256 of the model.
    pub model_sha256: String,
    /// What the run trains beyond the model's record and rules.
    pub params: ParamOptions,
    /// The model file.
    pub model_path: String,
    /// What the run does when a checkpoint cannot be written.
    pub on_error: OnCheckpointError,
}

/// What a run does when a checkpoint cannot be written (`--on-checkpoint-error`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OnCheckpointError {
    /// Every rank stops with the error (the previous checkpoint stays the newest).
    #[default]
    Stop,
    /// Every rank goes on training without that checkpoint.
    Continue,
}

impl std::str::FromStr for OnCheckpointError {
    type Err = String;
    /// `stop` or `continue` (`--on-checkpoint-error`).
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "stop" => Ok(OnCheckpointError::Stop),
            "continue" => Ok(OnCheckpointError::Continue),
            _ => Err(format!("`{s}`: expected stop or continue")),
        }
    }
}

impl SaveConfig {
    /// Whether a checkpoint is due after step `step`.
    pub fn due(&self, step: usize) -> bool {
        self.every > 0 && step % self.every == 0
    }

    /// The manifest's run state after `step` steps of a run of `world` ranks.
    pub fn state(&self, step: usize, world: usize) -> RunState {
        RunState {
            step,
            next_batch: step + 1,
            seed: self.seed,
            plan_hash: self.plan_hash.clone(),
            mesh: self.mesh.clone(),
            model_sha256: self.model_sha256.clone(),
            model_path: self.model_path.clone(),
            trainable: self.params.trainable.clone(),
            frozen: self.params.frozen.clone(),
            world,
            adamw_step: step,
            loss_scale: None,
        }
    }
}

impl RunState {
    /// The `--trainable`/`--frozen` patterns the run trained by.
    pub fn params(&self) -> ParamOptions {
        ParamOptions { trainable: self.trainable.clone(), frozen: self.frozen.clone() }
    }
}

impl Loaded {
    /// Refuses to resume this checkpoint in a run that cannot continue it: another model,
    /// other `--trainable`/`--frozen` patterns, another seed (it orders the samples and draws
    /// the dropout masks), or fewer `steps` than it has already taken.
    pub fn check_resumable(&self, model_sha256: &str, params: &ParamOptions, seed: i64, steps: usize) -> Result<(), RuntimeError> {
        let (dir, state) = (self.dir.display(), &self.manifest.state);
        let refuse = |m: String| Err(RuntimeError::Train(m));
        if state.model_sha256 != model_sha256 {
            return refuse(format!("checkpoint `{dir}` was written for another model (sha256 {}); resume it with the model it trained", state.model_sha256));
        }
        if state.params() != *params {
            return refuse(format!(
                "checkpoint `{dir}` trained {}, this run {}: what is trained must stay the same across a resume; give the checkpoint's patterns",
                state.params().describe(),
                params.describe()
            ));
        }
        if state.seed != seed {
            return refuse(format!(
                "checkpoint `{dir}` was trained with --seed {}, this run has --seed {seed}: the seed orders the samples and draws the dropout masks, so a resume must keep it; pass --seed {}",
                state.seed, state.seed
            ));
        }
        if state.step > steps {
            return refuse(format!("checkpoint `{dir}` is at step {}, past --steps {steps}", state.step));
        }
        Ok(())
    }
}

/// Checkpointing of a run: where it writes them, and the checkpoint it resumes from (whose
/// parameters the caller has already put into the executor's weights, [`restore_params`]).
#[derive(Default)]
pub struct Checkpointing<'c> {
    /// Writing checkpoints.
    pub save: Option<SaveConfig>,
    /// Resuming.
    pub resume: Option<&'c Loaded>,
}

impl Checkpointing<'_> {
    /// Steps already taken: the run continues with the step after it.
    pub fn start_step(&self) -> usize {
        self.resume.map_or(0, |l| l.manifest.state.step)
    }
}
