// Shared by the C ABI shims: run a call, catching C++ exceptions, and return nullptr on success
// or a heap-allocated message (each shim exports a function that frees it).

#pragma once

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

#include <c10/util/Exception.h>

namespace smp_shim {

inline char* message_of(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out != nullptr) {
    std::memcpy(out, s.c_str(), s.size() + 1);
  }
  return out;
}

template <typename F>
char* guarded(F&& f) {
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

}  // namespace smp_shim
