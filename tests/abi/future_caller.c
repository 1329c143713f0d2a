/* A program written against a future header: today's ddp.h with DDP_CONFIG_VERSION one higher and one
 * field appended to ddp_config_t, ddp_stats_t and ddp_bucket_info_t (made at build time by
 * future_header.awk, so it never drifts from today's header). Run on today's library, which knows none
 * of the appended fields, it checks what the header promises for structs larger than the library's:
 * the config is accepted and its unknown field ignored; ddp_config_init writes the fields the library
 * knows and says so with `version`; stats and bucket info are written up to the library's fields, the
 * unknown ones left as they were. Prints "abi-future: N passed, N failed". */
#include <stdlib.h>

#include "ddp.h"
#include "check.h"

#define SENTINEL 0xA5A5A5A5A5A5A5A5ull

/* ddp_config_init over the larger struct: the known fields get their defaults, the unknown one stays. */
static void check_init(void) {
  const ddp_config_t init = DDP_CONFIG_INITIALIZER;
  ddp_config_t c;
  memset(&c, 0x3C, sizeof c);
  c.future_field = SENTINEL;
  check(ddp_config_init(&c) == DDP_SUCCESS, "ddp_config_init of a larger struct");
  check(c.size == sizeof(ddp_config_t), "config.size %zu is the caller's %zu", c.size, sizeof(ddp_config_t));
  check(c.version == DDP_CONFIG_VERSION - 1, "config.version %u: the library's own (%u)", c.version,
        DDP_CONFIG_VERSION - 1);
  check(c.magic == DDP_CONFIG_MAGIC, "config.magic");
  check(c.message_size == init.message_size && c.num_streams == init.num_streams && c.timeout_ms == init.timeout_ms &&
            c.host_piece_bytes == init.host_piece_bytes && c.inplace_min_numel == init.inplace_min_numel &&
            c.gradient_predivide_factor == init.gradient_predivide_factor,
        "the fields the library knows hold their defaults");
  check(c.future_field == SENTINEL, "the unknown config field is left as it was");
}

static void iterate(ddp_t ddp, float* g, int n) {
  int i;
  for (i = 0; i < n; ++i) g[i] = 0.5f * (float)i;
  check(ddp_begin_backward(ddp, NULL) == DDP_SUCCESS, "ddp_begin_backward");
  check(ddp_grad_ready(ddp, 0) == DDP_SUCCESS, "ddp_grad_ready");
  check(ddp_finish_backward(ddp, NULL) == DDP_SUCCESS, "ddp_finish_backward");
  for (i = 0; i < n && g[i] == 0.5f * (float)i; ++i) continue;
  check(i == n, "a world of one leaves the grad as it was (element %d differs)", i);
}

static void check_stats(ddp_t ddp, int n) {
  ddp_stats_t st;
  memset(&st, 0, sizeof st);
  st.size = sizeof st;
  st.future_field = SENTINEL;
  check(ddp_get_stats(ddp, &st) == DDP_SUCCESS, "ddp_get_stats of a larger struct");
  check(st.size == sizeof(ddp_stats_t), "stats.size left as the caller set it");
  check(st.iterations == 1 && st.buckets_reduced == 1 && st.bytes_reduced == n * sizeof(float),
        "stats: 1 iteration, 1 bucket, %llu bytes", (unsigned long long)st.bytes_reduced);
  check(st.world_size == 1 && st.rank == 0, "stats: world 1, rank 0");
  check(st.future_field == SENTINEL, "the unknown stats field is not written");
}

static void check_bucket(ddp_t ddp, int n) {
  ddp_bucket_info_t info;
  int grads[2] = {-1, -1};
  memset(&info, 0, sizeof info);
  info.size = sizeof info;
  info.future_field = SENTINEL;
  check(ddp_get_bucket(ddp, 0, &info, grads, 2) == DDP_SUCCESS, "ddp_get_bucket of a larger struct");
  check(info.size == sizeof(ddp_bucket_info_t), "bucket info.size left as the caller set it");
  check(info.dtype == DDP_F32 && info.wire == DDP_F32 && info.numel == (size_t)n && info.num_grads == 1 &&
            info.stream == 0 && grads[0] == 0 && grads[1] == -1,
        "bucket 0: one f32 grad of %d elements", n);
  check(info.future_field == SENTINEL, "the unknown bucket info field is not written");
}

int main(void) {
  enum { n = 300 };
  ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
  ddp_comm_t comm = NULL;
  ddp_t ddp = NULL;
  float* g = (float*)malloc(n * sizeof(float));
  int index = -1, nb = 0;
  abi_name = "abi-future";
  check(ddp_version() == DDP_VERSION_CODE, "ddp_version %d is the header's %d", ddp_version(), DDP_VERSION_CODE);
  check_init();
  check(cfg.size == sizeof(ddp_config_t) && cfg.version == DDP_CONFIG_VERSION, "DDP_CONFIG_INITIALIZER");
  cfg.future_field = 12345; /* a value today's library cannot know the meaning of: ignored */
  cfg.plan_order = DDP_PLAN_REGISTRATION;
  check(ddp_comm_init_self(&comm) == DDP_SUCCESS, "ddp_comm_init_self");
  check(ddp_create(comm, &cfg, &ddp) == DDP_SUCCESS, "ddp_create accepts a larger config of a newer version");
  check(ddp_register_grad(ddp, g, n, DDP_F32, 0, &index) == DDP_SUCCESS && index == 0, "ddp_register_grad");
  iterate(ddp, g, n);
  check(ddp_get_plan(ddp, &nb, NULL) == DDP_SUCCESS && nb == 1, "one bucket (%d)", nb);
  check_stats(ddp, n);
  check_bucket(ddp, n);
  check(cfg.future_field == 12345, "the caller's config is not written");
  ddp_destroy(ddp);
  ddp_comm_destroy(comm);
  free(g);
  return summary();
}
