#include "core/common.hpp"

#include <pthread.h>

#include <cstdio>
#include <vector>

namespace ddp {

const char* dtype_name(Dtype d) {
  switch (d) {
    case Dtype::F16: return "f16";
    case Dtype::BF16: return "bf16";
    case Dtype::F32: return "f32";
    case Dtype::F64: return "f64";
  }
  return "unknown";
}

static std::string vformat(const char* fmt, va_list ap) {
  va_list copy;
  va_copy(copy, ap);
  int n = std::vsnprintf(nullptr, 0, fmt, copy);
  va_end(copy);
  if (n < 0) return fmt;
  std::string out(static_cast<size_t>(n) + 1, '\0');
  std::vsnprintf(&out[0], out.size(), fmt, ap);
  out.resize(static_cast<size_t>(n));
  return out;
}

std::string format(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string s = vformat(fmt, ap);
  va_end(ap);
  return s;
}

void fail(ddp_status_t status, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string s = vformat(fmt, ap);
  va_end(ap);
  throw Error(status, std::move(s));
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

namespace {
thread_local Deadline t_creation = Deadline::never();
}  // namespace

Deadline creation_deadline() { return t_creation; }
CreationScope::CreationScope(Deadline dl) : prev_(t_creation) { t_creation = dl; }
CreationScope::~CreationScope() { t_creation = prev_; }

}  // namespace ddp

namespace ddp {

void name_this_thread(const char* name) {
#if defined(__linux__)
  pthread_setname_np(pthread_self(), name);  // (a failure leaves the process's name: harmless)
#else
  (void)name;
#endif
}

}  // namespace ddp
