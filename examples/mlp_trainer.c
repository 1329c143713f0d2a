/*
 * mlp_trainer: a data-parallel trainer written in plain C99 against ddp.h.
 *
 * The model is an MLP  512 -> 2048 -> 2048 -> 2048 -> 10  (ReLU between layers, softmax cross-entropy
 * at the end; 9.46M parameters), trained with plain SGD on a synthetic 10-class task. Every rank runs
 * the same program; each global batch is split so that rank r trains on its own slice of it (the data
 * is sharded by rank). --optimizer momentum|adam replaces plain SGD; --shard keeps the optimizer's
 * state for this rank's shard of the parameters only (a sharded context: the grads are reduce-scattered,
 * each rank updates its shard of the parameter arena, the shards are all-gathered, and the next
 * forward pass waits for each layer's parameters just before it uses them). Forward and backward are written out below;
 * backward walks the layers from the last to the first, and as soon as a layer's weight and bias gradients are final it
 * marks them ready with ddp_grad_ready, so that libddp reduces the buckets of the later layers while the earlier
 * layers' gradients are still being computed.
 *
 * Per step it prints the global loss (the mean over every rank's slice, the same number on every rank;
 * the program checks that, and that the parameters stay identical, and exits non-zero otherwise). At
 * the end it prints the test accuracy, the step time and libddp's statistics.
 *
 * The communicator is one choice, made in make_comm():
 *   --comm mpi   host memory, reduced over MPI (run under mpirun; the default)
 *   --comm gloo  host memory, reduced over Gloo (TCP), no MPI: processes started by torchrun or
 *                tools/ddp_launch (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); --init names
 *                another rendezvous (tcp://HOST:PORT, file:///DIR), or auto: whichever launcher
 *                started the processes (torchrun, srun, mpirun, mpiexec; make launchers)
 *   --comm local N ranks as threads of this one process (--ranks N, default 2) over libddp's local
 *                group: data parallelism that needs no MPI, no Gloo and no launcher (make demo's
 *                default when the build has neither)
 *   --comm self  one process, no MPI (reduction is the identity)
 *   --comm nccl  device memory, reduced over NCCL: the gradients are staged into CUDA device buffers
 *                layer by layer and reduced there (only in a build with -DDDP_EXAMPLE_CUDA, which
 *                links the CUDA runtime; compute stays on the host). One GPU per rank.
 *
 * Usage: mlp_trainer [--steps N] [--batch B] [--lr X] [--layout arena|copy] [--message-size N]
 *                    [--delay] [--comm mpi|gloo|local|self|nccl] [--ranks N] [--init METHOD]
 *                    [--timeline file.json] [--quiet | --print-every K]
 *                    [--optimizer sgd|momentum|adam] [--shard] [--compression none|bf16|fp16|int8]
 *                    [--elastic [--kill RANK@STEP]] [--update-after-finish]
 *   --elastic      (--comm gloo) config.elastic: when a rank dies, the others get DDP_ERR_RANK_LOST,
 *                  skip that step's update, call ddp_recover, take the state (parameters, optimizer
 *                  state) of the rank that committed the most steps and go on with fewer ranks. Start
 *                  it with tools/ddp_launch --elastic so that the store outlives any rank. --kill:
 *                  rank RANK (its number at the start) SIGKILLs itself before step STEP's backward.
 *                  A process started with DDP_JOIN=1 (tools/ddp_launch --max-restarts restarts a dead
 *                  rank so) joins the running job: ddp_comm_join_gloo, then ddp_recover admits it at
 *                  the job's next step boundary and it takes the job's state (if the job ends
 *                  first, its ddp_recover says so and it exits 0)
 *   --compression  how f32 grads travel (ddp_config_t.compression): int8 blocks with error feedback,
 *                  or a 16-bit wire; compare the losses with --compression none
 *   --update-after-finish  update every layer after ddp_finish_backward. By default (host grads, not
 *                  --shard or --elastic) a layer is updated as soon as ddp_wait_grad says its bucket
 *                  is reduced, while the buckets of the layers before it are still on the wire
 *   --print-every  one loss line every K steps (default: about 8 lines in all, the first and the
 *                  last step included); --quiet: the first and the last only
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ddp.h"

#ifdef DDP_EXAMPLE_CUDA
#include <cuda_runtime_api.h>
#endif

#define NUM_LAYERS 4
#define NUM_CLASSES 10
#define INPUT_DIM 512
#define TRAIN_SAMPLES 65536
#define TEST_SAMPLES 1024

static const int kDims[NUM_LAYERS + 1] = {INPUT_DIM, 2048, 2048, 2048, NUM_CLASSES};

enum { OPT_SGD, OPT_MOMENTUM, OPT_ADAM };

typedef struct options {
  int steps, batch, layout, delay, quiet, optimizer, shard, compression, ranks, print_every;
  int elastic, kill_rank, kill_step; /* --elastic, --kill RANK@STEP (-1: none) */
  int update_after;                  /* --update-after-finish: no update before ddp_finish_backward */
  size_t message_size;
  float lr;
  const char* comm;
  const char* timeline;
  const char* init; /* --comm gloo: the rendezvous (env:// by default) */
} options_t;

/* ---------------------------------------------------------------------------------------------- */
/* Errors                                                                                          */
/* ---------------------------------------------------------------------------------------------- */

static __thread int g_rank = 0; /* this rank's number, for messages (ranks may be threads: --comm local) */

/* --elastic: where a lost rank sends the training loop (to recover), while it is set. */
static __thread jmp_buf* g_lost = NULL;

static void check(ddp_status_t s, const char* what) {
  if (s == DDP_SUCCESS) return;
  if ((s == DDP_ERR_RANK_LOST || s == DDP_ERR_RANK_JOINING) && g_lost) longjmp(*g_lost, 1);
  fprintf(stderr, "rank %d: %s failed: %s: %s\n", g_rank, what, ddp_status_string(s), ddp_last_error());
  exit(1);
}

static void* xmalloc(size_t bytes) {
  void* p = malloc(bytes);
  if (!p) {
    fprintf(stderr, "rank %d: out of memory (%zu bytes)\n", g_rank, bytes);
    exit(1);
  }
  return p;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---------------------------------------------------------------------------------------------- */
/* The synthetic task: 10 classes, each a random centre in 512 dimensions; a sample is its class's     */
/* centre scaled down plus unit Gaussian noise. Samples are a pure function of their index, so every  */
/* rank can draw any sample without holding a data set.                                             */
/* ---------------------------------------------------------------------------------------------- */

static uint64_t splitmix(uint64_t* s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static float uniform01(uint64_t* s) { return (float)((splitmix(s) >> 40) + 1) / 16777217.0f; }

static float gaussian(uint64_t* s) {
  float u = uniform01(s), v = uniform01(s);
  return sqrtf(-2.0f * logf(u)) * cosf(6.28318530718f * v);
}

static float g_centres[NUM_CLASSES][INPUT_DIM];

static void make_centres(void) {
  uint64_t s = 12345;
  for (int k = 0; k < NUM_CLASSES; ++k)
    for (int i = 0; i < INPUT_DIM; ++i) g_centres[k][i] = gaussian(&s);
}

/* Sample `index` (train: 0..TRAIN_SAMPLES-1, test: from TRAIN_SAMPLES on) into x; returns its label. */
static int draw_sample(uint64_t index, float* x) {
  uint64_t s = 0xC0FFEEull ^ (index * 0x2545F4914F6CDD1Dull);
  int label = (int)(splitmix(&s) % NUM_CLASSES);
  for (int i = 0; i < INPUT_DIM; ++i) x[i] = 0.3f * g_centres[label][i] + gaussian(&s);
  return label;
}

/* ---------------------------------------------------------------------------------------------- */
/* The model. Layer l maps kDims[l] -> kDims[l+1]; W[l] is stored [in][out] so that every inner loop  */
/* below runs along contiguous memory.                                                               */
/* ---------------------------------------------------------------------------------------------- */

typedef struct model {
  float* W[NUM_LAYERS];
  float* b[NUM_LAYERS];
  float* dW[NUM_LAYERS]; /* where backward writes: the grads libddp reduces (or their staging) */
  float* db[NUM_LAYERS];
  float* act[NUM_LAYERS + 1]; /* act[0] = input, act[l+1] = output of layer l (after ReLU) */
  float* dact[NUM_LAYERS + 1];
  int batch;
} model_t;

static size_t wcount(int l) { return (size_t)kDims[l] * (size_t)kDims[l + 1]; }

/* The three products of a linear layer, each reading W (or dW) four rows at a time for the whole
 * batch: a row block stays in cache across the batch's rows, and each batch row is read once per
 * block. Plain loops the compiler vectorizes; a trainer of real size calls a BLAS here. */

/* y[B][out] = x[B][in] W[in][out] + b */
static void linear_forward(const float* restrict x, const float* restrict W, const float* restrict b, float* restrict y,
                           int B, int in, int out) {
  for (int r = 0; r < B; ++r) memcpy(y + (size_t)r * out, b, (size_t)out * sizeof(float));
  int i = 0;
  for (; i + 4 <= in; i += 4) {
    const float* w0 = W + (size_t)i * out;
    const float *w1 = w0 + out, *w2 = w1 + out, *w3 = w2 + out;
    for (int r = 0; r < B; ++r) {
      const float* xr = x + (size_t)r * in + i;
      const float x0 = xr[0], x1 = xr[1], x2 = xr[2], x3 = xr[3];
      float* yr = y + (size_t)r * out;
      for (int o = 0; o < out; ++o) yr[o] += x0 * w0[o] + x1 * w1[o] + x2 * w2[o] + x3 * w3[o];
    }
  }
  for (; i < in; ++i) {
    const float* wi = W + (size_t)i * out;
    for (int r = 0; r < B; ++r) {
      const float xi = x[(size_t)r * in + i];
      float* yr = y + (size_t)r * out;
      for (int o = 0; o < out; ++o) yr[o] += xi * wi[o];
    }
  }
}

/* dW[in][out] = x^T dy, db = sum_r dy (overwritten, not accumulated). */
static void linear_backward_params(const float* restrict x, const float* restrict dy, float* restrict dW,
                                   float* restrict db, int B, int in, int out) {
  memset(db, 0, (size_t)out * sizeof(float));
  for (int r = 0; r < B; ++r)
    for (int o = 0; o < out; ++o) db[o] += dy[(size_t)r * out + o];
  memset(dW, 0, (size_t)in * (size_t)out * sizeof(float));
  int i = 0;
  for (; i + 4 <= in; i += 4) {
    float* d0 = dW + (size_t)i * out;
    float *d1 = d0 + out, *d2 = d1 + out, *d3 = d2 + out;
    for (int r = 0; r < B; ++r) {
      const float* xr = x + (size_t)r * in + i;
      const float x0 = xr[0], x1 = xr[1], x2 = xr[2], x3 = xr[3];
      if (x0 == 0.0f && x1 == 0.0f && x2 == 0.0f && x3 == 0.0f) continue; /* ReLU outputs are often zero */
      const float* dyr = dy + (size_t)r * out;
      for (int o = 0; o < out; ++o) {
        d0[o] += x0 * dyr[o];
        d1[o] += x1 * dyr[o];
        d2[o] += x2 * dyr[o];
        d3[o] += x3 * dyr[o];
      }
    }
  }
  for (; i < in; ++i) {
    float* dwi = dW + (size_t)i * out;
    for (int r = 0; r < B; ++r) {
      const float xi = x[(size_t)r * in + i];
      const float* dyr = dy + (size_t)r * out;
      for (int o = 0; o < out; ++o) dwi[o] += xi * dyr[o];
    }
  }
}

/* dx[B][in] = dy W^T, then masked by the ReLU that produced x. */
static void linear_backward_input(const float* restrict dy, const float* restrict W, const float* restrict x,
                                  float* restrict dx, int B, int in, int out) {
  int i = 0;
  for (; i + 4 <= in; i += 4) {
    const float* w0 = W + (size_t)i * out;
    const float *w1 = w0 + out, *w2 = w1 + out, *w3 = w2 + out;
    for (int r = 0; r < B; ++r) {
      const float* dyr = dy + (size_t)r * out;
      float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
      for (int o = 0; o < out; ++o) {
        a0 += dyr[o] * w0[o];
        a1 += dyr[o] * w1[o];
        a2 += dyr[o] * w2[o];
        a3 += dyr[o] * w3[o];
      }
      const float* xr = x + (size_t)r * in + i;
      float* dxr = dx + (size_t)r * in + i;
      dxr[0] = xr[0] > 0.0f ? a0 : 0.0f;
      dxr[1] = xr[1] > 0.0f ? a1 : 0.0f;
      dxr[2] = xr[2] > 0.0f ? a2 : 0.0f;
      dxr[3] = xr[3] > 0.0f ? a3 : 0.0f;
    }
  }
  for (; i < in; ++i) {
    const float* wi = W + (size_t)i * out;
    for (int r = 0; r < B; ++r) {
      const float* dyr = dy + (size_t)r * out;
      float acc = 0.0f;
      for (int o = 0; o < out; ++o) acc += dyr[o] * wi[o];
      dx[(size_t)r * in + i] = x[(size_t)r * in + i] > 0.0f ? acc : 0.0f;
    }
  }
}

/* Forward over the batch in m->act[0]; returns the summed cross-entropy and writes dlogits (already
 * divided by `divisor`, the number of samples the loss is averaged over on this rank) and the number
 * of correct predictions. */
static double forward(model_t* m, const int* labels, int* correct) {
  const int B = m->batch;
  for (int l = 0; l < NUM_LAYERS; ++l) {
    linear_forward(m->act[l], m->W[l], m->b[l], m->act[l + 1], B, kDims[l], kDims[l + 1]);
    if (l + 1 < NUM_LAYERS) {
      float* a = m->act[l + 1];
      for (size_t i = 0; i < (size_t)B * kDims[l + 1]; ++i) a[i] = a[i] > 0.0f ? a[i] : 0.0f;
    }
  }
  double loss = 0.0;
  int ok = 0;
  float* logits = m->act[NUM_LAYERS];
  float* dlogits = m->dact[NUM_LAYERS];
  for (int r = 0; r < B; ++r) {
    float* z = logits + (size_t)r * NUM_CLASSES;
    float* dz = dlogits + (size_t)r * NUM_CLASSES;
    int best = 0;
    float mx = z[0];
    for (int k = 1; k < NUM_CLASSES; ++k)
      if (z[k] > mx) mx = z[k], best = k;
    double sum = 0.0;
    for (int k = 0; k < NUM_CLASSES; ++k) sum += exp((double)(z[k] - mx));
    loss += log(sum) - (double)(z[labels[r]] - mx);
    for (int k = 0; k < NUM_CLASSES; ++k)
      dz[k] = (float)((exp((double)(z[k] - mx)) / sum - (k == labels[r] ? 1.0 : 0.0)) / B);
    ok += best == labels[r];
  }
  *correct = ok;
  return loss;
}

/* ---------------------------------------------------------------------------------------------- */
/* The communicator and where the grads live                                                        */
/* ---------------------------------------------------------------------------------------------- */

typedef struct trainer {
  ddp_t ddp;
  int rank, world, device_grads;
  int first_rank;                /* the rank at the start (--kill names it) */
  int grad_index[NUM_LAYERS][2]; /* [l][0] weight, [l][1] bias */
#ifdef DDP_EXAMPLE_CUDA
  cudaStream_t stream;
  void* dev[NUM_LAYERS][2]; /* device grads (NCCL path) */
#endif
} trainer_t;

/* Started into a running elastic job (tools/ddp_launch --max-restarts sets DDP_JOIN=1). */
static int joining(void) {
  const char* j = getenv("DDP_JOIN");
  return j && strcmp(j, "1") == 0;
}

static ddp_comm_t make_comm(const char* kind, const char* init, int* device_grads) {
  ddp_comm_t comm = NULL;
  *device_grads = 0;
  if (strcmp(kind, "mpi") == 0) {
    check(ddp_comm_init_mpi(NULL, &comm), "ddp_comm_init_mpi");
  } else if (strcmp(kind, "gloo") == 0) {
    /* Rank and world size from RANK and WORLD_SIZE, as torchrun (or tools/ddp_launch) sets them, or
     * with --init auto from whichever launcher started the process; a process restarted into a running elastic job
     * (DDP_JOIN=1) joins it instead. */
    if (joining())
      check(ddp_comm_join_gloo(init, 300000, &comm), "ddp_comm_join_gloo");
    else
      check(ddp_comm_init_gloo(init, -1, -1, &comm), "ddp_comm_init_gloo");
  } else if (strcmp(kind, "self") == 0) {
    check(ddp_comm_init_self(&comm), "ddp_comm_init_self");
  } else if (strcmp(kind, "local") == 0) {
    fprintf(stderr, "--comm local makes its ranks in main() (run_local)\n");
    exit(2);
  } else if (strcmp(kind, "nccl") == 0) {
#ifdef DDP_EXAMPLE_CUDA
    /* One GPU per rank: the local rank picks the device, as the launcher set it (mpirun here; srun
     * and torchrun as well: ddp_launcher_ranks reads them all). */
    int lr = -1;
    if (ddp_launcher_ranks(NULL, NULL, &lr) != DDP_SUCCESS || lr < 0) lr = 0;
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
      fprintf(stderr, "--comm nccl: no CUDA device\n");
      exit(1);
    }
    int dev = lr % ndev;
    cudaSetDevice(dev);
    check(ddp_comm_init_nccl_mpi(NULL, dev, &comm), "ddp_comm_init_nccl_mpi");
    *device_grads = 1;
#else
    fprintf(stderr, "--comm nccl needs the CUDA build of this example (make demo-gpu)\n");
    exit(2);
#endif
  } else {
    fprintf(stderr, "unknown --comm '%s' (mpi, gloo, local, self or nccl)\n", kind);
    exit(2);
  }
  return comm;
}

/* Marks layer l's grads ready (after staging them to the device on the NCCL path). */
static void layer_grads_ready(trainer_t* t, model_t* m, int l) {
  (void)m;
#ifdef DDP_EXAMPLE_CUDA
  if (t->device_grads) {
    cudaMemcpyAsync(t->dev[l][0], m->dW[l], wcount(l) * sizeof(float), cudaMemcpyHostToDevice, t->stream);
    cudaMemcpyAsync(t->dev[l][1], m->db[l], (size_t)kDims[l + 1] * sizeof(float), cudaMemcpyHostToDevice, t->stream);
  }
#endif
  check(ddp_grad_ready(t->ddp, t->grad_index[l][0]), "ddp_grad_ready");
  check(ddp_grad_ready(t->ddp, t->grad_index[l][1]), "ddp_grad_ready");
}

static void* stream_of(trainer_t* t) {
#ifdef DDP_EXAMPLE_CUDA
  if (t->device_grads) return (void*)t->stream;
#endif
  (void)t;
  return NULL;
}

/* After ddp_finish_backward: bring device grads back to the host for the SGD step. */
static void grads_to_host(trainer_t* t, model_t* m) {
  (void)m;
#ifdef DDP_EXAMPLE_CUDA
  if (t->device_grads) {
    for (int l = 0; l < NUM_LAYERS; ++l) {
      cudaMemcpyAsync(m->dW[l], t->dev[l][0], wcount(l) * sizeof(float), cudaMemcpyDeviceToHost, t->stream);
      cudaMemcpyAsync(m->db[l], t->dev[l][1], (size_t)kDims[l + 1] * sizeof(float), cudaMemcpyDeviceToHost, t->stream);
    }
    if (cudaStreamSynchronize(t->stream) != cudaSuccess) {
      fprintf(stderr, "rank %d: CUDA stream failed\n", t->rank);
      exit(1);
    }
  }
#endif
  (void)t;
}

/* Every rank's value of x, via one broadcast per root (small: the loss and a checksum per step). */
static void gather_doubles(trainer_t* t, const double* mine, int n, double* all /* [world][n] */) {
  for (int r = 0; r < t->world; ++r) {
    double buf[4];
    memcpy(buf, mine, (size_t)n * sizeof(double));
    void* bufs[1] = {buf};
    size_t counts[1] = {(size_t)n};
    ddp_dtype_t types[1] = {DDP_F64};
    if (t->device_grads) {
      /* The NCCL comm broadcasts device memory: this example keeps its control values on the host
       * and so only checks its own values there (the reduced grads are what NCCL checks). */
      memcpy(all + (size_t)r * n, mine, (size_t)n * sizeof(double));
      continue;
    }
    check(ddp_broadcast(t->ddp, bufs, counts, types, 1, r, NULL), "ddp_broadcast");
    memcpy(all + (size_t)r * n, buf, (size_t)n * sizeof(double));
  }
}

static double param_checksum(const model_t* m) {
  double s = 0.0;
  for (int l = 0; l < NUM_LAYERS; ++l) {
    for (size_t i = 0; i < wcount(l); i += 97) s += (double)m->W[l][i] * (double)((i % 13) + 1);
    for (int i = 0; i < kDims[l + 1]; ++i) s += (double)m->b[l][i];
  }
  return s;
}

static int cmp_double(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

static void usage(void) {
  fprintf(stderr,
          "usage: mlp_trainer [--steps N] [--batch B] [--lr X] [--layout arena|copy] [--message-size N]\n"
          "                   [--delay] [--comm mpi|gloo|local|self|nccl] [--ranks N]\n"
          "                   [--init env://|auto|tcp://H:P|file:///DIR] [--timeline file.json] [--quiet | "
          "--print-every K]\n"
          "                   [--optimizer sgd|momentum|adam] [--shard] [--compression none|bf16|fp16|int8]\n"
          "                   [--elastic [--kill RANK@STEP]] [--update-after-finish]\n");
  exit(2);
}

static options_t parse(int argc, char** argv) {
  options_t o = {.steps = 40,
                 .batch = 32,
                 .layout = DDP_LAYOUT_ARENA,
                 .optimizer = OPT_SGD,
                 .compression = DDP_COMPRESS_NONE,
                 .ranks = 2,
                 .kill_rank = -1,
                 .kill_step = -1,
                 .message_size = 2000000,
                 .lr = 0.05f,
                 .comm = "mpi",
                 .init = "env://"};
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--delay"))
      o.delay = 1;
    else if (!strcmp(a, "--quiet"))
      o.quiet = 1;
    else if (!strcmp(a, "--shard"))
      o.shard = 1;
    else if (!strcmp(a, "--elastic"))
      o.elastic = 1;
    else if (!strcmp(a, "--update-after-finish"))
      o.update_after = 1;
    else if (!v)
      usage();
    else if (!strcmp(a, "--steps"))
      o.steps = atoi(v), ++i;
    else if (!strcmp(a, "--batch"))
      o.batch = atoi(v), ++i;
    else if (!strcmp(a, "--lr"))
      o.lr = (float)atof(v), ++i;
    else if (!strcmp(a, "--message-size"))
      o.message_size = (size_t)atoll(v), ++i;
    else if (!strcmp(a, "--comm"))
      o.comm = v, ++i;
    else if (!strcmp(a, "--ranks"))
      o.ranks = atoi(v), ++i;
    else if (!strcmp(a, "--print-every"))
      o.print_every = atoi(v), ++i;
    else if (!strcmp(a, "--init"))
      o.init = v, ++i;
    else if (!strcmp(a, "--timeline"))
      o.timeline = v, ++i;
    else if (!strcmp(a, "--kill")) {
      if (sscanf(v, "%d@%d", &o.kill_rank, &o.kill_step) != 2) usage();
      ++i;
    } else if (!strcmp(a, "--optimizer")) {
      if (!strcmp(v, "sgd"))
        o.optimizer = OPT_SGD;
      else if (!strcmp(v, "momentum"))
        o.optimizer = OPT_MOMENTUM;
      else if (!strcmp(v, "adam"))
        o.optimizer = OPT_ADAM;
      else
        usage();
      ++i;
    } else if (!strcmp(a, "--compression")) {
      static const char* const names[] = {"none", "bf16", "fp16", "int8"};
      o.compression = -1;
      for (int k = 0; k < 4; ++k)
        if (!strcmp(v, names[k])) o.compression = k; /* DDP_COMPRESS_NONE .. DDP_COMPRESS_INT8 */
      if (o.compression < 0) usage();
      ++i;
    } else if (!strcmp(a, "--layout")) {
      if (!strcmp(v, "arena"))
        o.layout = DDP_LAYOUT_ARENA;
      else if (!strcmp(v, "copy"))
        o.layout = DDP_LAYOUT_COPY;
      else
        usage();
      ++i;
    } else
      usage();
  }
  if (o.steps < 1 || o.batch < 1 || o.message_size < 1 || o.ranks < 1 || o.print_every < 0) usage();
  if (o.print_every == 0) o.print_every = o.steps >= 8 ? o.steps / 8 : 1;
  if (o.elastic && (strcmp(o.comm, "gloo") || o.shard)) {
    fprintf(stderr, "--elastic needs --comm gloo and no --shard (ddp_recover rebuilds Gloo communicators)\n");
    exit(2);
  }
  if (o.shard && o.layout != DDP_LAYOUT_ARENA) {
    fprintf(stderr, "--shard needs --layout arena (a shard is a range of the library's arena)\n");
    exit(2);
  }
  return o;
}

/* ---------------------------------------------------------------------------------------------- */
/* The optimizer: elementwise, so it runs the same over whole tensors or over flat shards. s1 and s2  */
/* are its state (momentum; Adam's two moments), step counts from 1.                                */
/* ---------------------------------------------------------------------------------------------- */

static int state_per_element(int optimizer) { return optimizer == OPT_ADAM ? 2 : optimizer == OPT_MOMENTUM; }

static void optimizer_step(const options_t* o, int step, float* p, const float* g, float* s1, float* s2, size_t n) {
  const float b1 = 0.9f, b2 = 0.999f;
  const float c1 = 1.0f - powf(b1, (float)step), c2 = 1.0f - powf(b2, (float)step);
  for (size_t i = 0; i < n; ++i) {
    if (o->optimizer == OPT_SGD) {
      p[i] -= o->lr * g[i];
    } else if (o->optimizer == OPT_MOMENTUM) {
      s1[i] = 0.9f * s1[i] + g[i];
      p[i] -= o->lr * s1[i];
    } else {
      s1[i] = b1 * s1[i] + (1.0f - b1) * g[i];
      s2[i] = b2 * s2[i] + (1.0f - b2) * g[i] * g[i];
      p[i] -= o->lr * (s1[i] / c1) / (sqrtf(s2[i] / c2) + 1e-8f);
    }
  }
}

/* Optimizer state for `n` elements (NULL when the optimizer keeps none); *bytes counts it. */
/* One layer's update (weights and biases). */
static void update_layer(const options_t* o, model_t* m, float** s1, float** s2, int step, int l) {
  optimizer_step(o, step, m->W[l], m->dW[l], s1[2 * l], s2[2 * l], wcount(l));
  optimizer_step(o, step, m->b[l], m->db[l], s1[2 * l + 1], s2[2 * l + 1], (size_t)kDims[l + 1]);
}

static float* state_alloc(int optimizer, int which, size_t n, size_t* bytes) {
  if (state_per_element(optimizer) <= which) return NULL;
  *bytes += n * sizeof(float);
  float* s = calloc(n ? n : 1, sizeof(float));
  if (!s) {
    fprintf(stderr, "out of memory\n");
    exit(1);
  }
  return s;
}

/* One rank's training over `comm` (which it consumes); returns the process's exit status. */
/* --elastic, after a call said DDP_ERR_RANK_LOST (that step's update was skipped) or
 * DDP_ERR_RANK_JOINING (a process waits to join), and on a joiner before its first step: the new
 * membership, then on every rank the parameters and optimizer state of the rank that committed the
 * most steps (a step may have completed on some ranks before it failed on others; a joiner has
 * none). Returns the step to go on from. A loss while this runs comes back here through check(). */
static int recover(trainer_t* t, model_t* m, float** s1, float** s2, const options_t* o, int max_world) {
  ddp_membership_t mb;
  ddp_status_t st = ddp_recover(t->ddp, &mb, NULL, 0);
  /* DDP_ERR_TIMEOUT leaves the context lost and may be retried: another rank lost during the recovery */
  for (int tries = 1; st == DDP_ERR_TIMEOUT && tries < 3; ++tries) {
    fprintf(stderr, "rank %d: ddp_recover: %s; trying again\n", g_rank, ddp_last_error());
    st = ddp_recover(t->ddp, &mb, NULL, 0);
  }
  if (st == DDP_ERR_ABORTED && t->rank < 0) { /* a joiner the job never admitted: it ended first */
    fprintf(stderr, "joiner: %s; nothing left to do\n", ddp_last_error());
    exit(0);
  }
  if (st != DDP_SUCCESS) {
    fprintf(stderr, "rank %d: ddp_recover failed: %s: %s\n", g_rank, ddp_status_string(st), ddp_last_error());
    exit(1);
  }
  if (mb.world > max_world) {
    fprintf(stderr, "rank %d: %d ranks: this example gathers its losses for at most %d\n", mb.rank, mb.world,
            max_world);
    exit(1);
  }
  t->rank = mb.rank, t->world = mb.world, g_rank = mb.rank;
  void* bufs[6 * NUM_LAYERS];
  size_t counts[6 * NUM_LAYERS];
  ddp_dtype_t types[6 * NUM_LAYERS];
  int n = 0;
  for (int l = 0; l < NUM_LAYERS; ++l) {
    if (o->layout == DDP_LAYOUT_ARENA) { /* the new context's arena holds the grads now */
      check(ddp_grad_ptr(t->ddp, t->grad_index[l][0], (void**)&m->dW[l]), "ddp_grad_ptr");
      check(ddp_grad_ptr(t->ddp, t->grad_index[l][1], (void**)&m->db[l]), "ddp_grad_ptr");
    }
    float* state[6] = {m->W[l], m->b[l], s1[2 * l], s1[2 * l + 1], s2[2 * l], s2[2 * l + 1]};
    const size_t len[6] = {wcount(l), (size_t)kDims[l + 1], wcount(l), (size_t)kDims[l + 1],
                           wcount(l), (size_t)kDims[l + 1]};
    for (int k = 0; k < 6; ++k)
      if (state[k]) bufs[n] = state[k], counts[n] = len[k], types[n++] = DDP_F32;
  }
  check(ddp_broadcast(t->ddp, bufs, counts, types, n, mb.source, NULL), "ddp_broadcast");
  if (t->rank == 0)
    printf(
        "membership %llu: %d ranks now (%d before); parameters and optimizer state from rank %d; going on "
        "from step %lld\n",
        (unsigned long long)mb.epoch, mb.world, mb.old_world, mb.source, (long long)mb.committed + 1);
  return (int)mb.committed;
}

static int train(const options_t* options, ddp_comm_t comm, int device_grads) {
  const options_t opt = *options;
  trainer_t t;
  memset(&t, 0, sizeof t);
  t.device_grads = device_grads;
  volatile const int joiner = opt.elastic && joining(); /* no rank until the job admits it (recover, below) */
  t.rank = -1;
  if (!joiner) {
    check(ddp_comm_rank(comm, &t.rank), "ddp_comm_rank");
    check(ddp_comm_size(comm, &t.world), "ddp_comm_size");
  }
  g_rank = t.rank;
  t.first_rank = t.rank;
  const int B = opt.batch;

  ddp_config_t cfg;
  check(ddp_config_init(&cfg), "ddp_config_init");
  cfg.layout = opt.layout;
  cfg.plan_order = DDP_PLAN_REGISTRATION; /* buckets known up front: iteration 1 overlaps too */
  cfg.message_size = opt.message_size;
  cfg.delay_allreduce = opt.delay;
  cfg.timeline_path = opt.timeline;
  cfg.shard = opt.shard;
  cfg.compression = opt.compression;
  cfg.elastic = opt.elastic;
  if (opt.shard && t.device_grads) {
    fprintf(stderr, "--shard: this example trains on the host; use --comm mpi or self\n");
    exit(2);
  }
  check(ddp_create(comm, &cfg, &t.ddp), "ddp_create");
  check(ddp_comm_destroy(comm), "ddp_comm_destroy");

  /* Parameters and activations on the host; grads registered in forward order, so that the
   * registration plan (reverse order) matches the order backward produces them. */
  model_t m;
  memset(&m, 0, sizeof m);
  m.batch = B;
  size_t params = 0;
  for (int l = 0; l < NUM_LAYERS; ++l) {
    if (!opt.shard) { /* sharded: the parameters live in the library's parameter arena (below) */
      m.W[l] = xmalloc(wcount(l) * sizeof(float));
      m.b[l] = xmalloc((size_t)kDims[l + 1] * sizeof(float));
    }
    params += wcount(l) + (size_t)kDims[l + 1];
  }
  for (int l = 0; l <= NUM_LAYERS; ++l) {
    m.act[l] = xmalloc((size_t)B * kDims[l] * sizeof(float));
    m.dact[l] = xmalloc((size_t)B * kDims[l] * sizeof(float));
  }
  const int arena = opt.layout == DDP_LAYOUT_ARENA;
  for (int l = 0; l < NUM_LAYERS; ++l) {
    size_t n[2] = {wcount(l), (size_t)kDims[l + 1]};
    float** host[2] = {&m.dW[l], &m.db[l]};
    for (int k = 0; k < 2; ++k) {
      void* p = NULL;
      if (t.device_grads) {
#ifdef DDP_EXAMPLE_CUDA
        *host[k] = xmalloc(n[k] * sizeof(float)); /* host staging; the grad itself is on the device */
        if (!arena && cudaMalloc(&t.dev[l][k], n[k] * sizeof(float)) != cudaSuccess) {
          fprintf(stderr, "cudaMalloc failed\n");
          exit(1);
        }
        p = arena ? NULL : t.dev[l][k];
#endif
      } else if (!arena) {
        *host[k] = xmalloc(n[k] * sizeof(float));
        p = *host[k];
      }
      check(ddp_register_grad(t.ddp, p, n[k], DDP_F32, 0, &t.grad_index[l][k]), "ddp_register_grad");
    }
  }
  if (!joiner) check(ddp_commit(t.ddp), "ddp_commit");
  if (arena && !joiner) /* the library owns the grads: backward writes straight into its buckets */
    for (int l = 0; l < NUM_LAYERS; ++l) {
      void* p[2];
      check(ddp_grad_ptr(t.ddp, t.grad_index[l][0], &p[0]), "ddp_grad_ptr");
      check(ddp_grad_ptr(t.ddp, t.grad_index[l][1], &p[1]), "ddp_grad_ptr");
#ifdef DDP_EXAMPLE_CUDA
      if (t.device_grads) {
        t.dev[l][0] = p[0];
        t.dev[l][1] = p[1];
        continue;
      }
#endif
      m.dW[l] = p[0];
      m.db[l] = p[1];
      if (opt.shard) {
        check(ddp_param_ptr(t.ddp, t.grad_index[l][0], (void**)&m.W[l]), "ddp_param_ptr");
        check(ddp_param_ptr(t.ddp, t.grad_index[l][1], (void**)&m.b[l]), "ddp_param_ptr");
      }
    }
#ifdef DDP_EXAMPLE_CUDA
  if (t.device_grads) cudaStreamCreate(&t.stream);
#endif

  /* The same initial parameters everywhere: rank 0 draws them (He init) and broadcasts them, as apex
   * does at construction. */
  if (t.rank == 0) {
    uint64_t s = 777;
    for (int l = 0; l < NUM_LAYERS; ++l) {
      float scale = sqrtf(2.0f / (float)kDims[l]) * (l == NUM_LAYERS - 1 ? 0.1f : 1.0f);
      for (size_t i = 0; i < wcount(l); ++i) m.W[l][i] = scale * gaussian(&s);
      memset(m.b[l], 0, (size_t)kDims[l + 1] * sizeof(float));
    }
  }
  if (opt.shard) {
    check(ddp_broadcast_params(t.ddp, 0, NULL), "ddp_broadcast_params");
  } else if (!t.device_grads && !joiner) { /* (a joiner takes the job's state when it is admitted) */
    void* bufs[2 * NUM_LAYERS];
    size_t counts[2 * NUM_LAYERS];
    ddp_dtype_t types[2 * NUM_LAYERS];
    for (int l = 0; l < NUM_LAYERS; ++l) {
      bufs[2 * l] = m.W[l], counts[2 * l] = wcount(l), types[2 * l] = DDP_F32;
      bufs[2 * l + 1] = m.b[l], counts[2 * l + 1] = (size_t)kDims[l + 1], types[2 * l + 1] = DDP_F32;
    }
    check(ddp_broadcast(t.ddp, bufs, counts, types, 2 * NUM_LAYERS, 0, NULL), "ddp_broadcast");
  } else if (t.rank != 0) {
    /* NCCL path: every rank draws the same parameters itself (the broadcast would need device memory). */
    uint64_t s = 777;
    for (int l = 0; l < NUM_LAYERS; ++l) {
      float scale = sqrtf(2.0f / (float)kDims[l]) * (l == NUM_LAYERS - 1 ? 0.1f : 1.0f);
      for (size_t i = 0; i < wcount(l); ++i) m.W[l][i] = scale * gaussian(&s);
      memset(m.b[l], 0, (size_t)kDims[l + 1] * sizeof(float));
    }
  }

  int nb = 0;
  if (!joiner) check(ddp_get_plan(t.ddp, &nb, NULL), "ddp_get_plan");
  /* Optimizer state: per tensor, or (sharded) per bucket shard only. */
  size_t state_bytes = 0;
  float *s1[2 * NUM_LAYERS] = {0}, *s2[2 * NUM_LAYERS] = {0};
  float** shard_s1 = calloc((size_t)nb, sizeof(float*));
  float** shard_s2 = calloc((size_t)nb, sizeof(float*));
  for (int l = 0; !opt.shard && l < NUM_LAYERS; ++l) {
    const size_t n[2] = {wcount(l), (size_t)kDims[l + 1]};
    for (int k = 0; k < 2; ++k) {
      s1[2 * l + k] = state_alloc(opt.optimizer, 0, n[k], &state_bytes);
      s2[2 * l + k] = state_alloc(opt.optimizer, 1, n[k], &state_bytes);
    }
  }
  for (int b = 0; opt.shard && b < nb; ++b) {
    ddp_shard_info_t sh;
    sh.size = sizeof sh;
    check(ddp_get_shard(t.ddp, b, &sh), "ddp_get_shard");
    shard_s1[b] = state_alloc(opt.optimizer, 0, sh.shard_numel, &state_bytes);
    shard_s2[b] = state_alloc(opt.optimizer, 1, sh.shard_numel, &state_bytes);
  }
  if (t.rank == 0)
    printf(
        "mlp_trainer: %d ranks over %s, %.2fM parameters in %d grads, %d buckets (%s layout, "
        "message_size %zu%s), batch %d per rank (%d global)\n",
        t.world, opt.comm, (double)params / 1e6, 2 * NUM_LAYERS, nb, arena ? "arena" : "copy", opt.message_size,
        opt.delay ? ", delay_allreduce" : "", B, B * t.world);
  if (t.rank == 0)
    printf("optimizer %s%s: state %.2f MB per rank (%.2f MB for the whole model)\n",
           opt.optimizer == OPT_ADAM       ? "adam"
           : opt.optimizer == OPT_MOMENTUM ? "momentum"
                                           : "sgd",
           opt.shard ? ", sharded" : "", (double)state_bytes / 1e6,
           (double)(params * sizeof(float) * (size_t)state_per_element(opt.optimizer)) / 1e6);

  const int early_update = !opt.update_after && !opt.shard && !opt.elastic && !t.device_grads;
  int* labels = xmalloc((size_t)B * sizeof(int));
  double* steps_s = xmalloc((size_t)opt.steps * sizeof(double));
  /* Two doubles per rank; an elastic job may grow (joiners), so room for more than it has now. */
  const int all_cap = opt.elastic ? 4096 : t.world > 0 ? t.world : 1;
  double* volatile all = xmalloc((size_t)all_cap * 2 * sizeof(double));
  /* (volatile: the values they hold when a lost rank jumps back to recover) */
  volatile double first_loss = 0.0, last_loss = 0.0, compute_s = 0.0;
  volatile int step = 0;
  jmp_buf lost;
  if (opt.elastic) {
    g_lost = &lost;
    if (setjmp(lost))
      step = recover(&t, &m, s1, s2, &opt, all_cap);
    else if (joiner) /* admitted at the job's next step boundary, with the job's state */
      step = recover(&t, &m, s1, s2, &opt, all_cap);
  }
  for (; step < opt.steps; ++step) {
    const double t0 = now_s();
    /* This rank's slice of the global batch. */
    for (int r = 0; r < B; ++r) {
      uint64_t idx = ((uint64_t)step * (uint64_t)(B * t.world) + (uint64_t)(t.rank * B + r)) % TRAIN_SAMPLES;
      labels[r] = draw_sample(idx, m.act[0] + (size_t)r * INPUT_DIM);
    }
    int correct = 0;
    if (opt.shard && step > 0) /* the gather launched after the last step, layer by layer in forward order */
      for (int l = 0; l < NUM_LAYERS; ++l) check(ddp_wait_params(t.ddp, t.grad_index[l][0], NULL), "ddp_wait_params");
    const double local_loss = forward(&m, labels, &correct) / B;
    if (step == opt.kill_step && t.first_rank == opt.kill_rank) raise(SIGKILL); /* --kill: a rank dies */

    check(ddp_begin_backward(t.ddp, stream_of(&t)), "ddp_begin_backward");
    for (int l = NUM_LAYERS - 1; l >= 0; --l) {
      linear_backward_params(m.act[l], m.dact[l + 1], m.dW[l], m.db[l], B, kDims[l], kDims[l + 1]);
      layer_grads_ready(&t, &m, l); /* reduction of this layer's bucket starts now */
      if (l > 0) linear_backward_input(m.dact[l + 1], m.W[l], m.act[l], m.dact[l], B, kDims[l], kDims[l + 1]);
    }
    const double t_bwd = now_s();
    /* Each layer's update as soon as its bucket is reduced (ddp_wait_grad), while the buckets of the
     * layers before it are still on the wire; what is not reduced yet, after ddp_finish_backward.
     * Not with --elastic: an update made before the iteration commits could not be skipped when a
     * rank is lost. */
    int updated[NUM_LAYERS] = {0};
    for (int l = NUM_LAYERS - 1; early_update && l >= 0; --l) {
      int rw = 0, rb = 0;
      check(ddp_wait_grad(t.ddp, t.grad_index[l][0], NULL, &rw), "ddp_wait_grad");
      check(ddp_wait_grad(t.ddp, t.grad_index[l][1], NULL, &rb), "ddp_wait_grad");
      if (!rw || !rb) break; /* not launched yet (buckets launch in order): none after it either */
      update_layer(&opt, &m, s1, s2, step + 1, l);
      updated[l] = 1;
    }
    check(ddp_finish_backward(t.ddp, stream_of(&t)), "ddp_finish_backward");
    grads_to_host(&t, &m);
    /* The optimizer: every rank applies the same averaged grads, so the parameters stay identical.
     * Sharded: each rank updates its own shards, then the shards are gathered. */
    if (opt.shard) {
      for (int b = 0; b < nb; ++b) {
        ddp_shard_info_t sh;
        sh.size = sizeof sh;
        check(ddp_get_shard(t.ddp, b, &sh), "ddp_get_shard");
        optimizer_step(&opt, step + 1, sh.param_shard, sh.grad_shard, shard_s1[b], shard_s2[b], sh.shard_numel);
      }
      check(ddp_gather_params(t.ddp, NULL), "ddp_gather_params");
    } else {
      for (int l = 0; l < NUM_LAYERS; ++l)
        if (!updated[l]) update_layer(&opt, &m, s1, s2, step + 1, l);
    }
    const double t1 = now_s();
    steps_s[step] = t1 - t0;
    compute_s += t_bwd - t0;

    /* The global loss from every rank's local loss (the same sum in the same order on every rank),
     * and rank 0's parameter checksum compared with ours. */
    if (opt.shard) /* the checksum below reads every parameter (a trainer would go on to the next forward) */
      check(ddp_wait_params(t.ddp, -1, NULL), "ddp_wait_params");
    double mine[2] = {local_loss, param_checksum(&m)};
    gather_doubles(&t, mine, 2, all);
    double loss = 0.0;
    for (int r = 0; r < t.world; ++r) loss += all[2 * r];
    loss /= t.world;
    /* Every rank compares every rank's checksum with rank 0's, so that all of them stop together
     * (a rank that left alone would leave the others waiting in the next step's reduction). */
    for (int r = 1; r < t.world; ++r) {
      if (all[2 * r + 1] == all[1]) continue;
      if (t.rank == r)
        fprintf(stderr, "rank %d: step %d: parameters differ from rank 0's (checksum %.17g vs %.17g)\n", r, step,
                all[2 * r + 1], all[1]);
      exit(1);
    }
    /* Rank 0 reports progress; the other ranks speak only when they disagree (checked above). */
    if (t.rank == 0 && (step == 0 || step == opt.steps - 1 || (!opt.quiet && (step + 1) % opt.print_every == 0)))
      printf("step %3d/%d  loss %.6f  (%.0f ms)\n", step + 1, opt.steps, loss, 1e3 * steps_s[step]);
    if (step == 0 || first_loss == 0.0) first_loss = loss;
    last_loss = loss;
  }
  fflush(stdout);

  /* Test accuracy: each rank evaluates its shard of the test set; the counts are gathered. */
  int correct_sum = 0, seen = 0;
  for (int start = t.rank * B; start < TEST_SAMPLES; start += B * t.world) {
    int n = TEST_SAMPLES - start < B ? TEST_SAMPLES - start : B;
    m.batch = n;
    for (int r = 0; r < n; ++r)
      labels[r] = draw_sample(TRAIN_SAMPLES + (uint64_t)(start + r), m.act[0] + (size_t)r * INPUT_DIM);
    int c = 0;
    (void)forward(&m, labels, &c);
    correct_sum += c;
    seen += n;
  }
  m.batch = B;
  double mine[2] = {(double)correct_sum, (double)seen};
  gather_doubles(&t, mine, 2, all);
  double correct_all = 0.0, seen_all = 0.0;
  for (int r = 0; r < t.world; ++r) correct_all += all[2 * r], seen_all += all[2 * r + 1];

  ddp_stats_t st;
  memset(&st, 0, sizeof st);
  st.size = sizeof st;
  check(ddp_get_stats(t.ddp, &st), "ddp_get_stats");
  /* Step time: median over the steps after the first (which pays first touches). */
  int ns = opt.steps > 1 ? opt.steps - 1 : 1;
  double* sorted = xmalloc((size_t)ns * sizeof(double));
  memcpy(sorted, opt.steps > 1 ? steps_s + 1 : steps_s, (size_t)ns * sizeof(double));
  qsort(sorted, (size_t)ns, sizeof(double), cmp_double);
  if (t.rank == 0) {
    printf("loss %.4f -> %.4f over %d steps; test accuracy %.2f%% (%d samples)\n", first_loss, last_loss, opt.steps,
           100.0 * correct_all / (seen_all > 0 ? seen_all : 1), (int)seen_all);
    printf("step time: median %.1f ms (min %.1f, max %.1f); forward+backward compute %.1f ms per step\n",
           1e3 * sorted[ns / 2], 1e3 * sorted[0], 1e3 * sorted[ns - 1], 1e3 * compute_s / opt.steps);
    const double iters = st.iterations ? (double)st.iterations : 1.0;
    const double comm_ms = (double)st.comm_time_ns / 1e6 / iters, exposed_ms = (double)st.exposed_time_ns / 1e6 / iters;
    printf(
        "buckets: %d per step, %.1f MB reduced per step; library memory %.1f MB (of which the grads' arena %.1f MB)\n",
        nb, (double)st.bytes_reduced / 1e6 / iters, (double)st.library_bytes / 1e6, (double)st.arena_bytes / 1e6);
    printf(
        "overlap: buckets in flight %.1f ms per step, %.1f ms of it exposed (ddp_finish_backward and ddp_wait_grad "
        "waiting): "
        "%.0f%% hidden behind backward\n",
        comm_ms, exposed_ms, comm_ms > 0.0 && exposed_ms < comm_ms ? 100.0 * (1.0 - exposed_ms / comm_ms) : 0.0);
    printf("ranks agree: losses and parameters identical on all %d ranks at every step\n", t.world);
    if (opt.timeline)
      printf(
          "timeline: one Chrome trace per rank, %s with .rankN before its extension (merge them with "
          "tools/merge_timeline.py; open in ui.perfetto.dev or chrome://tracing)\n",
          opt.timeline);
  }
  int fell = last_loss < first_loss;
  check(ddp_destroy(t.ddp), "ddp_destroy");
#ifdef DDP_EXAMPLE_CUDA
  if (t.device_grads) {
    cudaStreamDestroy(t.stream);
    if (!arena)
      for (int l = 0; l < NUM_LAYERS; ++l) cudaFree(t.dev[l][0]), cudaFree(t.dev[l][1]);
  }
#endif
  for (int l = 0; l < NUM_LAYERS; ++l) {
    if (!opt.shard) free(m.W[l]), free(m.b[l]);
    if (!arena || t.device_grads) free(m.dW[l]), free(m.db[l]);
  }
  for (int k = 0; k < 2 * NUM_LAYERS; ++k) free(s1[k]), free(s2[k]);
  for (int b = 0; b < nb; ++b) free(shard_s1[b]), free(shard_s2[b]);
  free(shard_s1), free(shard_s2);
  for (int l = 0; l <= NUM_LAYERS; ++l) free(m.act[l]), free(m.dact[l]);
  free(labels), free(steps_s), free(all), free(sorted);
  if (opt.steps >= 5 && !fell) {
    if (t.rank == 0) fprintf(stderr, "the loss did not fall\n");
    return 1;
  }
  return 0;
}

/* --comm local: the ranks are threads of this process, each with its own comm over one local group. */
typedef struct local_rank {
  const options_t* opt;
  ddp_local_group_t group;
  int rank, status;
} local_rank_t;

static void* local_rank_main(void* arg) {
  local_rank_t* r = arg;
  ddp_comm_t comm = NULL;
  g_rank = r->rank;
  check(ddp_comm_init_local(r->group, r->rank, &comm), "ddp_comm_init_local");
  r->status = train(r->opt, comm, 0);
  return NULL;
}

static int run_local(const options_t* opt) {
  ddp_local_group_t group = NULL;
  check(ddp_local_group_create(opt->ranks, &group), "ddp_local_group_create");
  local_rank_t* ranks = calloc((size_t)opt->ranks, sizeof *ranks);
  pthread_t* threads = calloc((size_t)opt->ranks, sizeof *threads);
  if (!ranks || !threads) {
    fprintf(stderr, "out of memory\n");
    return 1;
  }
  int status = 0;
  for (int r = 0; r < opt->ranks; ++r) {
    ranks[r] = (local_rank_t){opt, group, r, 0};
    if (pthread_create(&threads[r], NULL, local_rank_main, &ranks[r]) != 0) {
      fprintf(stderr, "cannot start the thread of rank %d\n", r);
      exit(1);
    }
  }
  for (int r = 0; r < opt->ranks; ++r) {
    pthread_join(threads[r], NULL);
    if (ranks[r].status != 0) status = ranks[r].status;
  }
  check(ddp_local_group_destroy(group), "ddp_local_group_destroy");
  free(ranks), free(threads);
  return status;
}

int main(int argc, char** argv) {
  const options_t opt = parse(argc, argv);
  make_centres(); /* the synthetic task, shared read-only by every rank of this process */
  if (strcmp(opt.comm, "local") == 0) return run_local(&opt);
  int device_grads = 0;
  ddp_comm_t comm = make_comm(opt.comm, opt.init, &device_grads);
  return train(&opt, comm, device_grads);
}
