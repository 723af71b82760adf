//! Collectives and point-to-point messages between ranks through libtorch's c10d (a C++ shim,
//! csrc/c10d_shim.cpp): a `TCPStore` for rendezvous, one `ProcessGroupGloo` per group of
//! ranks (with [`Backend::Nccl`] also a `ProcessGroupNCCL`), each under its own store prefix.
//! Every wait has a timeout.
//!
//! Each call goes by its tensor's device: a CUDA tensor's collective to NCCL where the group has
//! it; everything else to Gloo, which takes CUDA tensors through host copies (`--share-gpu`).
//! Messages (`isend`/`irecv`) always travel by Gloo, matched by tag.

mod ffi;

use std::ffi::{CStr, CString, c_char, c_void};
use std::sync::Arc;
use std::time::Duration;

use tch::Tensor;

impl From<DistError> for crate::runtime::RuntimeError {
    fn from(e: DistError) -> Self {
        match e {
            DistError::PortInUse { port, message } => crate::runtime::RuntimeError::PortInUse { port, message },
            e => crate::runtime::RuntimeError::Train(e.to_string()),
        }
    }
}

/// A failed distributed call, with libtorch's message.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// c10d raised an error (peer gone, timeout, bad tensor).
    #[error("c10d {call}{}: {message}", over.as_ref().map(|m| format!(" over ranks {m:?}")).unwrap_or_default())]
    C10d {
        /// The call that failed.
        call: &'static str,
        /// The global ranks of the group it ran over, for a group's call.
        over: Option<Vec<usize>>,
        /// libtorch's message.
        message: String,
    },
    /// The environment does not describe a rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
    #[error("environment: {0}")]
    Env(String),
    /// A tensor or group does not fit the call.
    #[error("{0}")]
    Usage(String),
    /// Rank 0 could not listen on the rendezvous port: another process holds it.
    #[error("c10d TCPStore: port {port} is in use ({message})")]
    PortInUse {
        /// The port.
        port: u16,
        /// libtorch's message.
        message: String,
    },
}

fn check(call: &'static str, err: *mut c_char) -> Result<(), DistError> {
    if err.is_null() {
        return Ok(());
    }
    // SAFETY: the shim returns a NUL-terminated malloc'd string, freed here once.
    let message = unsafe {
        let m = CStr::from_ptr(err).to_string_lossy().into_owned();
        ffi::smp_c10d_free_error(err);
        m
    };
    Err(DistError::C10d { call, over: None, message })
}

fn raw(t: &Tensor) -> *mut torch_sys::C_tensor {
    // c10d writes into the tensor's storage, not the handle.
    t.as_ptr() as *mut torch_sys::C_tensor
}

fn need_contiguous(call: &str, t: &Tensor) -> Result<(), DistError> {
    if t.is_contiguous() {
        Ok(())
    } else {
        Err(DistError::Usage(format!("{call}: tensor of shape {:?} is not contiguous", t.size())))
    }
}

/// Where this process sits: torchrun's environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankEnv {
    /// Global rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// Rank on this host.
    pub local_rank: usize,
    /// Rendezvous host (rank 0's TCPStore).
    pub master_addr: String,
    /// Rendezvous port.
    pub master_port: u16,
}

impl RankEnv {
    /// Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; `None` if RANK and
    /// WORLD_SIZE are both unset (a single-process run).
    pub fn from_env() -> Result<Option<RankEnv>, DistError> {
        let get = |k: &str| std::env::var(k).ok();
        let (Some(rank), Some(world)) = (get("RANK"), get("WORLD_SIZE")) else {
            if get("RANK").is_some() || get("WORLD_SIZE").is_some() {
                return Err(DistError::Env("set both RANK and WORLD_SIZE, or neither".into()));
            }
            return Ok(None);
        };
        let num = |k: &str, v: &str| v.parse::<usize>().map_err(|_| DistError::Env(format!("{k}=`{v}` is not a number")));
        let rank = num("RANK", &rank)?;
        let world = num("WORLD_SIZE", &world)?;
        if rank >= world {
            return Err(DistError::Env(format!("RANK={rank} is not below WORLD_SIZE={world}")));
        }
        let local_rank = match get("LOCAL_RANK") {
            Some(v) => num("LOCAL_RANK", &v)?,
            None => rank,
        };
        let master_addr = get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        let port = get("MASTER_PORT").ok_or_else(|| DistError::Env("MASTER_PORT is not set".into()))?;
        let master_port = port.parse().map_err(|_| DistError::Env(format!("MASTER_PORT=`{port}` is not a port")))?;
        Ok(Some(RankEnv { rank, world, local_rank, master_addr, master_port }))
    }
}

/// Where Gloo binds its sockets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GlooDevice {
    /// Named interfaces (`GLOO_SOCKET_IFNAME`, comma-separated, as torch reads it).
    Interfaces(Vec<String>),
    /// The local address of the interface that reaches `MASTER_ADDR`.
    Address(std::net::IpAddr),
}

impl GlooDevice {
    /// `GLOO_SOCKET_IFNAME` if set, else the local address the kernel routes `MASTER_ADDR`
    /// through (loopback when the master is local).
    pub fn for_env(env: &RankEnv) -> Result<GlooDevice, DistError> {
        if let Some(names) = std::env::var("GLOO_SOCKET_IFNAME").ok().filter(|v| !v.trim().is_empty()) {
            return Ok(GlooDevice::Interfaces(names.split(',').map(|n| n.trim().to_string()).filter(|n| !n.is_empty()).collect()));
        }
        Ok(GlooDevice::Address(route_to(&env.master_addr, env.master_port)?))
    }
}

/// Seconds this process has spent waiting on c10d collectives and messages so far, from any
/// thread (the backward's tensor-parallel collectives included).
pub fn wait_s() -> f64 {
    // SAFETY: reads an atomic counter.
    unsafe { ffi::smp_c10d_wait_ns() as f64 * 1e-9 }
}

/// A wait on c10d work in progress (a collective or a message), as a heartbeat reports it.
#[derive(Clone, Debug, PartialEq)]
pub struct Waiting {
    /// What is waited on: `all_reduce over ranks [0, 1]`, `recv from rank 3`.
    pub what: String,
    /// How long the wait has lasted, in seconds.
    pub waited_s: f64,
}

/// The wait on c10d work some thread of this process is in now (the latest to begin, with how
/// long waits have lasted without a break), if any.
pub fn waiting() -> Option<Waiting> {
    let mut buf = [0u8; 256];
    let mut ns = 0i64;
    // SAFETY: the shim writes at most `buf.len()` bytes, NUL-terminated, and one i64.
    let on = unsafe { ffi::smp_c10d_waiting(buf.as_mut_ptr().cast(), buf.len() as i32, &mut ns) };
    if on == 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Some(Waiting { what: String::from_utf8_lossy(&buf[..end]).into_owned(), waited_s: ns.max(0) as f64 * 1e-9 })
}

/// The local address of the interface that reaches `host`: a UDP socket connected to it (no
/// packet is sent) reports the source address the kernel chose.
pub fn route_to(host: &str, port: u16) -> Result<std::net::IpAddr, DistError> {
    use std::net::{ToSocketAddrs, UdpSocket};
    let fail = |m: String| DistError::Env(format!("MASTER_ADDR=`{host}`: {m}; set MASTER_ADDR to an address this host reaches, or GLOO_SOCKET_IFNAME to the interface to use"));
    let addrs: Vec<std::net::SocketAddr> = (host, port).to_socket_addrs().map_err(|e| fail(format!("cannot resolve it ({e})")))?.collect();
    let mut last = String::from("it resolves to no address");
    for a in addrs {
        let local = if a.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
        let probe = UdpSocket::bind(local).and_then(|s| s.connect(a).map(|()| s)).and_then(|s| s.local_addr());
        match probe {
            Ok(l) => return Ok(l.ip()),
            Err(e) => last = format!("no route to {a} ({e})"),
        }
    }
    Err(fail(last))
}

/// The rendezvous store (rank 0 serves it).
pub struct Store {
    raw: *mut c_void,
    device: GlooDevice,
}

// SAFETY: TCPStore is thread-safe; the handle is only freed on drop.
unsafe impl Send for Store {}
unsafe impl Sync for Store {}

impl Store {
    /// Connects to (rank 0: serves) the TCPStore at `env`'s master address.
    /// Gloo groups made over it bind [`GlooDevice::for_env`].
    pub fn connect(env: &RankEnv, timeout: Duration) -> Result<Arc<Store>, DistError> {
        let device = GlooDevice::for_env(env)?;
        let host = CString::new(env.master_addr.clone()).map_err(|_| DistError::Env("MASTER_ADDR contains NUL".into()))?;
        let mut out = std::ptr::null_mut();
        // SAFETY: valid C string and out-pointer.
        let err = unsafe {
            ffi::smp_c10d_store_new(host.as_ptr(), env.master_port, i32::from(env.rank == 0), env.world as i32, millis(timeout), &mut out)
        };
        check("TCPStore", err).map_err(|e| match e {
            DistError::C10d { message, .. } if env.rank == 0 && (message.contains("EADDRINUSE") || message.contains("address already in use")) => {
                DistError::PortInUse { port: env.master_port, message }
            }
            e => e,
        })?;
        Ok(Arc::new(Store { raw: out, device }))
    }

    /// Where the Gloo groups over this store bind.
    pub fn gloo_device(&self) -> &GlooDevice {
        &self.device
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // SAFETY: created by smp_c10d_store_new, freed once.
        unsafe { ffi::smp_c10d_store_free(self.raw) }
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Which c10d backends a group uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Gloo alone: CPU tensors, and CUDA tensors through host copies.
    Gloo,
    /// NCCL for CUDA tensors' collectives, Gloo for the rest (messages, CPU tensors); builds
    /// with feature `cuda`.
    Nccl,
}

/// A process group: a set of global ranks that run collectives together.
pub struct ProcessGroup {
    raw: *mut c_void,
    members: Vec<usize>,
    index: usize,
    _store: Arc<Store>,
}

// SAFETY: the backend is used from one thread at a time (`&self` calls are serialised by the
// executor); c10d backends are themselves thread-safe.
unsafe impl Send for ProcessGroup {}
unsafe impl Sync for ProcessGroup {}

/// An outstanding send or receive.
pub struct Work {
    raw: *mut c_void,
    tensor: Tensor,
    call: &'static str,
}

impl Work {
    /// Blocks until done (or the group's timeout); returns the tensor sent or received into.
    pub fn wait(self) -> Result<Tensor, DistError> {
        // SAFETY: raw is a live Work handle.
        let err = unsafe { ffi::smp_c10d_work_wait(self.raw) };
        check(self.call, err)?;
        Ok(self.tensor.shallow_clone())
    }

    /// Whether it has finished (a wait then returns at once, with its error if any).
    pub fn is_done(&self) -> bool {
        // SAFETY: raw is a live Work handle.
        unsafe { ffi::smp_c10d_work_done(self.raw) != 0 }
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        // SAFETY: created by the shim, freed once.
        unsafe { ffi::smp_c10d_work_free(self.raw) }
    }
}

/// A context all-gather in flight ([`ProcessGroup::context_gather_start`]).
pub struct PendingGather {
    raw: *mut c_void,
}

impl PendingGather {
    /// Waits for the gather (or the group's timeout); the members' tensors concatenated along
    /// the axis, in group order, connected to the input for autograd.
    pub fn finish(mut self) -> Result<Tensor, DistError> {
        let p = std::mem::replace(&mut self.raw, std::ptr::null_mut());
        let mut out: *mut torch_sys::C_tensor = std::ptr::null_mut();
        // SAFETY: p is a live pending gather; the shim frees it whatever happens.
        let err = unsafe { ffi::smp_c10d_context_gather_finish(p, &mut out) };
        check("context_gather", err)?;
        if out.is_null() {
            return Err(DistError::Usage("context_gather: no tensor returned".into()));
        }
        // SAFETY: the shim returned a heap at::Tensor that tch now owns.
        Ok(unsafe { Tensor::from_ptr(out) })
    }
}

impl Drop for PendingGather {
    fn drop(&mut self) {
        if !self.raw.is_null() {
            // SAFETY: created by the shim and not finished: freed once.
            unsafe { ffi::smp_c10d_pending_gather_free(self.raw) }
        }
    }
}

impl ProcessGroup {
    /// Joins the group of `members` (global ranks; every member calls this with the same list)
    /// as global rank `me`. All members must create their groups in the same order.
    pub fn new(store: &Arc<Store>, members: &[usize], me: usize, timeout: Duration, backend: Backend) -> Result<ProcessGroup, DistError> {
        let index = members
            .iter()
            .position(|&r| r == me)
            .ok_or_else(|| DistError::Usage(format!("rank {me} is not in group {members:?}")))?;
        let name: Vec<String> = members.iter().map(usize::to_string).collect();
        let prefix = CString::new(format!("pg/{}", name.join(","))).map_err(|_| DistError::Usage("bad group name".into()))?;
        let (ifaces, host) = match &store.device {
            GlooDevice::Interfaces(names) => (names.join(","), String::new()),
            GlooDevice::Address(ip) => (String::new(), ip.to_string()),
        };
        let bad = |_| DistError::Env("GLOO_SOCKET_IFNAME contains NUL".into());
        let (ifaces, host) = (CString::new(ifaces).map_err(bad)?, CString::new(host).map_err(bad)?);
        let mut out = std::ptr::null_mut();
        // SAFETY: valid store handle, C strings and out-pointer.
        let err = unsafe {
            ffi::smp_c10d_group_new(
                store.raw,
                prefix.as_ptr(),
                index as i32,
                members.len() as i32,
                millis(timeout),
                i32::from(backend == Backend::Nccl),
                ifaces.as_ptr(),
                host.as_ptr(),
                &mut out,
            )
        };
        check("ProcessGroup", err)?;
        Ok(ProcessGroup { raw: out, members: members.to_vec(), index, _store: store.clone() })
    }

    /// Whether CUDA tensors' collectives go through NCCL.
    pub fn has_nccl(&self) -> bool {
        // SAFETY: live group.
        unsafe { ffi::smp_c10d_group_has_nccl(self.raw) != 0 }
    }

    /// Global ranks of the members, in group order.
    pub fn members(&self) -> &[usize] {
        &self.members
    }

    /// This process's index in the group.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Number of members.
    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// [`check`] with the group's members named, so a timed-out collective says whom it waited on.
    fn checked(&self, call: &'static str, err: *mut c_char) -> Result<(), DistError> {
        check(call, err).map_err(|e| match e {
            DistError::C10d { call, message, .. } => DistError::C10d { call, over: Some(self.members.clone()), message },
            other => other,
        })
    }

    fn peer_index(&self, call: &str, global: usize) -> Result<i32, DistError> {
        self.members
            .iter()
            .position(|&r| r == global)
            .map(|i| i as i32)
            .ok_or_else(|| DistError::Usage(format!("{call}: rank {global} is not in group {:?}", self.members)))
    }

    /// Sums `t` in place over the members.
    pub fn all_reduce_sum(&self, t: &Tensor) -> Result<(), DistError> {
        need_contiguous("all_reduce", t)?;
        // SAFETY: live group and tensor.
        self.checked("all_reduce", unsafe { ffi::smp_c10d_all_reduce_sum(self.raw, raw(t)) })
    }

    /// Concatenates every member's `input` (flattened) into `out`, member order.
    pub fn all_gather(&self, out: &Tensor, input: &Tensor) -> Result<(), DistError> {
        need_contiguous("all_gather", out)?;
        need_contiguous("all_gather", input)?;
        if out.numel() != input.numel() * self.size() {
            return Err(DistError::Usage(format!(
                "all_gather: output has {} elements, not {} × {}",
                out.numel(),
                self.size(),
                input.numel()
            )));
        }
        // SAFETY: live group and tensors.
        self.checked("all_gather", unsafe { ffi::smp_c10d_all_gather(self.raw, raw(out), raw(input)) })
    }

    /// Starts [`Self::all_gather`] and returns at once; the gather is in `out` once the Work
    /// is waited for (both tensors must stay untouched until then).
    pub fn all_gather_start(&self, out: &Tensor, input: &Tensor) -> Result<Work, DistError> {
        need_contiguous("all_gather", out)?;
        need_contiguous("all_gather", input)?;
        if out.numel() != input.numel() * self.size() {
            return Err(DistError::Usage(format!("all_gather: output has {} elements, not {} × {}", out.numel(), self.size(), input.numel())));
        }
        let mut w = std::ptr::null_mut();
        // SAFETY: live group and tensors; the Work keeps them alive.
        self.checked("all_gather", unsafe { ffi::smp_c10d_all_gather_start(self.raw, raw(out), raw(input), &mut w) })?;
        Ok(Work { raw: w, tensor: out.shallow_clone(), call: "all_gather" })
    }

    /// Sums `input` (flattened, `size` equal blocks) over the members; this member's block
    /// lands in `out`.
    pub fn reduce_scatter_sum(&self, out: &Tensor, input: &Tensor) -> Result<(), DistError> {
        need_contiguous("reduce_scatter", out)?;
        need_contiguous("reduce_scatter", input)?;
        if input.numel() != out.numel() * self.size() {
            return Err(DistError::Usage(format!(
                "reduce_scatter: input has {} elements, not {} × {}",
                input.numel(),
                self.size(),
                out.numel()
            )));
        }
        // SAFETY: live group and tensors.
        self.checked("reduce_scatter", unsafe { ffi::smp_c10d_reduce_scatter_sum(self.raw, raw(out), raw(input)) })
    }

    /// Copies global rank `root`'s `t` into every member's `t`.
    pub fn broadcast(&self, t: &Tensor, root: usize) -> Result<(), DistError> {
        need_contiguous("broadcast", t)?;
        let root = self.peer_index("broadcast", root)?;
        // SAFETY: live group and tensor.
        self.checked("broadcast", unsafe { ffi::smp_c10d_broadcast(self.raw, raw(t), root) })
    }

    /// Waits for every member.
    pub fn barrier(&self) -> Result<(), DistError> {
        // SAFETY: live group.
        self.checked("barrier", unsafe { ffi::smp_c10d_barrier(self.raw) })
    }

    /// Posts `t` to global rank `dst` without waiting.
    pub fn isend(&self, t: &Tensor, dst: usize, tag: u32) -> Result<Work, DistError> {
        need_contiguous("send", t)?;
        let dst = self.peer_index("send", dst)?;
        let mut w = std::ptr::null_mut();
        // SAFETY: live group and tensor; the Work keeps the tensor alive.
        check("send", unsafe { ffi::smp_c10d_isend(self.raw, raw(t), dst, tag as i32, &mut w) })?;
        Ok(Work { raw: w, tensor: t.shallow_clone(), call: "send" })
    }

    /// Posts a receive from global rank `src` into `t`.
    pub fn irecv(&self, t: &Tensor, src: usize, tag: u32) -> Result<Work, DistError> {
        need_contiguous("recv", t)?;
        let src = self.peer_index("recv", src)?;
        let mut w = std::ptr::null_mut();
        // SAFETY: live group and tensor; the Work keeps the tensor alive.
        check("recv", unsafe { ffi::smp_c10d_irecv(self.raw, raw(t), src, tag as i32, &mut w) })?;
        Ok(Work { raw: w, tensor: t.shallow_clone(), call: "recv" })
    }
}

impl ProcessGroup {
    fn autograd_call(&self, call: &'static str, f: impl FnOnce(*mut *mut torch_sys::C_tensor) -> *mut c_char) -> Result<Tensor, DistError> {
        let mut out: *mut torch_sys::C_tensor = std::ptr::null_mut();
        let err = f(&mut out);
        self.checked(call, err)?;
        if out.is_null() {
            return Err(DistError::Usage(format!("{call}: no tensor returned")));
        }
        // SAFETY: the shim returned a heap at::Tensor that tch now owns.
        Ok(unsafe { Tensor::from_ptr(out) })
    }

    /// Megatron's *g*: the sum of `x` over the group; the backward passes gradients through.
    pub fn reduce_from_tensor_region(&self, x: &Tensor) -> Result<Tensor, DistError> {
        // SAFETY: live group and tensor; `o` points at an out-pointer.
        self.autograd_call("reduce_from_tensor_region", |o| unsafe {
            ffi::smp_c10d_reduce_from_tensor_region(self.raw, raw(x), o)
        })
    }

    /// Megatron's *f*: `x` unchanged; the backward sums the gradient over the group.
    pub fn copy_to_tensor_region(&self, x: &Tensor) -> Result<Tensor, DistError> {
        // SAFETY: as above.
        self.autograd_call("copy_to_tensor_region", |o| unsafe {
            ffi::smp_c10d_copy_to_tensor_region(self.raw, raw(x), o)
        })
    }

    /// The members' `x` concatenated along `axis` (group order); the backward keeps this
    /// member's slice of the gradient.
    pub fn gather_along_axis(&self, x: &Tensor, axis: i64) -> Result<Tensor, DistError> {
        // SAFETY: as above.
        self.autograd_call("gather_along_axis", |o| unsafe {
            ffi::smp_c10d_gather_along_axis(self.raw, raw(x), axis, o)
        })
    }

    /// Context parallelism's gather: the members' `x` concatenated along `axis` (group order);
    /// the backward sums the gradient over the group and keeps this member's chunk.
    pub fn context_gather(&self, x: &Tensor, axis: i64) -> Result<Tensor, DistError> {
        // SAFETY: as above.
        self.autograd_call("context_gather", |o| unsafe { ffi::smp_c10d_context_gather(self.raw, raw(x), axis, o) })
    }

    /// [`ProcessGroup::context_gather`] posted without waiting: the all-gather travels while
    /// the caller computes; [`PendingGather::finish`] waits and gives the result. Its backward
    /// likewise posts the reduce-scatter and waits only where autograd reaches `x`'s side of
    /// the gather, after the backward of what ran while the gather travelled.
    pub fn context_gather_start(&self, x: &Tensor, axis: i64) -> Result<PendingGather, DistError> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: live group and tensor; the pending gather keeps what it needs alive.
        let err = unsafe { ffi::smp_c10d_context_gather_start(self.raw, raw(x), axis, &mut p) };
        self.checked("context_gather", err)?;
        if p.is_null() {
            return Err(DistError::Usage("context_gather: no pending gather returned".into()));
        }
        Ok(PendingGather { raw: p })
    }

    /// Sequence parallelism's reduce-scatter: the sum of `x` over the group, this member
    /// keeping its chunk along `axis` (group order); the backward all-gathers the gradient.
    pub fn reduce_scatter_along_axis(&self, x: &Tensor, axis: i64) -> Result<Tensor, DistError> {
        // SAFETY: as above.
        self.autograd_call("reduce_scatter_along_axis", |o| unsafe {
            ffi::smp_c10d_reduce_scatter_along_axis(self.raw, raw(x), axis, o)
        })
    }

    /// Expert parallelism's exchange: the rows (axis 0) of `x`, `send[j]` of them to member j
    /// in order; returns what the members sent this one, `recv[j]` rows from member j in member
    /// order. The backward sends the gradient's rows back the reverse way.
    pub fn all_to_all_rows(&self, x: &Tensor, send: &[i64], recv: &[i64]) -> Result<Tensor, DistError> {
        if send.len() != self.size() || recv.len() != self.size() {
            return Err(DistError::Usage(format!("all_to_all: {} send and {} receive counts for a group of {}", send.len(), recv.len(), self.size())));
        }
        let n = send.len() as i64;
        // SAFETY: live group, tensor and count slices of `n` each; `o` points at an out-pointer.
        self.autograd_call("all_to_all", |o| unsafe { ffi::smp_c10d_all_to_all_rows(self.raw, raw(x), send.as_ptr(), recv.as_ptr(), n, o) })
    }

    /// Sequence parallelism's scatter: this member's chunk along `axis` of a replicated `x`,
    /// without communication; the backward all-gathers the gradient.
    pub fn scatter_along_axis(&self, x: &Tensor, axis: i64) -> Result<Tensor, DistError> {
        // SAFETY: as above.
        self.autograd_call("scatter_along_axis", |o| unsafe {
            ffi::smp_c10d_scatter_along_axis(self.raw, raw(x), axis, o)
        })
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        // SAFETY: created by the shim, freed once.
        unsafe { ffi::smp_c10d_group_free(self.raw) }
    }
}
