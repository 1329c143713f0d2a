#include "core/knobs.hpp"

#include <cerrno>
#include <cstdlib>
#include <mutex>
#include <set>

#include "core/common.hpp"
#include "core/log.hpp"

namespace ddp {
namespace knobs {

namespace {

// A numeric knob: its value within range, or (warned once per name and value) its default.
int64_t integer(const char* name, int64_t lo, int64_t hi, int64_t fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  int64_t x = 0;
  if (parse_integer(v, lo, hi, &x)) return x;
  static std::mutex mu;
  static std::set<std::string>* warned = new std::set<std::string>();  // reachable, never destroyed
  bool first;
  {
    std::lock_guard<std::mutex> lock(mu);
    first = warned->insert(std::string(name) + "=" + v).second;
  }
  if (first) log(DDP_LOG_WARN, "%s", bad_value_message(name, v, lo, hi, fallback).c_str());
  return fallback;
}

}  // namespace

bool parse_integer(const char* value, int64_t lo, int64_t hi, int64_t* out) {
  if (!value || !*value) return false;
  if (!(*value == '-' || (*value >= '0' && *value <= '9'))) return false;  // strtoll would skip spaces
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(value, &end, 10);
  if (errno != 0 || end == value || *end != '\0' || x < lo || x > hi) return false;
  *out = x;
  return true;
}

std::string bad_value_message(const char* name, const char* value, int64_t lo, int64_t hi, int64_t fallback) {
  return format("%s='%s' is not an integer in %lld..%lld; using %lld", name, value, static_cast<long long>(lo),
                static_cast<long long>(hi), static_cast<long long>(fallback));
}

size_t host_piece_bytes() {
  return static_cast<size_t>(integer("DDP_HOST_PIECE_BYTES", 4096, int64_t(1) << 40, int64_t(4) << 20));
}

int int8_scatter_min_world() { return static_cast<int>(integer("DDP_INT8_SCATTER_MIN_WORLD", 1, int64_t(1) << 31, 3)); }

uint64_t debug_every() {
  static const uint64_t every = static_cast<uint64_t>(integer("DDP_DEBUG_EVERY", 1, int64_t(1) << 62, 100));
  return every;
}

int64_t init_timeout_ms() {
  const char* v = std::getenv("DDP_INIT_TIMEOUT_MS");
  if (!v || !*v) return 300000;
  int64_t ms = 0;
  if (!parse_integer(v, 0, int64_t(1) << 62, &ms))
    fail(DDP_ERR_INVALID_ARGUMENT, "DDP_INIT_TIMEOUT_MS is '%s': give milliseconds, 0 for no bound", v);
  return ms;
}

int store_port(int master_port) {
  const char* v = std::getenv("DDP_STORE_PORT");
  if (!v || !*v) {
    if (master_port + 1 > 65535)
      fail(DDP_ERR_INVALID_ARGUMENT,
           "MASTER_PORT=%d: the env:// store listens on MASTER_PORT + 1 = %d, outside 1..65535; choose a "
           "MASTER_PORT of at most 65534, or name the store's port with DDP_STORE_PORT",
           master_port, master_port + 1);
    return master_port + 1;
  }
  int64_t port = 0;
  if (!parse_integer(v, 1, 65535, &port))
    fail(DDP_ERR_INVALID_ARGUMENT, "DDP_STORE_PORT='%s' is not a port (1..65535): the env:// store listens there", v);
  return static_cast<int>(port);
}

int port(const char* what, const char* value) {
  int64_t p = 0;
  if (!parse_integer(value, 1, 65535, &p))
    fail(DDP_ERR_INVALID_ARGUMENT, "%s='%s' is not a port: expected an integer in 1..65535", what, value ? value : "");
  return static_cast<int>(p);
}

std::string job_id() {
  const char* v = std::getenv("DDP_JOB_ID");
  if (v && *v) return v;
  return text("TORCHELASTIC_RUN_ID");
}

int64_t init_progress_ms() { return integer("DDP_INIT_PROGRESS_MS", 0, int64_t(1) << 62, 5000); }

bool store_external() { return integer("DDP_STORE_EXTERNAL", 0, 1, 0) != 0; }

bool host_simd() { return integer("DDP_HOST_SIMD", 0, 1, 1) != 0; }

std::string text(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

void wire_knobs(WireKnob out[kNumWireKnobs]) {
  out[0] = WireKnob{"DDP_HOST_PIECE_BYTES", static_cast<int64_t>(host_piece_bytes())};
  out[1] = WireKnob{"DDP_INT8_SCATTER_MIN_WORLD", static_cast<int64_t>(int8_scatter_min_world())};
}

}  // namespace knobs
}  // namespace ddp
