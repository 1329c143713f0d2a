// The configuration: ddp_config_t read from a caller's struct of any version, validated field by
// field from one table (config.cpp), and the cross-rank view of the fields that ranks must agree on.
#pragma once

#include <string>
#include <vector>

#include "core/common.hpp"

namespace ddp {

// A validated config: the library's full ddp_config_t (fields the caller's struct lacked hold their
// defaults) plus copies of what was only borrowed for the call.
struct Settings {
  ddp_config_t c;
  std::string timeline_path;       // config.timeline_path, else DDP_TIMELINE, else empty
  int int8_scatter_min_world = 3;  // DDP_INT8_SCATTER_MIN_WORLD, as ddp_create read it

  bool arena() const { return c.layout == DDP_LAYOUT_ARENA; }
  bool sharded() const { return c.shard != 0; }
  bool learned() const { return c.plan_order == DDP_PLAN_LEARNED; }
  bool unused_zero() const { return c.unused_policy == DDP_UNUSED_ZERO; }
  // The stall warning in effect (0: none; the timeout comes first).
  int64_t stall_warning_ms() const {
    const int64_t ms = c.stall_warning_ms > 0 ? c.stall_warning_ms : 60000;
    return c.timeout_ms > 0 && ms >= c.timeout_ms ? 0 : ms;
  }
};

// Reads a caller's ddp_config_t (NULL: the defaults). Fields that lie wholly within config->size
// are read; later ones keep their defaults. Throws DDP_ERR_INVALID_ARGUMENT naming the first bad
// field. c.stream_comms is left for the shell to resolve (it holds C handles), and cleared here.
Settings read_config(const ddp_config_t* config);

// Writes the defaults of every field of *config that lies wholly within `size` bytes, sets size, and
// sets version to the newest version whose fields all lie within `size` (see config_version_within).
void config_defaults(ddp_config_t* config, size_t size);

// The newest ddp_config_t version whose fields all lie within `size` bytes (at least
// DDP_CONFIG_V1_SIZE): 1 for the first version's size, DDP_CONFIG_VERSION for this library's own
// size or a larger one.
uint32_t config_version_within(size_t size);

// Where one field of a versioned struct lies.
struct FieldSpan {
  size_t offset, bytes;
};
#define DDP_FIELD_SPAN(T, f) \
  ::ddp::FieldSpan { offsetof(T, f), sizeof(T::f) }

// True when `spans` lists a struct's fields in order from `first` (the end of its leading fields),
// each where the previous one ends up to alignment, the last one at `struct_size` up to tail padding.
constexpr bool spans_cover(const FieldSpan* spans, size_t n, size_t first, size_t struct_size, size_t align) {
  size_t end = first;
  for (size_t i = 0; i < n; ++i) {
    if (spans[i].offset < end || spans[i].offset - end >= spans[i].bytes) return false;
    end = spans[i].offset + spans[i].bytes;
  }
  return struct_size - end < align;
}

// Copies from `src` (the library's struct) into `dst` (the caller's, `dst_size` bytes) each of the
// `n` fields of `spans` that lies wholly within `dst_size`: a field partly past it is not written,
// and neither is anything the spans do not name (the caller's leading `size`, padding).
void copy_fields(void* dst, const void* src, size_t dst_size, const FieldSpan* spans, size_t n);

// The fields ranks must agree on, in table order, each as 8 raw bytes: fixed size, so one allgather
// compares them.
constexpr int kMaxAgreedFields = 16;
struct AgreedFields {
  uint64_t raw[kMaxAgreedFields];
};
AgreedFields agreed_fields(const ddp_config_t& c);
// "message_size is 12345 on rank 0 but 64 on rank 1" for the first field where `a` and `b` differ,
// or empty if none does.
std::string first_difference(const AgreedFields& a, int rank_a, const AgreedFields& b, int rank_b);

}  // namespace ddp
