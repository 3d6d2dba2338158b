// Shared by the shim's translation units: every extern "C" entry point runs its body through
// `guarded`, so no C++ exception unwinds into Rust; the message comes back malloc'd.
#pragma once

#include <cstdlib>
#include <cstring>
#include <exception>

namespace mt {

// Returned when even the error message cannot be allocated: a failure must never read as
// success (nullptr). mt_free_error knows not to free it. The wording classifies as an OOM.
inline char kNoMemoryForMessage[] = "CPU out of memory: the shim could not allocate its error message";

inline char *dup_error(const char *msg) {
  size_t n = std::strlen(msg);
  char *out = static_cast<char *>(std::malloc(n + 1));
  if (!out) return kNoMemoryForMessage;
  std::memcpy(out, msg, n + 1);
  return out;
}

template <typename F> char *guarded(F &&f) {
  try {
    f();
    return nullptr;
  } catch (const std::exception &e) {
    return dup_error(e.what());
  } catch (...) {
    return dup_error("unknown C++ exception");
  }
}

} // namespace mt
