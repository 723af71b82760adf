// C ABI over libtorch's c10d: TCPStore, PrefixStore subgroups, ProcessGroupGloo (and
// ProcessGroupNCCL with SMP_WITH_NCCL). Every call catches C++ exceptions and returns a
// heap-allocated message (free with smp_c10d_free_error) or nullptr on success.
// Tensors are passed as at::Tensor* (tch's C_tensor).
//
// A group always has a Gloo backend; one made with `nccl` also has an NCCL backend. Each call
// goes by its tensor: a CUDA tensor's collective to NCCL where the group has it, everything
// else to Gloo. Gloo gets CUDA tensors through host copies (copied to the CPU before, results
// copied back after: `--share-gpu`). Point-to-point messages always travel by Gloo, which
// matches them by tag (NCCL matches by order only).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <torch/csrc/autograd/custom_function.h>
#include "shim_error.h"
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef SMP_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace {

struct Store {
  c10::intrusive_ptr<c10d::Store> store;
};

struct Group {
  // CPU tensors, messages, barriers; CUDA tensors through host copies when `nccl` is null.
  c10::intrusive_ptr<c10d::Backend> gloo;
  // CUDA tensors' collectives (groups made with `nccl`, SMP_WITH_NCCL builds).
  c10::intrusive_ptr<c10d::Backend> nccl;
  std::chrono::milliseconds timeout;
  // The members' global ranks (from the group's store prefix `pg/0,1,...`), for naming waits.
  std::vector<std::string> members;

  // `call over ranks [a, b]`: what a wait on this group is, in words.
  std::string over(const char* call) const {
    std::string s = std::string(call) + " over ranks [";
    for (size_t i = 0; i < members.size(); ++i) s += (i ? ", " : "") + members[i];
    return s + "]";
  }
  // The global rank of member `i`.
  std::string member(int i) const {
    return i >= 0 && static_cast<size_t>(i) < members.size() ? members[i] : "member " + std::to_string(i);
  }
};

struct Work {
  c10::intrusive_ptr<c10d::Work> work;
  std::chrono::milliseconds timeout;
  // What waiting on it is (`recv from rank 3`).
  std::string what;
  // A receive staged through host memory: `host` lands, then is copied into `target`.
  at::Tensor host;
  at::Tensor target;
};

// Whether a collective on `t` goes to NCCL.
bool by_nccl(const Group* g, const at::Tensor& t) { return g->nccl && t.is_cuda(); }

// The backend for a collective on `t`.
c10d::Backend& backend_for(const Group* g, const at::Tensor& t) { return by_nccl(g, t) ? *g->nccl : *g->gloo; }

// What Gloo reads or writes for `t`: `t` itself, or a CPU copy of a CUDA tensor.
at::Tensor host_of(const Group* g, const at::Tensor& t) { return (t.is_cuda() && !by_nccl(g, t)) ? t.to(at::kCPU).contiguous() : t; }

// Copies a host stand-in back into the tensor it stood for.
void land(const at::Tensor& host, at::Tensor& t) {
  if (!host.is_same(t)) t.copy_(host);
}

using smp_shim::guarded;

// Nanoseconds this process spent waiting on c10d work, from any thread (autograd's
// backward collectives included).
std::atomic<int64_t> g_wait_ns{0};

// The wait in progress, for a heartbeat to report: how many threads wait, since when (steady
// clock, ns) the first of them does, and what the latest waits on.
std::atomic<int> g_waiters{0};
std::atomic<int64_t> g_waiting_since{0};
std::mutex g_waiting_mu;
std::string g_waiting_what;

int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void wait_or_throw(const c10::intrusive_ptr<c10d::Work>& w, std::chrono::milliseconds timeout, const std::string& what) {
  auto t0 = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(g_waiting_mu);
    g_waiting_what = what;
    if (g_waiters++ == 0) g_waiting_since = steady_ns();
  }
  bool done = false;
  try {
    done = w->wait(timeout);
  } catch (...) {
    std::lock_guard<std::mutex> lock(g_waiting_mu);
    if (--g_waiters == 0) g_waiting_since = 0;
    throw;
  }
  {
    std::lock_guard<std::mutex> lock(g_waiting_mu);
    if (--g_waiters == 0) g_waiting_since = 0;
  }
  if (!done) {
    g_wait_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    throw std::runtime_error("timed out after " + std::to_string(timeout.count()) + " ms");
  }
  // Gloo's worker thread marks the work done, then drops its own references to it (and so to
  // the tensors it was given) when it next runs: on a busy machine several collectives later.
  // Wait for it to let go (every caller holds one reference), so what the process holds after
  // a collective does not depend on when that thread is scheduled; bounded, never a hang.
  auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(5);
  while (w.use_count() > 1 && std::chrono::steady_clock::now() < until) std::this_thread::yield();
  g_wait_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
}

void all_reduce_in_place(Group* grp, at::Tensor& t) {
  auto h = host_of(grp, t);
  std::vector<at::Tensor> ts{h};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  wait_or_throw(backend_for(grp, t).allreduce(ts, opts), grp->timeout, grp->over("all_reduce"));
  land(h, t);
}

Group* group_of(torch::autograd::AutogradContext* ctx) {
  return reinterpret_cast<Group*>(ctx->saved_data["group"].toInt());
}

// Megatron's g: forward sums over the tensor group, backward passes the gradient through.
struct ReduceFromTensorRegion : public torch::autograd::Function<ReduceFromTensorRegion> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    (void)ctx;
    auto out = x.clone(at::MemoryFormat::Contiguous);
    all_reduce_in_place(reinterpret_cast<Group*>(group), out);
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    (void)ctx;
    return {grads[0], at::Tensor()};
  }
};

// Megatron's f: forward passes through, backward sums the gradient over the tensor group.
struct CopyToTensorRegion : public torch::autograd::Function<CopyToTensorRegion> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    return x;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    auto g = grads[0].clone(at::MemoryFormat::Contiguous);
    all_reduce_in_place(group_of(ctx), g);
    return {g, at::Tensor()};
  }
};

// The members' `x` concatenated along `axis`, member order.
at::Tensor all_gather_cat(Group* grp, const at::Tensor& x, int64_t axis) {
  int64_t size = grp->gloo->getSize();
  auto in = host_of(grp, x.contiguous());
  std::vector<at::Tensor> parts;
  for (int64_t i = 0; i < size; ++i) parts.push_back(at::empty_like(in));
  std::vector<std::vector<at::Tensor>> outs{parts};
  std::vector<at::Tensor> ins{in};
  wait_or_throw(backend_for(grp, x).allgather(outs, ins), grp->timeout, grp->over("all_gather"));
  return at::cat(outs[0], axis).to(x.device());
}

void check_divides(Group* grp, const at::Tensor& x, int64_t axis, const char* what) {
  int64_t size = grp->gloo->getSize();
  if (axis < 0 || axis >= x.dim() || x.size(axis) % size != 0) {
    throw std::runtime_error(std::string(what) + ": axis " + std::to_string(axis) + " of a tensor with " +
                             std::to_string(x.dim()) + " axes does not split " + std::to_string(size) + " ways");
  }
}

// This member's chunk of `len` along `axis`.
at::Tensor own_chunk(Group* grp, const at::Tensor& x, int64_t axis, int64_t len) {
  return x.narrow(axis, grp->gloo->getRank() * len, len).contiguous();
}

// The sum of `x` over the members, this member keeping its chunk along `axis`.
at::Tensor reduce_scatter_sum(Group* grp, const at::Tensor& x, int64_t axis) {
  int64_t size = grp->gloo->getSize();
  std::vector<std::vector<at::Tensor>> ins(1);
  // One copy per chunk: Gloo may write into its inputs, so they never alias `x`.
  for (auto& c : x.chunk(size, axis)) ins[0].push_back(host_of(grp, c.clone(at::MemoryFormat::Contiguous)));
  auto out = at::empty_like(ins[0][grp->gloo->getRank()]);
  std::vector<at::Tensor> outs{out};
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  wait_or_throw(backend_for(grp, x).reduce_scatter(outs, ins, opts), grp->timeout, grp->over("reduce_scatter"));
  return out.to(x.device());
}

// Backward of a split along the saved `axis`: the members' gradients gathered back.
torch::autograd::variable_list gathered_grad(torch::autograd::AutogradContext* ctx, const torch::autograd::variable_list& grads) {
  return {all_gather_cat(group_of(ctx), grads[0], ctx->saved_data["axis"].toInt()), at::Tensor(), at::Tensor()};
}

// Sequence parallelism's reduce-scatter: the sum over the members, each keeping its chunk
// along `axis`; backward all-gathers the gradient along `axis`.
struct ReduceScatterAlongAxis : public torch::autograd::Function<ReduceScatterAlongAxis> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t group, int64_t axis) {
    auto* grp = reinterpret_cast<Group*>(group);
    check_divides(grp, x, axis, "reduce_scatter_along_axis");
    ctx->saved_data["group"] = group;
    ctx->saved_data["axis"] = axis;
    return reduce_scatter_sum(grp, x, axis);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    return gathered_grad(ctx, grads);
  }
};

// Sequence parallelism's scatter: this member's chunk along `axis` of a replicated tensor, no
// communication; backward all-gathers the gradient along `axis`.
struct ScatterAlongAxis : public torch::autograd::Function<ScatterAlongAxis> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t group, int64_t axis) {
    auto* grp = reinterpret_cast<Group*>(group);
    check_divides(grp, x, axis, "scatter_along_axis");
    ctx->saved_data["group"] = group;
    ctx->saved_data["axis"] = axis;
    int64_t len = x.size(axis) / grp->gloo->getSize();
    return x.narrow(axis, grp->gloo->getRank() * len, len).clone(at::MemoryFormat::Contiguous);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    return gathered_grad(ctx, grads);
  }
};

// Concatenation of the members' tensors along `axis`; backward keeps this member's slice.
struct GatherAlongAxis : public torch::autograd::Function<GatherAlongAxis> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t group, int64_t axis) {
    auto* grp = reinterpret_cast<Group*>(group);
    ctx->saved_data["group"] = group;
    ctx->saved_data["axis"] = axis;
    ctx->saved_data["len"] = x.size(axis);
    return all_gather_cat(grp, x, axis);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    auto* grp = group_of(ctx);
    int64_t axis = ctx->saved_data["axis"].toInt();
    int64_t len = ctx->saved_data["len"].toInt();
    return {own_chunk(grp, grads[0], axis, len), at::Tensor(), at::Tensor()};
  }
};

// Context parallelism's gather: the members' tensors concatenated along `axis` (member
// order); backward sums the gradient over the members, each keeping its chunk (a
// reduce-scatter), since every member's loss reads every member's tokens.
struct ContextGather : public torch::autograd::Function<ContextGather> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t group, int64_t axis) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["axis"] = axis;
    return all_gather_cat(reinterpret_cast<Group*>(group), x, axis);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    auto* grp = group_of(ctx);
    int64_t axis = ctx->saved_data["axis"].toInt();
    check_divides(grp, grads[0], axis, "context_gather backward");
    return {reduce_scatter_sum(grp, grads[0], axis), at::Tensor(), at::Tensor()};
  }
};

// Where a context gather's backward leaves its reduce-scatter in flight, for the `GradWait`
// node upstream of the gather to wait on (see `ContextGatherAsync`).
struct ScatterSlot : torch::CustomClassHolder {
  c10::intrusive_ptr<c10d::Work> work;
  // What lands (host memory for a CUDA tensor over Gloo), and the gradient's device.
  at::Tensor out;
  at::Device device = at::kCPU;
  Group* grp = nullptr;
};

c10::intrusive_ptr<ScatterSlot> slot_of(torch::autograd::AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<ScatterSlot>(ctx->saved_data["slot"].toCapsule());
}

// Identity forward; backward returns the reduce-scatter the gather's backward left in `slot`
// (waited for here), or the gradient as it came when none was left. Made when the gather is
// posted, before the ops that run while it is in flight, so autograd runs their backward
// (later sequence numbers go first) while the reduce-scatter travels.
struct GradWait : public torch::autograd::Function<GradWait> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, c10::intrusive_ptr<ScatterSlot> slot) {
    ctx->saved_data["slot"] = c10::IValue::make_capsule(slot);
    return x;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    auto slot = slot_of(ctx);
    if (!slot->work) return {grads[0], at::Tensor()};
    wait_or_throw(slot->work, slot->grp->timeout, slot->grp->over("reduce_scatter"));
    auto g = slot->out.to(slot->device);
    slot->work.reset();
    slot->out = at::Tensor();
    return {g, at::Tensor()};
  }
};

// A context gather posted and not yet waited for: the members' parts land in `parts`; `x`
// (the input behind a GradWait) is what autograd connects the result to.
struct PendingGather {
  Group* grp;
  c10::intrusive_ptr<c10d::Work> work;
  std::vector<at::Tensor> parts;
  at::Tensor x;
  int64_t axis;
  c10::intrusive_ptr<ScatterSlot> slot;
};

// ContextGather whose all-gather was posted earlier (`smp_c10d_context_gather_start`): forward
// waits for it and concatenates the parts; backward posts the reduce-scatter without waiting,
// leaves it in the slot for GradWait, and passes a zero placeholder of the chunk's shape.
struct ContextGatherAsync : public torch::autograd::Function<ContextGatherAsync> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t pending) {
    auto* p = reinterpret_cast<PendingGather*>(pending);
    wait_or_throw(p->work, p->grp->timeout, p->grp->over("all_gather"));
    ctx->saved_data["group"] = reinterpret_cast<int64_t>(p->grp);
    ctx->saved_data["axis"] = p->axis;
    ctx->saved_data["slot"] = c10::IValue::make_capsule(p->slot);
    return at::cat(p->parts, p->axis).to(x.device());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    auto* grp = group_of(ctx);
    int64_t axis = ctx->saved_data["axis"].toInt();
    auto slot = slot_of(ctx);
    const auto& g = grads[0];
    check_divides(grp, g, axis, "context_gather backward");
    int64_t size = grp->gloo->getSize();
    std::vector<std::vector<at::Tensor>> ins(1);
    for (auto& c : g.chunk(size, axis)) ins[0].push_back(host_of(grp, c.clone(at::MemoryFormat::Contiguous)));
    auto out = at::empty_like(ins[0][grp->gloo->getRank()]);
    std::vector<at::Tensor> outs{out};
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    slot->work = backend_for(grp, g).reduce_scatter(outs, ins, opts);
    slot->out = out;
    slot->device = g.device();
    slot->grp = grp;
    auto shape = g.sizes().vec();
    shape[axis] /= size;
    return {at::zeros({}, g.options()).expand(shape), at::Tensor()};
  }
};

// The rows (axis 0) of `x`, `send[j]` of them to member j in order; what the members send this
// one, `recv[j]` rows from member j, concatenated in member order (Gloo's alltoall_base with
// split sizes: counts per member, no padding).
at::Tensor all_to_all_rows(Group* grp, const at::Tensor& x, std::vector<int64_t> send, std::vector<int64_t> recv) {
  int64_t size = grp->gloo->getSize();
  if (static_cast<int64_t>(send.size()) != size || static_cast<int64_t>(recv.size()) != size) {
    throw std::runtime_error("all_to_all: " + std::to_string(send.size()) + " send and " + std::to_string(recv.size()) +
                             " receive counts for a group of " + std::to_string(size));
  }
  int64_t sent = 0, total = 0;
  for (auto c : send) sent += c;
  for (auto c : recv) total += c;
  if (x.dim() < 1 || x.size(0) != sent) {
    throw std::runtime_error("all_to_all: the send counts sum to " + std::to_string(sent) + " rows, the tensor has " +
                             (x.dim() < 1 ? std::string("no rows") : std::to_string(x.size(0))));
  }
  auto in = host_of(grp, x.contiguous());
  auto shape = in.sizes().vec();
  shape[0] = total;
  auto out = at::empty(shape, in.options());
  c10d::AllToAllOptions opts;
  wait_or_throw(backend_for(grp, x).alltoall_base(out, in, recv, send, opts), grp->timeout, grp->over("all_to_all"));
  return out.to(x.device());
}

// Expert parallelism's exchange: rows of `x` to the members by `send`, `recv` rows back from
// each; the backward sends the gradient's rows back the reverse way (counts swapped).
struct AllToAllRows : public torch::autograd::Function<AllToAllRows> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t group, std::vector<int64_t> send,
                            std::vector<int64_t> recv) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["send"] = send;
    ctx->saved_data["recv"] = recv;
    return all_to_all_rows(reinterpret_cast<Group*>(group), x, send, recv);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    auto send = ctx->saved_data["send"].toIntVector();
    auto recv = ctx->saved_data["recv"].toIntVector();
    return {all_to_all_rows(group_of(ctx), grads[0], recv, send), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Posts the all-gather of `input` into `out` (or its host stand-in `h_out`, which it sets).
c10::intrusive_ptr<c10d::Work> post_all_gather(Group* grp, at::Tensor& out, const at::Tensor& input, at::Tensor& h_out) {
  h_out = host_of(grp, out);
  std::vector<std::vector<at::Tensor>> outs(1);
  for (auto& p : h_out.reshape({-1}).chunk(grp->gloo->getSize())) outs[0].push_back(p);
  std::vector<at::Tensor> ins{host_of(grp, input).reshape({-1})};
  return backend_for(grp, out).allgather(outs, ins);
}

}  // namespace

extern "C" {

void smp_c10d_free_error(char* e) { std::free(e); }

int64_t smp_c10d_wait_ns() { return g_wait_ns.load(); }

// Whether some thread waits on c10d work now: then `buf` (of `cap` bytes) gets what it waits on,
// NUL-terminated and cut to fit, and `*waited_ns` how long the wait has lasted.
int smp_c10d_waiting(char* buf, int cap, int64_t* waited_ns) {
  std::lock_guard<std::mutex> lock(g_waiting_mu);
  int64_t since = g_waiting_since.load();
  if (g_waiters.load() == 0 || since == 0) return 0;
  *waited_ns = steady_ns() - since;
  if (cap > 0) {
    size_t n = std::min(g_waiting_what.size(), static_cast<size_t>(cap - 1));
    std::memcpy(buf, g_waiting_what.data(), n);
    buf[n] = 0;
  }
  return 1;
}

char* smp_c10d_store_new(const char* host, uint16_t port, int is_server, int world, int64_t timeout_ms, void** out) {
  return guarded([&] {
    c10d::TCPStoreOptions opts;
    opts.port = port;
    opts.isServer = is_server != 0;
    opts.numWorkers = world;
    opts.waitWorkers = false;
    opts.timeout = std::chrono::milliseconds(timeout_ms);
    auto store = c10::make_intrusive<c10d::TCPStore>(std::string(host), opts);
    *out = new Store{store};
  });
}

void smp_c10d_store_free(void* s) { delete static_cast<Store*>(s); }

// A process group over `size` members; `rank` is this process's index in it. Members build it
// with the same `prefix`, under which its keys live in the store. Gloo binds the interfaces
// named in `gloo_ifaces` (comma-separated, as GLOO_SOCKET_IFNAME) if any, else `gloo_host`.
// With `nccl`, the group also gets an NCCL backend for its CUDA tensors' collectives.
char* smp_c10d_group_new(void* store, const char* prefix, int rank, int size, int64_t timeout_ms, int nccl,
                         const char* gloo_ifaces, const char* gloo_host, void** out) {
  return guarded([&] {
    auto base = static_cast<Store*>(store)->store;
    auto timeout = std::chrono::milliseconds(timeout_ms);
    c10::intrusive_ptr<c10d::Backend> nccl_backend;
    if (nccl != 0) {
#ifdef SMP_WITH_NCCL
      auto opts = c10d::ProcessGroupNCCL::Options::create();
      opts->timeout = timeout;
      // its own keys: the Gloo backend's live under the group's prefix
      auto keys = c10::make_intrusive<c10d::PrefixStore>(std::string(prefix) + "/nccl", base);
      nccl_backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(keys, rank, size, opts);
#else
      throw std::runtime_error("this build has no NCCL (build with feature `cuda`)");
#endif
    }
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), base);
    auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
    std::string ifaces(gloo_ifaces);
    size_t start = 0;
    while (start < ifaces.size()) {
      size_t end = ifaces.find(',', start);
      if (end == std::string::npos) end = ifaces.size();
      if (end > start) opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifaces.substr(start, end - start)));
      start = end + 1;
    }
    if (opts->devices.empty()) opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(std::string(gloo_host)));
    // Two workers, as torch.distributed: with one, each collective waits milliseconds more
    // (measured: a 1 MiB all-reduce between compute bursts, 2 local ranks).
    opts->threads = 2;
    auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank, size, opts);
    std::vector<std::string> members;
    std::string names(prefix);
    names = names.substr(names.find('/') == std::string::npos ? 0 : names.find('/') + 1);
    for (size_t at = 0; at < names.size();) {
      size_t end = names.find(',', at);
      if (end == std::string::npos) end = names.size();
      members.push_back(names.substr(at, end - at));
      at = end + 1;
    }
    *out = new Group{gloo, nccl_backend, timeout, members};
  });
}

void smp_c10d_group_free(void* g) { delete static_cast<Group*>(g); }

// Whether the group sends CUDA tensors' collectives through NCCL.
int smp_c10d_group_has_nccl(void* g) { return static_cast<Group*>(g)->nccl ? 1 : 0; }

char* smp_c10d_all_reduce_sum(void* g, at::Tensor* t) {
  return guarded([&] { all_reduce_in_place(static_cast<Group*>(g), *t); });
}

// `out` holds size × numel(input), member i's input at block i.
char* smp_c10d_all_gather(void* g, at::Tensor* out, at::Tensor* input) {
  return guarded([&] {
    auto* grp = static_cast<Group*>(g);
    at::Tensor h_out;
    wait_or_throw(post_all_gather(grp, *out, *input, h_out), grp->timeout, grp->over("all_gather"));
    land(h_out, *out);
  });
}

// Starts an all-gather of `input` into `out` (as smp_c10d_all_gather) and returns at once: the
// Work, waited for, lands it (a CUDA tensor Gloo gathers is staged through host memory).
char* smp_c10d_all_gather_start(void* g, at::Tensor* out, at::Tensor* input, void** work) {
  return guarded([&] {
    auto* grp = static_cast<Group*>(g);
    at::Tensor h_out;
    auto w = post_all_gather(grp, *out, *input, h_out);
    *work = new Work{w, grp->timeout, grp->over("all_gather"), h_out, h_out.is_same(*out) ? at::Tensor() : *out};
  });
}

// Sums `input` (size × numel(out)) over members; member i receives block i.
char* smp_c10d_reduce_scatter_sum(void* g, at::Tensor* out, at::Tensor* input) {
  return guarded([&] {
    auto* grp = static_cast<Group*>(g);
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    auto h_out = host_of(grp, *out);
    std::vector<at::Tensor> outs{h_out.reshape({-1})};
    std::vector<std::vector<at::Tensor>> ins(1);
    auto parts = host_of(grp, *input).reshape({-1}).chunk(grp->gloo->getSize());
    for (auto& p : parts) ins[0].push_back(p);
    wait_or_throw(backend_for(grp, *out).reduce_scatter(outs, ins, opts), grp->timeout, grp->over("reduce_scatter"));
    land(h_out, *out);
  });
}

char* smp_c10d_broadcast(void* g, at::Tensor* t, int root) {
  return guarded([&] {
    auto* grp = static_cast<Group*>(g);
    auto h = host_of(grp, *t);
    std::vector<at::Tensor> ts{h};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    wait_or_throw(backend_for(grp, *t).broadcast(ts, opts), grp->timeout, grp->over("broadcast"));
    land(h, *t);
  });
}

char* smp_c10d_barrier(void* g) {
  return guarded([&] {
    auto* grp = static_cast<Group*>(g);
    wait_or_throw(grp->gloo->barrier(), grp->timeout, grp->over("barrier"));
  });
}

// Messages travel by Gloo: a CUDA tensor is copied to the host when posted (the copy is what the
// Work keeps alive).
char* smp_c10d_isend(void* g, at::Tensor* t, int dst, int tag, void** work) {
  return guarded([&] {
    auto* grp = static_cast<Group*>(g);
    auto h = t->is_cuda() ? t->to(at::kCPU).contiguous() : *t;
    std::vector<at::Tensor> ts{h};
    *work = new Work{grp->gloo->send(ts, dst, tag), grp->timeout, "send to rank " + grp->member(dst), h, at::Tensor()};
  });
}

// A CUDA tensor receives into a host buffer, copied into it when the Work is waited for.
char* smp_c10d_irecv(void* g, at::Tensor* t, int src, int tag, void** work) {
  return guarded([&] {
    auto* grp = static_cast<Group*>(g);
    auto h = t->is_cuda() ? at::empty(t->sizes(), t->options().device(at::kCPU)) : *t;
    std::vector<at::Tensor> ts{h};
    *work = new Work{grp->gloo->recv(ts, src, tag), grp->timeout, "recv from rank " + grp->member(src), h, t->is_cuda() ? *t : at::Tensor()};
  });
}

char* smp_c10d_work_wait(void* w) {
  return guarded([&] {
    auto* work = static_cast<Work*>(w);
    wait_or_throw(work->work, work->timeout, work->what);
    if (work->target.defined()) work->target.copy_(work->host);
  });
}

void smp_c10d_work_free(void* w) { delete static_cast<Work*>(w); }

// Whether the work has finished (without waiting; an error is reported by the wait).
int smp_c10d_work_done(void* w) { return static_cast<Work*>(w)->work->isCompleted() ? 1 : 0; }

// Autograd-aware tensor-parallel collectives; `*out` is a new at::Tensor (tch takes it).
char* smp_c10d_reduce_from_tensor_region(void* g, at::Tensor* x, at::Tensor** out) {
  return guarded([&] {
    *out = new at::Tensor(ReduceFromTensorRegion::apply(*x, reinterpret_cast<int64_t>(g)));
  });
}

char* smp_c10d_copy_to_tensor_region(void* g, at::Tensor* x, at::Tensor** out) {
  return guarded([&] {
    *out = new at::Tensor(CopyToTensorRegion::apply(*x, reinterpret_cast<int64_t>(g)));
  });
}

char* smp_c10d_gather_along_axis(void* g, at::Tensor* x, int64_t axis, at::Tensor** out) {
  return guarded([&] {
    *out = new at::Tensor(GatherAlongAxis::apply(*x, reinterpret_cast<int64_t>(g), axis));
  });
}

char* smp_c10d_context_gather(void* g, at::Tensor* x, int64_t axis, at::Tensor** out) {
  return guarded([&] {
    *out = new at::Tensor(ContextGather::apply(*x, reinterpret_cast<int64_t>(g), axis));
  });
}

// Posts context parallelism's gather of `x` along `axis` and returns at once; `*pending` is
// waited for by smp_c10d_context_gather_finish (or dropped by smp_c10d_pending_gather_free).
char* smp_c10d_context_gather_start(void* g, at::Tensor* x, int64_t axis, void** pending) {
  return guarded([&] {
    auto* grp = static_cast<Group*>(g);
    auto slot = c10::make_intrusive<ScatterSlot>();
    slot->grp = grp;
    auto waited = GradWait::apply(*x, slot);
    int64_t size = grp->gloo->getSize();
    auto in = host_of(grp, waited.detach().contiguous());
    std::vector<at::Tensor> parts;
    for (int64_t i = 0; i < size; ++i) parts.push_back(at::empty_like(in));
    std::vector<std::vector<at::Tensor>> outs{parts};
    std::vector<at::Tensor> ins{in};
    auto work = backend_for(grp, *x).allgather(outs, ins);
    *pending = new PendingGather{grp, work, parts, waited, axis, slot};
  });
}

// Waits for a posted gather; `*out` is its result, the members' tensors along the axis, whose
// backward is the reduce-scatter (overlapped, see ContextGatherAsync). Frees `pending`.
char* smp_c10d_context_gather_finish(void* pending, at::Tensor** out) {
  std::unique_ptr<PendingGather> p(static_cast<PendingGather*>(pending));
  return guarded([&] {
    *out = new at::Tensor(ContextGatherAsync::apply(p->x, reinterpret_cast<int64_t>(p.get())));
  });
}

void smp_c10d_pending_gather_free(void* pending) { delete static_cast<PendingGather*>(pending); }

char* smp_c10d_reduce_scatter_along_axis(void* g, at::Tensor* x, int64_t axis, at::Tensor** out) {
  return guarded([&] {
    *out = new at::Tensor(ReduceScatterAlongAxis::apply(*x, reinterpret_cast<int64_t>(g), axis));
  });
}

char* smp_c10d_scatter_along_axis(void* g, at::Tensor* x, int64_t axis, at::Tensor** out) {
  return guarded([&] {
    *out = new at::Tensor(ScatterAlongAxis::apply(*x, reinterpret_cast<int64_t>(g), axis));
  });
}

char* smp_c10d_all_to_all_rows(void* g, at::Tensor* x, const int64_t* send, const int64_t* recv, int64_t n, at::Tensor** out) {
  return guarded([&] {
    std::vector<int64_t> s(send, send + n), r(recv, recv + n);
    *out = new at::Tensor(AllToAllRows::apply(*x, reinterpret_cast<int64_t>(g), s, r));
  });
}

}  // extern "C"
