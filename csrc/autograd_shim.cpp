// C ABI over libtorch for what tch does not expose: a backward pass that accumulates into the
// `.grad` of chosen leaves (torch.autograd.backward(root, inputs=...)), setting or clearing a
// leaf's `.grad`, the fused AdamW update (torch.optim.AdamW(fused=True)), and freeing and
// refilling a tensor's storage in place (FSDP's `untyped_storage().resize_()`). Every call catches C++ exceptions and returns a heap-allocated
// message (free with smp_autograd_free_error) or nullptr on success.
// Tensors are passed as at::Tensor* (tch's C_tensor).

#include <cstdlib>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include "shim_error.h"

extern "C" {

void smp_autograd_free_error(char* e) { std::free(e); }

// Backward from `roots` (each seeded with ones) into the leaves `inputs`: autograd's
// AccumulateGrad adds each fresh gradient into its leaf's `.grad` in place as soon as it is
// produced (or keeps it as the `.grad` when there is none), and computes nothing the inputs do
// not need. `keep_graph` keeps the graph for a later pass.
char* smp_autograd_backward(at::Tensor** roots, int nroots, at::Tensor** inputs, int ninputs, int keep_graph) {
  return smp_shim::guarded([&] {
    std::vector<at::Tensor> rs, seeds, ins;
    for (int i = 0; i < nroots; ++i) {
      rs.push_back(*roots[i]);
      seeds.push_back(at::ones_like(*roots[i]));
    }
    for (int i = 0; i < ninputs; ++i) {
      ins.push_back(*inputs[i]);
    }
    torch::autograd::backward(rs, seeds, keep_graph != 0, false, ins);
  });
}

// Sets `t`'s `.grad` to `g` (the same tensor, not a copy), or clears it when `g` is null.
char* smp_autograd_set_grad(at::Tensor* t, at::Tensor* g) {
  return smp_shim::guarded([&] { t->mutable_grad() = g != nullptr ? *g : at::Tensor(); });
}

// One AdamW update of `n` parameters in place with libtorch's fused kernel, the arithmetic of
// torch.optim.AdamW in one pass over each tensor's memory; `step` counts updates from 1.
char* smp_fused_adamw(at::Tensor** params, at::Tensor** grads, at::Tensor** exp_avgs, at::Tensor** exp_avg_sqs, int n,
                      double lr, double beta1, double beta2, double weight_decay, double eps, int64_t step) {
  return smp_shim::guarded([&] {
    c10::NoGradGuard no_grad;
    std::vector<at::Tensor> ps, gs, ms, vs, steps;
    for (int i = 0; i < n; ++i) {
      ps.push_back(*params[i]);
      gs.push_back(*grads[i]);
      ms.push_back(*exp_avgs[i]);
      vs.push_back(*exp_avg_sqs[i]);
      // the kernel reads each parameter's step count from a float32 scalar, as AdamW keeps it
      steps.push_back(at::full({}, static_cast<double>(step), at::TensorOptions().dtype(at::kFloat).device(params[i]->device())));
    }
    at::_fused_adamw_(ps, gs, ms, vs, {}, steps, lr, beta1, beta2, weight_decay, eps, false, false);
  });
}

// Frees the bytes under `t`'s storage, keeping the storage object: every view of it (autograd's
// saved ones too) stays valid as an object and must not be read until the storage is refilled.
char* smp_storage_free(at::Tensor* t) {
  return smp_shim::guarded([&] {
    c10::StorageImpl* s = t->storage().unsafeGetStorageImpl();
    s->set_data_ptr_noswap(c10::DataPtr(nullptr, s->device()));
    s->set_nbytes(0);
  });
}

// Gives `t`'s storage `nbytes` fresh bytes from the allocator it was made with (contents
// undefined): the views made of it before it was freed read them again.
char* smp_storage_refill(at::Tensor* t, int64_t nbytes) {
  return smp_shim::guarded([&] {
    c10::StorageImpl* s = t->storage().unsafeGetStorageImpl();
    c10::Allocator* a = s->allocator();
    TORCH_CHECK(a != nullptr, "the storage has no allocator to refill it from");
    TORCH_CHECK(nbytes >= 0, "a storage of ", nbytes, " bytes");
    s->set_data_ptr_noswap(a->allocate(static_cast<size_t>(nbytes)));
    s->set_nbytes(static_cast<size_t>(nbytes));
  });
}

// Moves the bytes under `src`'s storage into `dst`'s freed storage, without a copy and without
// touching `dst`'s version counter (autograd's saved references to `dst` read the bytes as
// they were): selective recompute's rebuilt output takes the place of the one it freed. Both
// must be whole tensors of one layout, type and device.
char* smp_storage_take(at::Tensor* dst, at::Tensor* src) {
  return smp_shim::guarded([&] {
    TORCH_CHECK(dst->storage_offset() == 0 && src->storage_offset() == 0, "a rebuilt output must be a whole tensor");
    TORCH_CHECK(dst->sizes() == src->sizes() && dst->strides() == src->strides(), "the rebuilt output's layout ", src->sizes(), " ", src->strides(), " differs from the freed one's ", dst->sizes(), " ", dst->strides());
    TORCH_CHECK(dst->scalar_type() == src->scalar_type() && dst->device() == src->device(), "the rebuilt output's type or device differs from the freed one's");
    c10::StorageImpl* d = dst->storage().unsafeGetStorageImpl();
    c10::StorageImpl* s = src->storage().unsafeGetStorageImpl();
    size_t nbytes = s->nbytes();
    d->set_data_ptr_noswap(s->set_data_ptr(c10::DataPtr(nullptr, s->device())));
    d->set_nbytes(nbytes);
    s->set_nbytes(0);
  });
}

}  // extern "C"
