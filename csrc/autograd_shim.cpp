// C ABI over libtorch's autograd for what tch does not expose: a backward pass that accumulates
// into the `.grad` of chosen leaves (torch.autograd.backward(root, inputs=...)), and setting or
// clearing a leaf's `.grad`. Every call catches C++ exceptions and returns a heap-allocated
// message (free with smp_autograd_free_error) or nullptr on success.
// Tensors are passed as at::Tensor* (tch's C_tensor).

#include <cstdlib>
#include <vector>

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

}  // extern "C"
