#include "core/log.hpp"

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

namespace ddp {

namespace {

enum class Debug { Default, Off, Info };

Debug debug_level() {
  static const Debug level = [] {
    const char* v = std::getenv("DDP_DEBUG");
    if (!v || !*v) return Debug::Default;
    if (!strcasecmp(v, "INFO")) return Debug::Info;
    if (!strcasecmp(v, "OFF") || !strcasecmp(v, "NONE")) return Debug::Off;
    return Debug::Default;  // WARN, or anything else: warnings only
  }();
  return level;
}

std::mutex g_mu;  // one message at a time, and the callback with it
ddp_log_fn g_fn = nullptr;
void* g_user = nullptr;

}  // namespace

void set_log_callback(ddp_log_fn fn, void* user) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_fn = fn;
  g_user = user;
}

bool log_enabled(ddp_log_level_t level) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_fn) return level == DDP_LOG_WARN || debug_level() == Debug::Info;
  }
  if (level == DDP_LOG_INFO) return debug_level() == Debug::Info;
  return debug_level() != Debug::Off;
}

void log(ddp_log_level_t level, const char* fmt, ...) {
  if (!log_enabled(level)) return;
  va_list ap;
  va_start(ap, fmt);
  char buf[4096];
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_fn) {
    g_fn(level, buf, g_user);
    return;
  }
  std::fprintf(stderr, "libddp %s: %s\n", level == DDP_LOG_WARN ? "warning" : "info", buf);
  std::fflush(stderr);
}

uint64_t log_summary_every() {
  static const uint64_t every = [] {
    const char* v = std::getenv("DDP_DEBUG_EVERY");
    long long n = v ? std::atoll(v) : 0;
    return n > 0 ? static_cast<uint64_t>(n) : uint64_t(100);
  }();
  return every;
}

}  // namespace ddp
