// C ABI over libtorch's autograd for what tch does not expose: a backward pass that accumulates
// into the `.grad` of chosen leaves (torch.autograd.backward(root, inputs=...)), and setting or
// clearing a leaf's `.grad`. Every call catches C++ exceptions and returns a heap-allocated
// message (free with smp_autograd_free_error) or nullptr on success.
// Tensors are passed as at::Tensor* (tch's C_tensor).

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <torch/csrc/autograd/autograd.h>

namespace {

char* message_of(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out != nullptr) {
    std::memcpy(out, s.c_str(), s.size() + 1);
  }
  return out;
}

template <typename F>
char* guarded_autograd(F&& f) {
  try {
    f();
    return nullptr;
  } catch (const c10::Error& e) {
    return message_of(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return message_of(e.what());
  } catch (...) {
    return message_of("unknown C++ exception");
  }
}

}  // namespace

extern "C" {

void smp_autograd_free_error(char* e) { std::free(e); }

// Backward from `roots` (each seeded with ones) into the leaves `inputs`: autograd's
// AccumulateGrad adds each fresh gradient into its leaf's `.grad` in place as soon as it is
// produced (or keeps it as the `.grad` when there is none), and computes nothing the inputs do
// not need. `keep_graph` keeps the graph for a later pass.
char* smp_autograd_backward(at::Tensor** roots, int nroots, at::Tensor** inputs, int ninputs, int keep_graph) {
  return guarded_autograd([&] {
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
  return guarded_autograd([&] { t->mutable_grad() = g != nullptr ? *g : at::Tensor(); });
}

}  // extern "C"
