// The configuration: ddp_config_t read from a caller's struct of any version, validated field by
// field from one table (config.cpp), and the cross-rank view of the fields that ranks must agree on.
#pragma once

#include <string>
#include <vector>

#include "core/backend.hpp"

namespace ddp {

// A validated config: the library's full ddp_config_t (fields the caller's struct lacked hold their
// defaults) plus copies of what was only borrowed for the call.
struct Settings {
  ddp_config_t c;
  std::string timeline_path;        // config.timeline_path, else DDP_TIMELINE, else empty
  std::vector<Comm*> stream_comms;  // resolved by the C shell from c.stream_comms; borrowed, or empty

  bool arena() const { return c.layout == DDP_LAYOUT_ARENA; }
  bool learned() const { return c.plan_order == DDP_PLAN_LEARNED; }
  bool unused_zero() const { return c.unused_policy == DDP_UNUSED_ZERO; }
};

// Reads a caller's ddp_config_t (NULL: the defaults). Fields that lie wholly within config->size
// are read; later ones keep their defaults. Throws DDP_ERR_INVALID_ARGUMENT naming the first bad
// field. c.stream_comms is left for the shell to resolve (it holds C handles).
Settings read_config(const ddp_config_t* config);

// Writes the defaults of every field of *config that lies wholly within `size` bytes, and sets size.
void config_defaults(ddp_config_t* config, size_t size);

// Copies the fields after the leading `size_t size` of a sized struct (stats, bucket info) from
// `src` (the library's, `src_size` bytes) to `dst` (the caller's, `dst_size` bytes): never past either.
void copy_sized(void* dst, const void* src, size_t dst_size, size_t src_size);

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
