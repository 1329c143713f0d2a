/* Exact-size structs, built with -fsanitize=address and run on an ASan build of the library: every
 * struct the library writes into lives in a heap block of exactly the size the caller declares, so a
 * write of one byte past it aborts the run. Covers ddp_config_init_sized at the first version's size
 * (and the exported 0.1 ddp_config_init), ddp_get_stats and ddp_get_bucket at their smallest accepted
 * sizes, sizes that end inside a field (that field is not written), and sizes below the smallest (refused
 * with DDP_ERR_INVALID_ARGUMENT and a message, nothing written). Prints "abi-sizes: N passed, N failed". */
#include <stdlib.h>

#include "ddp.h"
#include "check.h"

/* A heap block of exactly `n` bytes, each `fill`. */
static void* block(size_t n, unsigned char fill) {
  void* p = malloc(n);
  memset(p, fill, n);
  return p;
}

static void check_v1_defaults(const ddp_config_t* c, size_t size, const char* what) {
  const ddp_config_t d = DDP_CONFIG_INITIALIZER;
  check(c->size == size && c->magic == DDP_CONFIG_MAGIC, "%s: size %zu, magic", what, c->size);
  check(c->version == 1, "%s: version %u, the first version's (1)", what, c->version);
  check(c->message_size == d.message_size && c->num_streams == d.num_streams && c->timeout_ms == d.timeout_ms &&
            c->gradient_average == d.gradient_average && c->inplace_min_numel == d.inplace_min_numel,
        "%s: the defaults", what);
}

static void check_config_sizes(ddp_comm_t comm) {
  const size_t v1 = DDP_CONFIG_V1_SIZE;
  const size_t piece = offsetof(ddp_config_t, host_piece_bytes);
  ddp_config_t* c = (ddp_config_t*)block(v1, 0xCD);
  ddp_t ddp = NULL;
  check(ddp_config_init_sized(c, v1) == DDP_SUCCESS, "ddp_config_init_sized(DDP_CONFIG_V1_SIZE)");
  check_v1_defaults(c, v1, "first version's size");
  check(ddp_create(comm, c, &ddp) == DDP_SUCCESS, "ddp_create reads a config of DDP_CONFIG_V1_SIZE bytes");
  ddp_destroy(ddp);
  memset(c, 0xCD, v1);
  check((ddp_config_init)(c) == DDP_SUCCESS, "the exported ddp_config_init of 0.1 programs");
  check_v1_defaults(c, v1, "exported ddp_config_init");
  free(c);

  /* A size that ends inside host_piece_bytes: that field is not written. */
  c = (ddp_config_t*)block(piece + 4, 0xCD);
  check(ddp_config_init_sized(c, piece + 4) == DDP_SUCCESS, "ddp_config_init_sized(%zu)", piece + 4);
  check_v1_defaults(c, piece + 4, "a size inside host_piece_bytes");
  check(all_bytes((char*)c + piece, 4, 0xCD), "a field partly past size is not written");
  free(c);

  /* One byte short of the first version: refused, nothing written. */
  c = (ddp_config_t*)block(v1 - 1, 0xCD);
  check_refused(ddp_config_init_sized(c, v1 - 1), DDP_ERR_INVALID_ARGUMENT, "ddp_config_init_sized: size is",
                "ddp_config_init_sized(DDP_CONFIG_V1_SIZE - 1)");
  check(all_bytes(c, v1 - 1, 0xCD), "a refused size writes nothing");
  free(c);
}

static ddp_t one_iteration(ddp_comm_t comm, float* g, size_t n) {
  ddp_t ddp = NULL;
  int index = -1;
  size_t i;
  check(ddp_create(comm, NULL, &ddp) == DDP_SUCCESS, "ddp_create");
  check(ddp_register_grad(ddp, g, n, DDP_F32, 0, &index) == DDP_SUCCESS, "ddp_register_grad");
  for (i = 0; i < n; ++i) g[i] = (float)i;
  check(ddp_begin_backward(ddp, NULL) == DDP_SUCCESS && ddp_grad_ready(ddp, index) == DDP_SUCCESS &&
            ddp_finish_backward(ddp, NULL) == DDP_SUCCESS,
        "one iteration");
  return ddp;
}

static void check_stats_sizes(ddp_t ddp) {
  const size_t least = offsetof(ddp_stats_t, iterations) + sizeof(uint64_t);
  const size_t v01 = offsetof(ddp_stats_t, rank) + sizeof(int); /* 0.1's ddp_stats_t ends with rank */
  ddp_stats_t* s = (ddp_stats_t*)block(least, 0xCD);
  s->size = least;
  check(ddp_get_stats(ddp, s) == DDP_SUCCESS && s->iterations == 1 && s->size == least,
        "ddp_get_stats at the smallest size (%zu)", least);
  free(s);

  s = (ddp_stats_t*)block(least + 4, 0xCD);
  s->size = least + 4;
  check(ddp_get_stats(ddp, s) == DDP_SUCCESS && s->iterations == 1, "ddp_get_stats(size %zu)", least + 4);
  check(all_bytes((char*)s + least, 4, 0xCD), "stats: a field partly past size is not written");
  free(s);

  s = (ddp_stats_t*)block(v01, 0xCD);
  s->size = v01;
  check(ddp_get_stats(ddp, s) == DDP_SUCCESS && s->iterations == 1 && s->world_size == 1 && s->rank == 0,
        "ddp_get_stats at 0.1's size (%zu)", v01);
  free(s);

  s = (ddp_stats_t*)block(least - 1, 0xCD);
  s->size = least - 1;
  check_refused(ddp_get_stats(ddp, s), DDP_ERR_INVALID_ARGUMENT, "ddp_get_stats: stats->size is",
                "ddp_get_stats below the smallest size");
  check(s->size == least - 1 && all_bytes((char*)s + sizeof(size_t), least - 1 - sizeof(size_t), 0xCD),
        "stats: a refused size writes nothing");
  free(s);
}

static void check_bucket_sizes(ddp_t ddp) {
  const size_t least = offsetof(ddp_bucket_info_t, dtype) + sizeof(ddp_dtype_t);
  ddp_bucket_info_t* b = (ddp_bucket_info_t*)block(least, 0xCD);
  b->size = least;
  check(ddp_get_bucket(ddp, 0, b, NULL, 0) == DDP_SUCCESS && b->dtype == DDP_F32 && b->size == least,
        "ddp_get_bucket at the smallest size (%zu)", least);
  free(b);

  b = (ddp_bucket_info_t*)block(least + 2, 0xCD);
  b->size = least + 2;
  check(ddp_get_bucket(ddp, 0, b, NULL, 0) == DDP_SUCCESS && b->dtype == DDP_F32, "ddp_get_bucket(size %zu)",
        least + 2);
  check(all_bytes((char*)b + least, 2, 0xCD), "bucket info: a field partly past size is not written");
  free(b);

  b = (ddp_bucket_info_t*)block(least - 1, 0xCD);
  b->size = least - 1;
  check_refused(ddp_get_bucket(ddp, 0, b, NULL, 0), DDP_ERR_INVALID_ARGUMENT, "ddp_get_bucket: info->size is",
                "ddp_get_bucket below the smallest size");
  check(all_bytes((char*)b + sizeof(size_t), least - 1 - sizeof(size_t), 0xCD),
        "bucket info: a refused size writes nothing");
  free(b);
}

int main(void) {
  enum { n = 64 };
  ddp_comm_t comm = NULL;
  ddp_t ddp;
  float* g = (float*)malloc(n * sizeof(float));
  abi_name = "abi-sizes";
  check(ddp_comm_init_self(&comm) == DDP_SUCCESS, "ddp_comm_init_self");
  check_config_sizes(comm);
  ddp = one_iteration(comm, g, n);
  check_stats_sizes(ddp);
  check_bucket_sizes(ddp);
  ddp_destroy(ddp);
  ddp_comm_destroy(comm);
  free(g);
  return summary();
}
