/* A training loop in C, twice: over the allreduce path (every rank updates every parameter) and
 * sharded (each rank updates its shard with the same optimizer, then the parameters are gathered).
 * Several linear layers of different sizes, least squares on each rank's own batch, 20 steps. SGD
 * with momentum on grads that sum exactly (multiples of 2^-10) must give bitwise the same
 * parameters; Adam on unrounded grads (whose sums round differently in the two paths' orders) must
 * agree within 1e-6 relative (2-norm). Also checks that every rank
 * ends with bitwise the same parameters, and that the sharded optimizer state is 1/world of the
 * unsharded one (plus padding). Prints "shard-train(np=N): P passed, F failed". */
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp.h"

#define LAYERS 5
#define STEPS 20
#define BATCH 8
static const int kIn[LAYERS] = {33, 64, 7, 128, 19};
static const int kOut[LAYERS] = {17, 31, 5, 40, 3};

static int rank_, world_, passed_, failed_;

#define OK(call)                                                             \
  do {                                                                       \
    ddp_status_t s_ = (call);                                                \
    if (s_ != DDP_SUCCESS) {                                                 \
      fprintf(stderr, "[rank %d] %s: %s\n", rank_, #call, ddp_last_error()); \
      MPI_Abort(MPI_COMM_WORLD, 3);                                          \
    }                                                                        \
  } while (0)

static double unit(unsigned long long x) { /* a value in [-1, 1) from a hash */
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  return (double)(x >> 11) / 4503599627370496.0 - 1.0;
}

typedef struct {
  int adam;
  float lr, beta1, beta2, eps, momentum;
} Opt;

/* One elementwise optimizer step over n elements; m and v are its state. */
static void opt_step(const Opt* o, int t, float* p, const float* g, float* m, float* v, size_t n) {
  size_t i;
  for (i = 0; i < n; ++i) {
    if (o->adam) {
      m[i] = o->beta1 * m[i] + (1.0f - o->beta1) * g[i];
      v[i] = o->beta2 * v[i] + (1.0f - o->beta2) * g[i] * g[i];
      const float mh = m[i] / (1.0f - powf(o->beta1, (float)t)), vh = v[i] / (1.0f - powf(o->beta2, (float)t));
      p[i] -= o->lr * mh / (sqrtf(vh) + o->eps);
    } else {
      m[i] = o->momentum * m[i] + g[i];
      p[i] -= o->lr * m[i];
    }
  }
}

/* Layer l's grads on this rank's batch of step t: W [in x out] then b [out]. */
static void local_grads(int l, int t, const float* W, const float* b, float* gW, float* gb, int exact) {
  const int in = kIn[l], out = kOut[l];
  int s, i, j;
  memset(gW, 0, sizeof(float) * (size_t)(in * out));
  memset(gb, 0, sizeof(float) * (size_t)out);
  for (s = 0; s < BATCH; ++s) {
    float x[128], r[64];
    const unsigned long long base = ((unsigned long long)(t * 7 + rank_) * 131 + (unsigned long long)l) * 1000003ull +
                                    (unsigned long long)s * 7919ull;
    for (i = 0; i < in; ++i) x[i] = (float)unit(base + (unsigned long long)i);
    for (j = 0; j < out; ++j) {
      float y = b[j];
      for (i = 0; i < in; ++i) y += x[i] * W[i * out + j];
      r[j] = (y - (float)unit(base * 3 + (unsigned long long)j)) / BATCH;
    }
    for (i = 0; i < in; ++i)
      for (j = 0; j < out; ++j) gW[i * out + j] += x[i] * r[j];
    for (j = 0; j < out; ++j) gb[j] += r[j];
  }
  if (exact) { /* multiples of 2^-10 in [-8, 8]: sums of a few are exact in f32, in any order */
    for (i = 0; i < in * out; ++i) gW[i] = fminf(8.0f, fmaxf(-8.0f, roundf(gW[i] * 1024.0f) / 1024.0f));
    for (j = 0; j < out; ++j) gb[j] = fminf(8.0f, fmaxf(-8.0f, roundf(gb[j] * 1024.0f) / 1024.0f));
  }
}

/* Trains 2 * LAYERS tensors (W, b per layer) for STEPS steps; writes the final parameters into
 * `result` (every tensor, in registration order) and the optimizer-state bytes per rank. */
static void train(ddp_comm_t comm, int shard, const Opt* o, int exact, float* result, size_t* state_bytes) {
  ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
  ddp_t d;
  int idx[2 * LAYERS], l, k, t, nb, b;
  float* param[2 * LAYERS]; /* unsharded: the caller's own parameters */
  float* m[2 * LAYERS];     /* unsharded optimizer state */
  float* v[2 * LAYERS];
  size_t numel[2 * LAYERS];
  float** sm = NULL; /* sharded: state per bucket shard */
  float** sv = NULL;
  cfg.layout = DDP_LAYOUT_ARENA;
  cfg.plan_order = DDP_PLAN_REGISTRATION;
  cfg.message_size = 3000;
  cfg.shard = shard;
  OK(ddp_create(comm, &cfg, &d));
  for (l = 0; l < LAYERS; ++l) {
    numel[2 * l] = (size_t)(kIn[l] * kOut[l]);
    numel[2 * l + 1] = (size_t)kOut[l];
  }
  for (k = 0; k < 2 * LAYERS; ++k) OK(ddp_register_grad(d, NULL, numel[k], DDP_F32, 0, &idx[k]));
  OK(ddp_commit(d));
  OK(ddp_get_plan(d, &nb, NULL));
  *state_bytes = 0;
  for (k = 0; k < 2 * LAYERS; ++k) {
    if (shard) {
      OK(ddp_param_ptr(d, idx[k], (void**)&param[k]));
    } else {
      param[k] = (float*)malloc(numel[k] * sizeof(float));
      m[k] = (float*)calloc(numel[k], sizeof(float));
      v[k] = (float*)calloc(numel[k], sizeof(float));
      *state_bytes += 2 * numel[k] * sizeof(float);
    }
    for (size_t i = 0; i < numel[k]; ++i) param[k][i] = (float)(0.1 * unit(977ull * (unsigned long long)k + i));
  }
  if (shard) {
    sm = (float**)calloc((size_t)nb, sizeof(float*));
    sv = (float**)calloc((size_t)nb, sizeof(float*));
    for (b = 0; b < nb; ++b) {
      ddp_shard_info_t s;
      s.size = sizeof s;
      OK(ddp_get_shard(d, b, &s));
      sm[b] = (float*)calloc(s.shard_numel, sizeof(float));
      sv[b] = (float*)calloc(s.shard_numel, sizeof(float));
      *state_bytes += 2 * s.shard_numel * sizeof(float);
    }
  }
  for (t = 1; t <= STEPS; ++t) {
    if (shard && t > 1) OK(ddp_wait_params(d, -1, NULL)); /* the forward needs every parameter */
    OK(ddp_begin_backward(d, NULL));
    for (l = LAYERS - 1; l >= 0; --l) { /* backward: the last layer first */
      float *gW, *gb;
      OK(ddp_grad_ptr(d, idx[2 * l], (void**)&gW));
      OK(ddp_grad_ptr(d, idx[2 * l + 1], (void**)&gb));
      local_grads(l, t, param[2 * l], param[2 * l + 1], gW, gb, exact);
      OK(ddp_grad_ready(d, idx[2 * l + 1]));
      OK(ddp_grad_ready(d, idx[2 * l]));
    }
    OK(ddp_finish_backward(d, NULL));
    if (shard) {
      for (b = 0; b < nb; ++b) {
        ddp_shard_info_t s;
        s.size = sizeof s;
        OK(ddp_get_shard(d, b, &s));
        opt_step(o, t, (float*)s.param_shard, (const float*)s.grad_shard, sm[b], sv[b], s.shard_numel);
      }
      OK(ddp_gather_params(d, NULL));
    } else {
      for (k = 0; k < 2 * LAYERS; ++k) {
        float* g;
        OK(ddp_grad_ptr(d, idx[k], (void**)&g));
        opt_step(o, t, param[k], g, m[k], v[k], numel[k]);
      }
    }
  }
  if (shard) OK(ddp_wait_params(d, -1, NULL));
  for (k = 0; k < 2 * LAYERS; ++k) {
    memcpy(result, param[k], numel[k] * sizeof(float));
    result += numel[k];
    if (!shard) {
      free(param[k]);
      free(m[k]);
      free(v[k]);
    }
  }
  for (b = 0; shard && b < nb; ++b) {
    free(sm[b]);
    free(sv[b]);
  }
  free(sm);
  free(sv);
  OK(ddp_destroy(d));
}

static void record(const char* name, int ok_here, const char* why) {
  int ok = ok_here, all = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!ok_here) fprintf(stderr, "[rank %d] FAIL %s: %s\n", rank_, name, why);
  if (all)
    ++passed_;
  else
    ++failed_;
}

int main(int argc, char** argv) {
  int provided, l;
  size_t total = 0, i, full_state, shard_state;
  ddp_comm_t comm;
  const Opt sgd = {0, 0.05f, 0, 0, 0, 0.9f}, adam = {1, 0.01f, 0.9f, 0.999f, 1e-8f, 0};
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &world_);
  OK(ddp_comm_init_mpi(NULL, &comm));
  for (l = 0; l < LAYERS; ++l) total += (size_t)(kIn[l] * kOut[l] + kOut[l]);
  float* a = (float*)malloc(total * sizeof(float));
  float* s = (float*)malloc(total * sizeof(float));
  for (int run = 0; run < 2; ++run) {
    const Opt* o = run ? &adam : &sgd;
    char why[200] = "";
    int ok = 1;
    train(comm, 0, o, !run, a, &full_state);
    train(comm, 1, o, !run, s, &shard_state);
    if (run) { /* the sums' rounding depends on the order the ranks are added in: the two paths' differ */
      double diff = 0, norm = 0;
      for (i = 0; i < total; ++i) {
        diff += ((double)a[i] - s[i]) * ((double)a[i] - s[i]);
        norm += (double)a[i] * a[i];
      }
      ok = sqrt(diff) <= 1e-6 * sqrt(norm);
      snprintf(why, sizeof why, "relative difference %.3g", sqrt(diff / norm));
      if (rank_ == 0) printf("shard-train: Adam, relative difference of the parameters %.3g\n", sqrt(diff / norm));
    } else {
      for (i = 0; ok && i < total; ++i)
        if (memcmp(&a[i], &s[i], sizeof(float)) != 0) {
          ok = 0;
          snprintf(why, sizeof why, "parameter element %zu: %.9g allreduced, %.9g sharded", i, a[i], s[i]);
        }
    }
    record(run ? "Adam: sharded within 1e-6 (relative, 2-norm) of allreduced after 20 steps"
               : "SGD with momentum: sharded bitwise equal to allreduced after 20 steps",
           ok, why);
    /* Every rank holds the same parameters (bitwise), and a shard's state is 1/world (+ padding). */
    unsigned long long h = 1469598103934665603ull, hs[64];
    for (i = 0; i < total * sizeof(float); ++i) h = (h ^ ((unsigned char*)s)[i]) * 1099511628211ull;
    MPI_Allgather(&h, 1, MPI_UNSIGNED_LONG_LONG, hs, 1, MPI_UNSIGNED_LONG_LONG, MPI_COMM_WORLD);
    ok = 1;
    for (l = 0; l < world_; ++l) ok = ok && hs[l] == hs[0];
    record("sharded parameters bitwise identical on every rank", ok, "they differ");
    snprintf(why, sizeof why, "optimizer state %zu bytes sharded, %zu unsharded", shard_state, full_state);
    record("optimizer state per rank is 1/world of unsharded (with padding)",
           shard_state * (size_t)world_ <= full_state + (size_t)(world_ * 256 * 2 * 10) && shard_state > 0, why);
    if (rank_ == 0 && run == 0)
      printf("shard-train: optimizer state per rank %zu bytes sharded, %zu unsharded (world %d)\n", shard_state,
             full_state, world_);
  }
  free(a);
  free(s);
  ddp_comm_destroy(comm);
  if (rank_ == 0) printf("shard-train(np=%d): %d passed, %d failed\n", world_, passed_, failed_);
  MPI_Finalize();
  return failed_ ? 1 : 0;
}
