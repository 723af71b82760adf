// C ABI for what the runner needs of CUDA beside tch: loading libtorch's CUDA library into a
// binary that does not link it (tch links libtorch_cpu only, so libtorch sees no GPU until
// libtorch_cuda.so is loaded), and making a GPU the process's current device. Needs no CUDA
// headers: both go through libtorch's device-generic interfaces. Every fallible call returns
// nullptr on success or a heap-allocated message (free with smp_device_free_error).

#include <dlfcn.h>

#include <string>

#include <ATen/Context.h>
#include <c10/core/Device.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "shim_error.h"

extern "C" {

void smp_device_free_error(char* e) { std::free(e); }

// Loads libtorch_cuda.so from the directory of the libtorch this binary runs on, when an NVIDIA
// driver is present (libcuda.so.1 loads); else says why not. Must run before anything asks
// libtorch about CUDA: libtorch keeps the first answer.
char* smp_device_load_cuda() {
  if (dlopen("libcuda.so.1", RTLD_LAZY | RTLD_GLOBAL) == nullptr) {
    return smp_shim::message_of("no NVIDIA driver on this machine (libcuda.so.1 does not load)");
  }
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&at::globalContext), &info) == 0 || info.dli_fname == nullptr) {
    return smp_shim::message_of("cannot find the directory of libtorch_cpu.so");
  }
  std::string dir(info.dli_fname);
  auto slash = dir.rfind('/');
  dir = slash == std::string::npos ? std::string(".") : dir.substr(0, slash);
  std::string lib = dir + "/libtorch_cuda.so";
  if (dlopen(lib.c_str(), RTLD_NOW | RTLD_GLOBAL) == nullptr) {
    const char* why = dlerror();
    return smp_shim::message_of("libtorch's CUDA library does not load (" + lib + ": " + (why ? why : "unknown error") +
                                "); this libtorch may be a CPU-only build");
  }
  return nullptr;
}

// Makes CUDA device `index` the current one of this thread (and the default of new ones).
char* smp_device_set_cuda(int index) {
  return smp_shim::guarded([&] {
    auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    impl->setDevice(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(index)));
  });
}

}  // extern "C"
