// The config, read through one table of ddp_config_t's fields (config_fields.def). Each row gives a
// field's kind, its valid range, whether ranks must agree on it, and the hint of its error message;
// the defaults are the header's DDP_CONFIG_INITIALIZER. From the table come the reader of a caller's
// struct of any version, the defaults written into one, and the cross-rank summary with its mismatch
// names. Appending a field to ddp_config_t means appending its row to config_fields.def (a
// static_assert below fails until it is there).
#include "core/config.hpp"
#include "core/knobs.hpp"
#include "core/config_fields.def"  // DDP_CONFIG_FIELDS: the table

#include <cmath>
#include <cstdlib>
#include <cstring>

namespace ddp {

namespace {

enum class Kind {
  Count,       // size_t in [lo, hi]
  PieceBytes,  // size_t: 0, or in [lo, hi]
  Flag,        // int, any value: zero is off
  Choice,      // int in [lo, hi] (an enum)
  Int,         // int in [lo, hi]
  Millis,      // int64_t in [lo, hi]
  Factor,      // double, finite, within lo..hi
  Handles,     // const ddp_comm_t*: checked and resolved by the C shell
  Text,        // const char*: copied
};

struct Field {
  const char* name;
  uint32_t version;  // the DDP_CONFIG_VERSION that appended it
  Kind kind;
  size_t offset, bytes;
  double lo, hi;
  bool agree;        // ranks must agree (checked at ddp_create)
  const char* hint;  // what the error message asks for
};

constexpr double kMaxCount = 9007199254740992.0;  // 2^53: every count a double holds exactly

#define DDP_CONFIG_ROW_(f, version, kind, lo, hi, agree, hint) \
  {#f, version, Kind::kind, offsetof(ddp_config_t, f), sizeof(ddp_config_t::f), lo, hi, agree, hint},
constexpr Field kFields[] = {DDP_CONFIG_FIELDS(DDP_CONFIG_ROW_)};
#undef DDP_CONFIG_ROW_
#define DDP_CONFIG_SPAN_(f, ...) DDP_FIELD_SPAN(ddp_config_t, f),
constexpr FieldSpan kSpans[] = {DDP_CONFIG_FIELDS(DDP_CONFIG_SPAN_)};
#undef DDP_CONFIG_SPAN_
constexpr size_t kNumFields = sizeof kFields / sizeof kFields[0];

// The table covers the struct: rows in order, each where the previous one ends (up to alignment),
// the last one at the struct's end (up to tail padding).
static_assert(spans_cover(kSpans, kNumFields, offsetof(ddp_config_t, version) + sizeof(uint32_t), sizeof(ddp_config_t),
                          alignof(ddp_config_t)),
              "every field of ddp_config_t needs its row in DDP_CONFIG_FIELDS");

// Versions only grow down the table, from 1 to DDP_CONFIG_VERSION, and version 1 ends where
// DDP_CONFIG_V1_SIZE says.
constexpr bool versions_in_order() {
  uint32_t v = 1;
  for (const Field& f : kFields) {
    if (f.version != v && f.version != v + 1) return false;
    if ((f.version == 1) != (f.offset + f.bytes <= DDP_CONFIG_V1_SIZE)) return false;
    v = f.version;
  }
  return kFields[0].version == 1 && v == DDP_CONFIG_VERSION;
}
static_assert(versions_in_order(), "DDP_CONFIG_FIELDS: a field's version is its append's DDP_CONFIG_VERSION");

constexpr int count_agreed() {
  int n = 0;
  for (const Field& f : kFields) n += f.agree ? 1 : 0;
  return n;
}
static_assert(count_agreed() <= kMaxAgreedFields, "raise kMaxAgreedFields");

bool within(const Field& f, size_t size) { return f.offset + f.bytes <= size; }

const ddp_config_t& defaults() {
  static const ddp_config_t d = DDP_CONFIG_INITIALIZER;
  return d;
}

// A field's value as a double (integers up to 2^53 exactly), for range checks and messages.
double number(const Field& f, const ddp_config_t& c) {
  const char* p = reinterpret_cast<const char*>(&c) + f.offset;
  switch (f.kind) {
    case Kind::Count:
    case Kind::PieceBytes: return double(*reinterpret_cast<const size_t*>(p));
    case Kind::Flag:
    case Kind::Choice:
    case Kind::Int: return double(*reinterpret_cast<const int*>(p));
    case Kind::Millis: return double(*reinterpret_cast<const int64_t*>(p));
    case Kind::Factor: return *reinterpret_cast<const double*>(p);
    case Kind::Handles:
    case Kind::Text: break;
  }
  return 0.0;
}

void check_field(const Field& f, const ddp_config_t& c) {
  const double v = number(f, c);
  bool ok = true;
  switch (f.kind) {
    case Kind::Count:
    case Kind::Choice:
    case Kind::Int:
    case Kind::Millis: ok = v >= f.lo && v <= f.hi; break;
    case Kind::PieceBytes: ok = v == 0.0 || (v >= f.lo && v <= f.hi); break;
    case Kind::Factor: ok = std::isfinite(v) && v >= f.lo && v <= f.hi; break;
    case Kind::Flag:
    case Kind::Handles:
    case Kind::Text: break;
  }
  if (!ok) fail(DDP_ERR_INVALID_ARGUMENT, "config.%s is %.17g: %s", f.name, v, f.hint);
}

void check_header(const ddp_config_t& c) {
  const char* init = "initialize the config with DDP_CONFIG_INITIALIZER or ddp_config_init";
  if (c.size < DDP_CONFIG_V1_SIZE)
    fail(DDP_ERR_INVALID_ARGUMENT,
         "config->size is %zu, smaller than any ddp_config_t (the first version's is %zu): %s", c.size,
         static_cast<size_t>(DDP_CONFIG_V1_SIZE), init);
  if (c.magic != DDP_CONFIG_MAGIC)
    fail(DDP_ERR_INVALID_ARGUMENT, "config->magic is 0x%08x, not DDP_CONFIG_MAGIC (0x%08x): %s", c.magic,
         DDP_CONFIG_MAGIC, init);
  if (c.version == 0) fail(DDP_ERR_INVALID_ARGUMENT, "config->version is 0: %s", init);
}

// Settings that are each valid but cannot go together.
void check_combination(const ddp_config_t& c) {
  if (c.elastic && c.shard)
    fail(DDP_ERR_INVALID_ARGUMENT,
         "config.elastic is not available with config.shard: the shards (and the optimizer state over them) "
         "would have to be redistributed over the new world");
  if (c.elastic && c.uneven_inputs != DDP_UNEVEN_OFF)
    fail(DDP_ERR_INVALID_ARGUMENT,
         "config.elastic is not available with config.uneven_inputs: a recovery would have to carry which "
         "ranks have joined into the new world");
  if (c.elastic && c.stream_comms)
    fail(DDP_ERR_INVALID_ARGUMENT,
         "config.elastic is not available with config.stream_comms: the library must rebuild every "
         "communicator of the context, and borrowed ones are the caller's");
  if (!c.shard) return;
  if (c.compression == DDP_COMPRESS_INT8)
    fail(DDP_ERR_INVALID_ARGUMENT,
         "config.compression DDP_COMPRESS_INT8 is not available with config.shard: the int8 wire is an "
         "all-gather of every rank's whole bucket, which a reduce-scatter has no use for");
  if (c.uneven_inputs != DDP_UNEVEN_OFF)
    fail(DDP_ERR_INVALID_ARGUMENT,
         "config.uneven_inputs is not available with config.shard: a joined rank would stop updating its "
         "parameter shard, which every other rank gathers");
  if (c.layout != DDP_LAYOUT_ARENA)
    fail(DDP_ERR_INVALID_ARGUMENT,
         "config.shard needs config.layout = DDP_LAYOUT_ARENA: a shard is one contiguous range of the "
         "grad arena, which the copy layout (the caller's own grad buffers) does not have");
  if (c.plan_order != DDP_PLAN_REGISTRATION)
    fail(DDP_ERR_INVALID_ARGUMENT,
         "config.shard needs config.plan_order = DDP_PLAN_REGISTRATION: the learned plan re-lays out the "
         "buckets after the first backward pass, which would move every rank's shard and the optimizer "
         "state kept over it");
}

void copy_field(const Field& f, void* dst, const void* src) {
  std::memcpy(static_cast<char*>(dst) + f.offset, static_cast<const char*>(src) + f.offset, f.bytes);
}

}  // namespace

Settings read_config(const ddp_config_t* config) {
  Settings s;
  s.c = defaults();
  if (config) {
    check_header(*config);  // the three leading fields are in every version
    for (const Field& f : kFields)
      if (within(f, config->size)) copy_field(f, &s.c, config);
  }
  s.c.size = sizeof s.c;
  for (const Field& f : kFields) check_field(f, s.c);
  check_combination(s.c);
  s.int8_scatter_min_world = knobs::int8_scatter_min_world();  // read once, where ddp_create agrees on it
  if (s.c.timeline_path && s.c.timeline_path[0]) {
    s.timeline_path = s.c.timeline_path;
  } else {
    s.timeline_path = knobs::text("DDP_TIMELINE");
  }
  s.c.timeline_path = nullptr;  // borrowed for the call only: the copy above is what lasts
  return s;
}

void config_defaults(ddp_config_t* config, size_t size) {
  if (size < DDP_CONFIG_V1_SIZE)
    fail(DDP_ERR_INVALID_ARGUMENT, "size is %zu, smaller than the first version of ddp_config_t (%zu)", size,
         static_cast<size_t>(DDP_CONFIG_V1_SIZE));
  const ddp_config_t& d = defaults();
  config->size = size;
  config->magic = d.magic;
  config->version = config_version_within(size);
  for (const Field& f : kFields)
    if (within(f, size)) copy_field(f, config, &d);
}

uint32_t config_version_within(size_t size) {
  for (const Field& f : kFields)
    if (!within(f, size)) return f.version - 1;
  return DDP_CONFIG_VERSION;
}

void copy_fields(void* dst, const void* src, size_t dst_size, const FieldSpan* spans, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (spans[i].offset + spans[i].bytes <= dst_size)
      std::memcpy(static_cast<char*>(dst) + spans[i].offset, static_cast<const char*>(src) + spans[i].offset,
                  spans[i].bytes);
}

AgreedFields agreed_fields(const ddp_config_t& c) {
  AgreedFields a;
  std::memset(&a, 0, sizeof a);
  int i = 0;
  for (const Field& f : kFields) {
    if (!f.agree) continue;
    double v = number(f, c);
    if (f.kind == Kind::Flag) v = v != 0.0 ? 1.0 : 0.0;  // any nonzero int means on
    std::memcpy(&a.raw[i++], &v, sizeof v);
  }
  return a;
}

std::string first_difference(const AgreedFields& a, int rank_a, const AgreedFields& b, int rank_b) {
  int i = 0;
  for (const Field& f : kFields) {
    if (!f.agree) continue;
    if (a.raw[i] != b.raw[i]) {
      double x, y;
      std::memcpy(&x, &a.raw[i], sizeof x);
      std::memcpy(&y, &b.raw[i], sizeof y);
      return format("%s is %.17g on rank %d but %.17g on rank %d", f.name, x, rank_a, y, rank_b);
    }
    ++i;
  }
  return std::string();
}

}  // namespace ddp
