// Shared vocabulary of the implementation: dtypes, the typed error every layer throws, deadlines.
// Nothing here knows about CUDA, NCCL or MPI.
#pragma once

#include <chrono>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "ddp.h"

namespace ddp {

enum class Dtype : int { F16 = DDP_F16, BF16 = DDP_BF16, F32 = DDP_F32, F64 = DDP_F64 };
constexpr int kNumDtypes = DDP_DTYPE_COUNT;

inline size_t dtype_size(Dtype d) {
  switch (d) {
    case Dtype::F16:
    case Dtype::BF16: return 2;
    case Dtype::F32: return 4;
    case Dtype::F64: return 8;
  }
  return 0;
}
inline bool is_16bit(Dtype d) { return d == Dtype::F16 || d == Dtype::BF16; }
const char* dtype_name(Dtype d);
inline bool dtype_valid(int d) { return d >= 0 && d < kNumDtypes; }

// The integer a caller passed for a C enum. C allows any int there, but loading a value outside the
// enumerators' range as the C++ enum type is undefined behaviour, so it is read as bytes.
template <class E>
inline int enum_value(const E& e) {
  typename std::underlying_type<E>::type v;
  std::memcpy(&v, &e, sizeof v);
  return static_cast<int>(v);
}

// The one exception type of the library: a status and a message. The C shell turns it into both.
class Error : public std::exception {
 public:
  Error(ddp_status_t status, std::string message) : status_(status), message_(std::move(message)) {}
  ddp_status_t status() const { return status_; }
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  ddp_status_t status_;
  std::string message_;
};

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
[[noreturn]] void fail(ddp_status_t status, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
// "rank 3" or "ranks 0, 2": how messages name ranks.
std::string rank_list(const std::vector<int>& ranks);
// Names the calling thread (`name`: at most 15 characters) where the system allows, so that the
// library's threads show as such in top -H, gdb and /proc/<pid>/task/*/comm.
void name_this_thread(const char* name);

// `t` plus `ms` milliseconds, saturated: a point past the clock's range (about 292 years of
// nanoseconds from its epoch) is the clock's last point, which no wait reaches, instead of an
// overflow. Any int64_t is accepted; `ms` <= 0 gives `t`.
template <class TimePoint>
inline TimePoint add_ms_saturated(TimePoint t, int64_t ms) {
  if (ms <= 0) return t;
  const auto room = std::chrono::duration_cast<std::chrono::milliseconds>(TimePoint::max() - t).count();
  if (t.time_since_epoch().count() < 0 || ms >= room) return TimePoint::max();
  return t + std::chrono::milliseconds(ms);
}

// A point in time after which a wait gives up; "never" when the timeout is 0, and when it lies past
// the clock's range (any timeout of the API may be as large as INT64_MAX: see add_ms_saturated).
class Deadline {
 public:
  using Clock = std::chrono::steady_clock;
  static Deadline after_ms(int64_t ms) {
    Deadline d;
    if (ms > 0) d.at_ = add_ms_saturated(Clock::now(), ms);
    d.infinite_ = ms <= 0 || d.at_ == Clock::time_point::max();
    return d;
  }
  static Deadline never() { return after_ms(0); }
  // The one of `a` and `b` that passes first.
  static Deadline earlier(Deadline a, Deadline b) {
    if (a.infinite_) return b;
    if (b.infinite_) return a;
    return a.at_ <= b.at_ ? a : b;
  }
  // The one of `a` and `b` that passes last.
  static Deadline later(Deadline a, Deadline b) {
    if (a.infinite_) return a;
    if (b.infinite_) return b;
    return a.at_ >= b.at_ ? a : b;
  }
  bool infinite() const { return infinite_; }
  bool passed() const { return !infinite_ && Clock::now() >= at_; }
  // The point itself; the clock's last point when infinite.
  Clock::time_point at() const { return infinite_ ? Clock::time_point::max() : at_; }

 private:
  bool infinite_ = true;
  Clock::time_point at_{};
};

// The bound of the communicator duplications under way on this thread (ddp_create's: MPI_Comm_dup is
// collective and waits for every rank). Set by a CreationScope for its life; a backend's Comm::dup and
// make_prober read it; "never" outside any scope.
Deadline creation_deadline();
class CreationScope {
 public:
  explicit CreationScope(Deadline dl);
  ~CreationScope();
  CreationScope(const CreationScope&) = delete;
  CreationScope& operator=(const CreationScope&) = delete;

 private:
  Deadline prev_;
};

inline uint64_t now_ns() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

}  // namespace ddp
