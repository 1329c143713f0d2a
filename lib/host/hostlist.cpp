#include "host/hostlist.hpp"

#include <cstdint>

#include "core/common.hpp"

namespace ddp {

namespace {

struct Range {
  uint64_t lo = 0, hi = 0;
  size_t width = 0;  // digits of the lower bound: the zero padding of every number of the range
};

// One piece of a name: literal text, or (ranges not empty) a bracket.
struct Part {
  std::string text;
  std::vector<Range> ranges;
};
using Pattern = std::vector<Part>;

class Parser {
 public:
  Parser(const std::string& list, const char* what) : s_(list), what_(what) {}

  std::vector<Pattern> parse() {
    if (s_.empty()) bad(0, "the list is empty");
    std::vector<Pattern> out;
    Pattern name;
    std::string text;
    for (size_t i = 0; i < s_.size();) {
      const char c = s_[i];
      if (c == ',' || c == '[') {
        if (!text.empty()) name.push_back(Part{text, {}}), text.clear();
        if (c == ',') {
          if (name.empty()) bad(i, "an empty name");
          out.push_back(name), name.clear(), ++i;
        } else {
          name.push_back(Part{"", bracket(i)});
          i = s_.find(']', i) + 1;
        }
      } else if (c == ']') {
        bad(i, "']' without '['");
      } else {
        text += c, ++i;
      }
    }
    if (!text.empty()) name.push_back(Part{text, {}});
    if (name.empty()) bad(s_.size(), "an empty name");
    out.push_back(name);
    return out;
  }

 private:
  [[noreturn]] void bad(size_t at, const char* why) const {
    fail(DDP_ERR_INVALID_ARGUMENT,
         "%s='%s' is not a hostlist: %s at position %zu (expected names such as "
         "\"node[01-04,07],gpu3\")",
         what_, s_.c_str(), why, at);
  }

  // The bracket that opens at `open`: comma-separated numbers and ranges up to its ']'.
  std::vector<Range> bracket(size_t open) const {
    const size_t close = s_.find(']', open);
    if (close == std::string::npos) bad(open, "'[' is never closed");
    const size_t nested = s_.find('[', open + 1);
    if (nested < close) bad(nested, "a bracket inside a bracket");
    std::vector<Range> out;
    for (size_t at = open + 1; at <= close;) {
      size_t end = s_.find(',', at);
      if (end == std::string::npos || end > close) end = close;
      out.push_back(range(at, end));
      at = end + 1;
    }
    return out;
  }

  // "7" or "01-04" between `at` and `end`.
  Range range(size_t at, size_t end) const {
    if (at == end) bad(at, "an empty entry in a bracket");
    const size_t dash = s_.find('-', at);
    Range r;
    r.lo = number(at, dash < end ? dash : end);
    r.width = (dash < end ? dash : end) - at;
    r.hi = dash < end ? number(dash + 1, end) : r.lo;
    if (r.hi < r.lo) bad(at, "a range that runs backwards");
    return r;
  }

  uint64_t number(size_t at, size_t end) const {
    if (at == end) bad(at, "a range without a bound");
    if (end - at > 18) bad(at, "a number of more than 18 digits");
    uint64_t v = 0;
    for (size_t i = at; i < end; ++i) {
      if (s_[i] < '0' || s_[i] > '9') bad(i, "a bracket holds something other than numbers, ',' and '-'");
      v = v * 10 + static_cast<uint64_t>(s_[i] - '0');
    }
    return v;
  }

  const std::string& s_;
  const char* what_;
};

std::string padded(uint64_t v, size_t width) {
  std::string digits = std::to_string(v);
  return digits.size() < width ? std::string(width - digits.size(), '0') + digits : digits;
}

// Counts saturate just past the limit, so that no product or sum overflows.
uint64_t capped(uint64_t n) { return n > kMaxHostlistNames ? kMaxHostlistNames + 1 : n; }

uint64_t count(const Part& p) {
  uint64_t n = 0;
  for (const Range& r : p.ranges) n = capped(n + capped(r.hi - r.lo + 1));
  return p.ranges.empty() ? 1 : n;
}

// Appends every name of `p` from part `k` on, each prefixed by `prefix`.
void expand(const Pattern& p, size_t k, const std::string& prefix, std::vector<std::string>* out) {
  if (k == p.size()) {
    out->push_back(prefix);
    return;
  }
  if (p[k].ranges.empty()) return expand(p, k + 1, prefix + p[k].text, out);
  for (const Range& r : p[k].ranges)
    for (uint64_t v = r.lo;; ++v) {
      expand(p, k + 1, prefix + padded(v, r.width), out);
      if (v == r.hi) break;
    }
}

}  // namespace

std::vector<std::string> expand_hostlist(const std::string& list, const char* what) {
  const std::vector<Pattern> names = Parser(list, what).parse();
  uint64_t total = 0;
  for (const Pattern& p : names) {
    uint64_t n = 1;
    for (const Part& part : p) n = capped(n * count(part));
    total = capped(total + n);
    if (total > kMaxHostlistNames)
      fail(DDP_ERR_INVALID_ARGUMENT, "%s='%s' names more than %zu hosts", what, list.c_str(), kMaxHostlistNames);
  }
  std::vector<std::string> out;
  for (const Pattern& p : names) expand(p, 0, "", &out);
  return out;
}

std::string first_host(const std::string& list, const char* what) {
  const std::vector<Pattern> names = Parser(list, what).parse();
  std::string name;
  for (const Part& part : names.front())
    name += part.ranges.empty() ? part.text : padded(part.ranges.front().lo, part.ranges.front().width);
  return name;
}

}  // namespace ddp
