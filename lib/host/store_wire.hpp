// The TCP store's frames, shared by its server and its client. Every message is a u32 length, then
// that many bytes. A request: u8 op, u32 id (the client's, echoed by the answer, so that one
// connection carries many requests at once), then the op's fields; an answer: u32 id, then its
// fields. Numbers are in the hosts' own byte order (a job's hosts share one architecture); strings
// and values are a u32 length and the bytes.
//
//   op      request fields                              answer fields
//   Set     key, value                                  (none)
//   Get     u32 wait_ms, u8 values, u32 n, n keys       u8 1 and n values (none unless `values`)
//                                                       once every key is set; u8 0 and the u32
//                                                       index of a key still missing at wait_ms
//   Claim   key, value                                  u8 won; the value held unless won
//   Try     key                                         u8 set; the value if set
//   Watch   u32 wait_ms, u32 n, n x (key, u8 set,       u8 1 and n x (u8 set, value if set) once a
//           value if set)                               key differs from the request's; u8 0 at wait_ms
//   Cancel  u32 id of a Get or Watch                    none: that request is not answered either
// wait_ms kForever: no bound.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace ddp {
namespace store_wire {

enum Op : uint8_t { kSet = 1, kGet = 2, kClaim = 3, kTry = 4, kWatch = 5, kCancel = 6 };
constexpr uint32_t kForever = 0xffffffffu;
constexpr uint32_t kMaxFrame = 1u << 30;  // a longer one ends the connection

// Builds one frame: the fields, then frame() puts the length in front.
class Writer {
 public:
  Writer() : buf_(4, '\0') {}
  Writer& u8(uint8_t v) { return raw(&v, 1); }
  Writer& u32(uint32_t v) { return raw(&v, 4); }
  Writer& bytes(const char* p, size_t n) { return u32(static_cast<uint32_t>(n)).raw(p, n); }
  Writer& str(const std::string& s) { return bytes(s.data(), s.size()); }
  Writer& blob(const std::vector<char>& v) { return bytes(v.data(), v.size()); }
  std::string frame() {
    const uint32_t n = static_cast<uint32_t>(buf_.size() - 4);
    std::memcpy(&buf_[0], &n, 4);
    return std::move(buf_);
  }

 private:
  Writer& raw(const void* p, size_t n) {
    buf_.append(static_cast<const char*>(p), n);
    return *this;
  }
  std::string buf_;
};

// Reads the fields of one frame's body; ok() turns false, for good, at the first field that does not fit.
class Reader {
 public:
  Reader(const char* p, size_t n) : p_(p), end_(p + n) {}
  uint8_t u8() {
    uint8_t v = 0;
    take(&v, 1);
    return v;
  }
  uint32_t u32() {
    uint32_t v = 0;
    take(&v, 4);
    return v;
  }
  std::string str() {
    const uint32_t n = u32();
    if (!fits(n)) return std::string();
    std::string s(p_, n);
    p_ += n;
    return s;
  }
  std::vector<char> blob() {
    const uint32_t n = u32();
    if (!fits(n)) return std::vector<char>();
    std::vector<char> v(p_, p_ + n);
    p_ += n;
    return v;
  }
  bool ok() const { return ok_; }
  bool done() const { return ok_ && p_ == end_; }

 private:
  bool fits(size_t n) {
    if (ok_ && static_cast<size_t>(end_ - p_) >= n) return true;
    ok_ = false;
    return false;
  }
  void take(void* v, size_t n) {
    if (!fits(n)) return;
    std::memcpy(v, p_, n);
    p_ += n;
  }
  const char* p_;
  const char* end_;
  bool ok_ = true;
};

}  // namespace store_wire
}  // namespace ddp
