/* A program written against the frozen 0.1.0 header (ddp_v0_1.h), run on today's library: two ranks
 * of an in-process local group (one thread each) go through registration and two synced iterations,
 * and every result the 0.1 API can see is checked. Rank 0 takes its config from 0.1's
 * DDP_CONFIG_INITIALIZER, rank 1 from 0.1's ddp_config_init, which was a real function in 0.1: this
 * program calls the library's exported symbol of that name.
 *
 * It never calls ddp_get_bucket: 0.1's ddp_bucket_info_t had no leading `size`, and 0.2 added one
 * while the major version is 0 (CHANGELOG.md, 0.2.0, ABI). Today's library would read 0.1's `dtype`
 * and `wire` as the size, so 0.1 callers of ddp_get_bucket must be rebuilt; tests/abi/run.sh checks
 * that this binary does not reference the symbol. Prints "abi-old: N passed, N failed". */
#include <math.h>
#include <stdlib.h>

#include "ddp_v0_1.h"
#include "check.h"

enum { kRanks = 2, kIterations = 2, kNumelA = 1000, kNumelB = 37 };

/* What rank r holds in element i of a grad, in iteration it: different on every rank. */
static double value(int rank, int it, int i) { return (rank + 1) * (i + 1) + 0.25 * rank + it; }

static void check_values(int rank, int it, const float* a, const double* b) {
  int i, bad = 0;
  for (i = 0; i < kNumelA; ++i) {
    double want = (value(0, it, i) + value(1, it, i)) / kRanks;
    if (fabs(a[i] - want) > 1e-6 * fabs(want)) ++bad;
  }
  for (i = 0; i < kNumelB; ++i) {
    double want = (value(0, it, i) + value(1, it, i)) / kRanks;
    if (fabs(b[i] - want) > 1e-12 * fabs(want)) ++bad;
  }
  check(bad == 0, "rank %d iteration %d: %d reduced elements differ from the mean", rank, it, bad);
}

/* 0.1's config: rank 0 from the initializer, rank 1 from the exported function. */
static ddp_config_t config_of(int rank) {
  ddp_config_t init = DDP_CONFIG_INITIALIZER;
  struct {
    ddp_config_t c;
    unsigned char guard[64];
  } s;
  if (rank == 0) {
    check(init.size == sizeof(ddp_config_t) && init.version == 1, "0.1 DDP_CONFIG_INITIALIZER: size %zu, version %u",
          init.size, init.version);
    return init;
  }
  memset(&s, 0x5A, sizeof s);
  check(ddp_config_init(&s.c) == DDP_SUCCESS, "0.1 ddp_config_init");
  check(all_bytes(s.guard, sizeof s.guard, 0x5A), "0.1 ddp_config_init writes nothing past 0.1's struct");
  check(s.c.size == sizeof(ddp_config_t), "0.1 ddp_config_init: size %zu", s.c.size);
  check(s.c.magic == DDP_CONFIG_MAGIC, "0.1 ddp_config_init: magic");
  check(s.c.version == DDP_CONFIG_VERSION, "0.1 ddp_config_init: version %u (0.1's is 1)", s.c.version);
  check(s.c.message_size == init.message_size && s.c.num_streams == init.num_streams &&
            s.c.gradient_predivide_factor == init.gradient_predivide_factor && s.c.timeout_ms == init.timeout_ms &&
            s.c.gradient_average == init.gradient_average && s.c.inplace_min_numel == init.inplace_min_numel &&
            s.c.timeline_path == NULL && s.c.stream_comms == NULL,
        "0.1 ddp_config_init: the defaults of DDP_CONFIG_INITIALIZER");
  return s.c;
}

static void iterate(ddp_t ddp, int rank, int it, int ia, int ib, float* a, double* b) {
  int i;
  for (i = 0; i < kNumelA; ++i) a[i] = (float)value(rank, it, i);
  for (i = 0; i < kNumelB; ++i) b[i] = value(rank, it, i);
  check(ddp_begin_backward(ddp, NULL) == DDP_SUCCESS, "rank %d: ddp_begin_backward", rank);
  check(ddp_grad_ready(ddp, ib) == DDP_SUCCESS, "rank %d: ddp_grad_ready b", rank);
  check(ddp_grad_ready(ddp, ia) == DDP_SUCCESS, "rank %d: ddp_grad_ready a", rank);
  check(ddp_finish_backward(ddp, NULL) == DDP_SUCCESS, "rank %d: ddp_finish_backward", rank);
  check_values(rank, it, a, b);
}

static void check_stats(ddp_t ddp, int rank) {
  ddp_stats_t st;
  memset(&st, 0xEE, sizeof st);
  st.size = sizeof st; /* 0.1's size */
  check(ddp_get_stats(ddp, &st) == DDP_SUCCESS, "rank %d: ddp_get_stats with 0.1's ddp_stats_t", rank);
  check(st.size == sizeof(ddp_stats_t), "rank %d: stats.size left as the caller set it", rank);
  check(st.iterations == kIterations, "rank %d: stats.iterations %llu", rank, (unsigned long long)st.iterations);
  check(st.buckets_reduced >= 2 * kIterations, "rank %d: stats.buckets_reduced %llu", rank,
        (unsigned long long)st.buckets_reduced);
  check(st.bytes_reduced >= (uint64_t)kIterations * (kNumelA * sizeof(float) + kNumelB * sizeof(double)),
        "rank %d: stats.bytes_reduced %llu", rank, (unsigned long long)st.bytes_reduced);
  check(st.nonfinite_buckets == 0 && st.layout_epoch == 0 && st.arena_bytes == 0,
        "rank %d: stats of the copy layout without check_finite", rank);
  check(st.world_size == kRanks && st.rank == rank, "rank %d: stats.world_size %d, stats.rank %d", rank, st.world_size,
        st.rank);
}

struct rank_args {
  ddp_local_group_t group;
  int rank;
};

static void* run_rank(void* p) {
  const struct rank_args* r = (const struct rank_args*)p;
  ddp_config_t cfg = config_of(r->rank);
  ddp_comm_t comm = NULL;
  ddp_t ddp = NULL;
  float* a = (float*)malloc(kNumelA * sizeof(float));
  double* b = (double*)malloc(kNumelB * sizeof(double));
  int ia = -1, ib = -1, it, nb = 0, learned = -1;
  cfg.message_size = 256; /* several buckets */
  check(ddp_comm_init_local(r->group, r->rank, &comm) == DDP_SUCCESS, "rank %d: ddp_comm_init_local", r->rank);
  check(ddp_create(comm, &cfg, &ddp) == DDP_SUCCESS, "rank %d: ddp_create with a 0.1 config", r->rank);
  ddp_comm_destroy(comm);
  if (ddp) {
    check(ddp_register_grad(ddp, a, kNumelA, DDP_F32, 0, &ia) == DDP_SUCCESS && ia == 0, "rank %d: register a",
          r->rank);
    check(ddp_register_grad(ddp, b, kNumelB, DDP_F64, 0, &ib) == DDP_SUCCESS && ib == 1, "rank %d: register b",
          r->rank);
    for (it = 0; it < kIterations; ++it) iterate(ddp, r->rank, it, ia, ib, a, b);
    check(ddp_get_plan(ddp, &nb, &learned) == DDP_SUCCESS && nb >= 2 && learned == 1, "rank %d: %d buckets", r->rank,
          nb);
    check_stats(ddp, r->rank);
  }
  check(ddp_destroy(ddp) == DDP_SUCCESS, "rank %d: ddp_destroy", r->rank);
  free(a);
  free(b);
  return NULL;
}

int main(void) {
  pthread_t threads[kRanks];
  struct rank_args args[kRanks];
  ddp_local_group_t group = NULL;
  int r;
  abi_name = "abi-old";
  check(ddp_version() >= 200, "ddp_version %d: a library at least 0.2", ddp_version());
  check(ddp_local_group_create(kRanks, &group) == DDP_SUCCESS, "ddp_local_group_create");
  for (r = 0; r < kRanks; ++r) {
    args[r].group = group;
    args[r].rank = r;
    pthread_create(&threads[r], NULL, run_rank, &args[r]);
  }
  for (r = 0; r < kRanks; ++r) pthread_join(threads[r], NULL);
  ddp_local_group_destroy(group);
  return summary();
}
