// The library's one voice: messages to the caller's callback, or to stderr as DDP_DEBUG allows.
#include "core/log.hpp"

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

namespace ddp {

namespace {

struct DebugSetting {
  DebugLevel level = DebugLevel::Warn;
  bool known = true;
  std::string value;
};

const DebugSetting& debug_setting() {
  static const DebugSetting s = [] {
    DebugSetting d;
    const char* v = std::getenv("DDP_DEBUG");  // read here: the knobs warn through this log
    d.value = v ? v : "";
    d.known = parse_debug_level(d.value.c_str(), &d.level);
    return d;
  }();
  return s;
}

std::atomic<bool> g_unknown_warned{false};

// DDP_DEBUG's level. The first call with a value the library does not know warns, once per process
// (after the setting is made: the warning itself asks for the level).
DebugLevel debug_level() {
  const DebugSetting& s = debug_setting();
  if (!s.known && !g_unknown_warned.exchange(true)) log(DDP_LOG_WARN, "%s", unknown_debug_message(s.value).c_str());
  return s.level;
}

std::mutex g_mu;  // one message at a time, and the callback with it
ddp_log_fn g_fn = nullptr;
void* g_user = nullptr;

}  // namespace

bool parse_debug_level(const char* value, DebugLevel* level) {
  *level = DebugLevel::Warn;
  if (!value || !*value) return true;
  if (!strcasecmp(value, "INFO")) {
    *level = DebugLevel::Info;
  } else if (!strcasecmp(value, "OFF") || !strcasecmp(value, "NONE")) {
    *level = DebugLevel::Off;
  } else if (strcasecmp(value, "WARN") && strcasecmp(value, "WARNING")) {
    return false;
  }
  return true;
}

std::string unknown_debug_message(const std::string& value) {
  return "DDP_DEBUG='" + value +
         "' is not a value libddp knows, so it logs warnings only (the default). Accepted, in any case: "
         "INFO (warnings, each plan, a summary every DDP_DEBUG_EVERY iterations), WARN or WARNING (warnings "
         "only), OFF or NONE (nothing on stderr; a log callback still gets warnings)";
}

void set_log_callback(ddp_log_fn fn, void* user) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_fn = fn;
  g_user = user;
}

bool log_enabled(ddp_log_level_t level) {
  const DebugLevel d = debug_level();  // outside the lock: it may log the unknown-value warning
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_fn) return level == DDP_LOG_WARN || d == DebugLevel::Info;
  }
  if (level == DDP_LOG_INFO) return d == DebugLevel::Info;
  return d != DebugLevel::Off;
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

}  // namespace ddp
