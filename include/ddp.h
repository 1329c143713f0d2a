/*
 * libddp: data-parallel gradient reduction for any trainer, behind a C ABI.
 *
 * A trainer registers its gradient buffers once, then in every iteration
 *   ddp_begin_backward -> ddp_grad_ready (once per grad, any order) -> ddp_finish_backward
 * and libddp groups the grads into buckets, reduces each bucket across ranks while the backward pass
 * is still running (NCCL for device memory, MPI for host memory), scales the result (average,
 * pre-divide) and leaves the reduced values in the grads.
 *
 * Conventions of this header
 * - Every function returns a ddp_status_t; results go through out-pointers, which are written only on
 *   success. On failure ddp_last_error() holds a message for the calling thread.
 * - Handles are opaque. Destroy functions accept NULL.
 * - Streams (cudaStream_t) and foreign communicators (MPI_Comm*, ncclComm_t) cross as void*: this
 *   header includes no CUDA, NCCL or MPI header and compiles as C99 and as C++.
 * - Memory kinds: a context over an MPI, Gloo, self or local communicator works on host memory; over
 *   an NCCL communicator on device memory of that communicator's GPU. Streams are ignored on host
 *   memory (pass NULL).
 * - "Collective" means every rank of the communicator must make the same call, in the same order
 *   relative to the other collective calls of the same context. ddp_broadcast has a channel of its
 *   own. ddp_allreduce_host, ddp_barrier and ddp_join (and, with config.uneven_inputs, the start of
 *   every synced iteration) first tell each other what each rank calls, so that ranks that call
 *   different ones all get DDP_ERR_MISMATCH instead of waiting for each other.
 * - After a fatal error (a timeout, a failed collective, its ranks disagreeing: DDP_ERR_MISMATCH, an
 *   internal error) a context answers DDP_ERR_ABORTED, with the original reason in the message, to
 *   every further call except ddp_destroy, ddp_get_stats and the plan getters. An elastic context
 *   (config.elastic) answers DDP_ERR_RANK_LOST instead when a peer died or was cut off, until
 *   ddp_recover rebuilds it over the ranks that are left, and DDP_ERR_RANK_JOINING at the step
 *   boundary where ranks that asked to join wait, until ddp_recover admits them.
 * - A refused call (DDP_ERR_INVALID_ARGUMENT, DDP_ERR_INVALID_STATE, DDP_ERR_UNSUPPORTED) leaves the
 *   context as it was. A collective call refused on one rank is refused there alone: the other ranks
 *   wait for it until their timeout.
 * - Threads: every function may be called from any thread. The calls on one context come from one
 *   thread at a time, except ddp_grad_ready and ddp_grad_ready_ptr, which several threads may make at
 *   once for different grads. Contexts are independent of each other.
 */
#ifndef DDP_H_
#define DDP_H_

#include <stddef.h>
#include <stdint.h>

#define DDP_VERSION_MAJOR 0
#define DDP_VERSION_MINOR 2
#define DDP_VERSION_PATCH 0
/* One integer that orders versions: 10000*major + 100*minor + patch. */
#define DDP_VERSION_CODE (DDP_VERSION_MAJOR * 10000 + DDP_VERSION_MINOR * 100 + DDP_VERSION_PATCH)

/* DDP_API marks the exported functions. The library's own build defines DDP_BUILDING_LIBRARY; a
 * program that links the static library on Windows defines DDP_STATIC. Elsewhere every other symbol
 * of the library is hidden (-fvisibility=hidden and a version script). */
#if defined(_WIN32)
#if defined(DDP_BUILDING_LIBRARY)
#define DDP_API __declspec(dllexport)
#elif defined(DDP_STATIC)
#define DDP_API
#else
#define DDP_API __declspec(dllimport)
#endif
#elif defined(__GNUC__) && __GNUC__ >= 4
#define DDP_API __attribute__((visibility("default")))
#else
#define DDP_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------------------------------
 * Status codes. Values are explicit and never renumbered; new codes are added before the count.
 * X(name, value, fixed text)
 * --------------------------------------------------------------------------------------------- */
#define DDP_STATUS_MAP(X)                                                \
  X(DDP_SUCCESS, 0, "success")                                           \
  X(DDP_ERR_INVALID_ARGUMENT, 1, "invalid argument")                     \
  X(DDP_ERR_INVALID_STATE, 2, "call not valid in the current state")     \
  X(DDP_ERR_MISMATCH, 3, "ranks disagree")                               \
  X(DDP_ERR_OUT_OF_MEMORY, 4, "out of memory")                           \
  X(DDP_ERR_UNSUPPORTED, 5, "not supported by this build or backend")    \
  X(DDP_ERR_CUDA, 6, "CUDA error")                                       \
  X(DDP_ERR_NCCL, 7, "NCCL error")                                       \
  X(DDP_ERR_MPI, 8, "MPI error")                                         \
  X(DDP_ERR_TIMEOUT, 9, "timed out waiting for other ranks")             \
  X(DDP_ERR_ABORTED, 10, "context aborted after an earlier fatal error") \
  X(DDP_ERR_INTERNAL, 11, "internal error")                              \
  X(DDP_ERR_RANK_LOST, 12, "a rank was lost: call ddp_recover")          \
  X(DDP_ERR_RANK_JOINING, 13, "a rank waits to join: call ddp_recover")

typedef enum ddp_status {
#define DDP_STATUS_ENUM_(name, value, text) name = value,
  DDP_STATUS_MAP(DDP_STATUS_ENUM_)
#undef DDP_STATUS_ENUM_
      DDP_STATUS_COUNT
} ddp_status_t;

/* Element types of gradients. */
typedef enum ddp_dtype {
  DDP_F16 = 0,  /* IEEE binary16 */
  DDP_BF16 = 1, /* bfloat16 */
  DDP_F32 = 2,
  DDP_F64 = 3,
  DDP_DTYPE_COUNT, /* grads are of the types above */
  /* Integers, for ddp_allreduce_host and ddp_broadcast (token counts, metrics, a step count): never a
   * grad. */
  DDP_I32 = 16,
  DDP_I64 = 17
} ddp_dtype_t;

/* The reduction of ddp_allreduce_host and ddp_comm_allreduce. */
typedef enum ddp_op {
  DDP_OP_SUM = 0,
  DDP_OP_AVG = 1, /* the sum divided by the world size (integers: rounded toward zero) */
  DDP_OP_MAX = 2,
  DDP_OP_MIN = 3
} ddp_op_t;

/* How buckets travel (ddp_config_t.compression). */
typedef enum ddp_compression {
  /* In the grads' own type (16-bit grads: see allreduce_always_fp32). */
  DDP_COMPRESS_NONE = 0,
  /* f32 and f64 buckets travel as bfloat16: half the bytes (a quarter for f64). On host
   * communicators (MPI, Gloo) an f32 bucket is reduced as f32 and only what crosses the wire is
   * bfloat16: each hop sends its fp32 partial sum rounded to bfloat16 and the receiver adds it in
   * fp32; the rank that finishes a chunk rounds it to bfloat16 once, and every rank gets those bits.
   * Elsewhere (NCCL, f64 buckets) the grads are cast once on the way in (with the pre-scale), each
   * addition is done in fp32 math and rounded to bfloat16 for the next hop, and the sum is cast back
   * once on the way out. Either way every reduced value is the uncompressed result within a few
   * bfloat16 roundings (relative 2^-8 each): one per hop of the sum (world size - 1 at most), one for
   * the result, and on the second path one for the inputs. 16-bit grads travel as they are. On NCCL
   * it needs NCCL 2.10 or later (ddp_create: DDP_ERR_UNSUPPORTED, "this communicator cannot sum
   * bf16"). ddp_get_bucket reports the 16-bit type as the bucket's wire, and bytes_reduced counts
   * bytes in it. */
  DDP_COMPRESS_BF16 = 1,
  /* The same with IEEE binary16: 3 more bits of precision, range +-65504 (scale the loss so that no
   * grad or partial sum overflows; an overflow is an Inf, never hidden). */
  DDP_COMPRESS_FP16 = 2,
  /* f32 and f64 buckets travel as int8 in blocks of 256 elements, each block with its own fp32 scale
   * (its largest magnitude / 127; values rounded to nearest). Below 3 ranks the blocks are
   * exchanged by an all-gather: every rank dequantizes every rank's blocks and sums them in rank
   * order (fp32 math for f32 buckets, fp64 for f64). From 3 ranks on (host communicators; the
   * environment variable DDP_INT8_SCATTER_MIN_WORLD moves the threshold) by a reduce-scatter: the
   * bucket is cut into one shard of whole blocks per rank, each rank receives every rank's blocks of
   * its own shard and sums them the same way, re-quantizes that sum and all-gathers it (a bucket
   * too small to gain from it, fewer than about 2 x world blocks, keeps the all-gather). Either way
   * every rank gets the same bits. Error feedback: what a rank's rounding lost in a bucket (its input
   * minus what it sent) is kept by the library, 4 bytes per element (counted in library_bytes), and
   * added to that rank's next input for the bucket, so roundings do not pile up into a bias; the
   * reduce-scatter keeps the re-quantization's loss of each shard the same way (4 bytes per element
   * of this rank's shard). The error, one formula for both collectives: for an element of block B
   * (256 elements counted from the bucket's start) of a bucket reduced over W ranks, in its t-th
   * reduction since its plan was made (ddp_create, the learned plan's adoption, ddp_recover, a
   * join: t = 0 owes nothing),
   *     x_r      rank r's value: its grad, divided by gradient_predivide_factor
   *     a_r(t)   the largest |x_r| in block B on rank r
   *     m_r(t) = a_r(t) + e_r(t-1),      e_r(t) = k m_r(t) + 2^-142,      e_r(-1) = 0
   *     S      = the reduced sum (before gradient_average's multiplication by f / W)
   *     |S - sum_r x_r|  <=  sum_r (e_r(t) + e_r(t-1))  +  2 (W + 1) u sum_r m_r(t)
   *                       [ + E(t) + E(t-1) + 2 u M(t) with the reduce-scatter, where
   *                         M(t) = (1 + 2^-10) sum_r m_r(t) + E(t-1),  E(t) = k M(t) + 2^-142,  E(-1) = 0 ]
   * with k = (1 + 2^-10) / 254 (half a step of a block's scale, max / 127, plus fp32's roundings),
   * u = 2^-24 in f32 buckets and 2^-53 in f64 ones (the sum's own roundings), and 2^-142 for scales
   * below fp32's normal range. e_r(t) bounds what rank r keeps (its rounding error), E(t) what the
   * shard's owner keeps of the re-quantized sum; gradient_average's multiplication rounds once more
   * (u of the result). The errors telescope: over iterations the average of the reduced values
   * converges to the exact average. A block holding a NaN or an Inf, or in f64 buckets a magnitude
   * past the fp32 range (> FLT_MAX, about 3.4e38) in what a rank quantizes (its values plus its
   * kept errors, or with the reduce-scatter the shard's sum it re-quantizes), becomes NaN on every
   * rank, never hidden; its kept errors are dropped. (An f64 sum past that range that is not
   * re-quantized, with the all-gather, is carried as any other value.)
   * Bytes on the wire per rank: about 0.25x those of the fp32 ring at any world size with the
   * reduce-scatter (2 (world - 1) / world x (n + n/64) against 2 (world - 1) / world x 4n); the
   * all-gather's (world - 1) x (n + n/64) is the same at 2 ranks. Host memory and NCCL alike (on
   * GPUs: CUDA kernels running the same element code, ncclAllGather, and ncclSend / ncclRecv for
   * the reduce-scatter, NCCL 2.7 or later, an older one all-gathers; such buckets are not grouped
   * with others).
   * 16-bit buckets travel as they are. Not with config.shard. A rank that joins (ddp_join) drops
   * its kept errors, so that its shadowing contributes zeros. */
  DDP_COMPRESS_INT8 = 3
} ddp_compression_t;

/* Uneven inputs (ddp_config_t.uneven_inputs, ddp_join). */
typedef enum ddp_uneven {
  DDP_UNEVEN_OFF = 0,
  /* Averages divide by the ranks that contributed to the iteration (not joined). */
  DDP_UNEVEN_BY_CONTRIBUTORS = 1,
  /* Averages divide by the world size, as torch's divide_by_initial_world_size. In both modes
   * gradient_predivide_factor f keeps its meaning (1/f before the sum, f/n after it, n the divisor
   * above); without gradient_average nothing is divided. */
  DDP_UNEVEN_BY_WORLD = 2
} ddp_uneven_t;

/* Where a grad's storage lives. */
typedef enum ddp_layout {
  /* The user owns every grad; each bucket is packed into a library buffer, reduced and unpacked back
   * (one pass each way, scaling folded in). Grad pointers may change between iterations. */
  DDP_LAYOUT_COPY = 0,
  /* The library owns one contiguous buffer per bucket and every grad is a view into it (apex
   * retain_allreduce_buffers, torch gradient_as_bucket_view): zero copies. ddp_grad_ptr says where. */
  DDP_LAYOUT_ARENA = 1
} ddp_layout_t;

/* How buckets are built. */
typedef enum ddp_plan_order {
  /* apex: the first synced backward records the order in which grads become ready and reduces
   * everything at its end; rank 0's buckets are then adopted by every rank. */
  DDP_PLAN_LEARNED = 0,
  /* Buckets follow reverse registration order and are known before the first backward, so the
   * first iteration overlaps too. */
  DDP_PLAN_REGISTRATION = 1
} ddp_plan_order_t;

/* What ddp_finish_backward does with grads that never became ready in a synced iteration. */
typedef enum ddp_unused_policy {
  /* Reduce them as zeros (so no rank hangs), then return DDP_ERR_INVALID_STATE on every rank,
   * naming the grads and the ranks. */
  DDP_UNUSED_ERROR = 0,
  /* Treat them as zeros and reduce them (torch find_unused_parameters). Success. */
  DDP_UNUSED_ZERO = 1
} ddp_unused_policy_t;

/* Flags of ddp_register_grad. */
#define DDP_GRAD_TRIGGER 1u /* apex allreduce_trigger_params: this grad closes its bucket */
/* Copy layout: `grad` is a stand-in, not the grad's storage (one scratch buffer registered for every
 * grad that does not exist yet, as a framework's lazily allocated grads need): it is not checked for
 * overlap with other grads, and the real buffer must be given with ddp_set_grad_ptr or
 * ddp_grad_ready_ptr before the grad's values matter (a stand-in that is reduced, an unused grad for
 * one, is read and written like any grad). May differ between ranks. (Added in 0.2.) */
#define DDP_GRAD_STAND_IN 2u

/* ------------------------------------------------------------------------------------------------
 * Errors
 * --------------------------------------------------------------------------------------------- */

/* The fixed text of a status ("success", "invalid argument", ...). Never NULL; an unknown value gives
 * "unknown status". Thread-safe. */
DDP_API const char* ddp_status_string(ddp_status_t status);

/* The detailed message of the last failed call made by the calling thread ("" if none). The pointer
 * stays valid until this thread's next failing libddp call. Thread-safe (one buffer per thread). */
DDP_API const char* ddp_last_error(void);

/* The library's version, as DDP_VERSION_CODE; compare with the header's to catch a stale library. */
DDP_API int ddp_version(void);

/* ------------------------------------------------------------------------------------------------
 * Communicators
 * --------------------------------------------------------------------------------------------- */

typedef struct ddp_comm* ddp_comm_t;               /* a communicator over a set of ranks */
typedef struct ddp_local_group* ddp_local_group_t; /* in-process ranks (threads), for tests */
typedef struct ddp_nccl_id {
  char bytes[128]; /* opaque, the same as ncclUniqueId */
} ddp_nccl_id_t;

/* Host-memory communicator over MPI. `mpi_comm` is the address of an MPI_Comm (pass &comm) or NULL
 * for MPI_COMM_WORLD; libddp duplicates it, so the caller's communicator is never used by the
 * library. If MPI is not initialized, libddp initializes it with MPI_THREAD_MULTIPLE and finalizes it
 * at process exit; if it is, the thread level must be MPI_THREAD_MULTIPLE (DDP_ERR_UNSUPPORTED
 * otherwise). Collective over the MPI communicator. DDP_ERR_UNSUPPORTED in a build without MPI.
 * Destroy every context made over it before MPI_Finalize (each has a thread that uses MPI while it
 * lives). */
DDP_API ddp_status_t ddp_comm_init_mpi(const void* mpi_comm, ddp_comm_t* comm);

/* Host-memory communicator over Gloo (TCP), needing no MPI: processes started by any launcher
 * (torchrun, a job scheduler, a shell loop) meet through a rendezvous named by `init_method`:
 *   "env://" or NULL   MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE, as torchrun sets them. Rank 0
 *                      listens on MASTER_ADDR's port DDP_STORE_PORT if set, else MASTER_PORT + 1
 *                      (MASTER_PORT itself is torchrun's or torch.distributed's own store).
 *                      Without RANK or WORLD_SIZE (when `rank` or `size` is -1), as "auto".
 *   "auto"             rank, size and rendezvous from the variables of the launcher that started the
 *                      process, whichever it is: torchrun (RANK, WORLD_SIZE, LOCAL_RANK), Open MPI's
 *                      mpirun (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK), MPICH's mpiexec and other
 *                      PMI servers (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID), PMIx (PMIX_RANK), Slurm's
 *                      srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID), in this order of
 *                      precedence; every other launcher's variables that are set must agree
 *                      (DDP_ERR_INVALID_ARGUMENT naming both variables and values otherwise), those
 *                      of an outer launcher (srun torchrun, mpirun in a Slurm batch script) are left
 *                      out. Rank 0 listens at MASTER_ADDR, else the loopback when the job runs on
 *                      one host (a local size equal to the world size, SLURM_STEP_NUM_NODES=1),
 *                      else the first host of SLURM_STEP_NODELIST; on DDP_STORE_PORT, else
 *                      MASTER_PORT + 1, else a port in 20000..28999 derived from SLURM_JOB_ID and
 *                      SLURM_STEP_ID or from the MPI launcher's job id. What is missing is refused,
 *                      naming what to set. What was found goes to the log in one line
 *                      (DDP_LOG_INFO). docs/api.md, "The init method auto", has every rule.
 *   "tcp://HOST:PORT"  rank 0 listens on PORT; the others connect to HOST:PORT.
 *   "file:///DIR"      an empty directory that every rank sees (a shared file system); libddp
 *                      removes its files once every rank has read them.
 * `rank` and `size` of -1 are read from RANK and WORLD_SIZE (with "auto", from the launcher; a rank
 * or size given must agree with it). The ranks then connect to each other
 * directly (a full mesh of TCP connections, on the interface that reaches rank 0, or the one named
 * by GLOO_SOCKET_IFNAME). Collective over the `size` ranks; bounded by DDP_INIT_TIMEOUT_MS (default
 * 300000 ms; DDP_ERR_TIMEOUT naming the ranks that never arrived). The same timeout, stall-inspector
 * and fault semantics as MPI: a collective whose peer stalls returns DDP_ERR_TIMEOUT at the
 * context's timeout_ms; one whose peer died returns DDP_ERR_TIMEOUT at once, naming it. Calling it
 * again with the same arguments makes another communicator over the same rendezvous.
 * The rendezvous checks every rank against rank 0 and counts the ranks as they arrive: a rank of
 * another job (its DDP_JOB_ID, else TORCHELASTIC_RUN_ID, differs from rank 0's; two jobs on one
 * port) gets DDP_ERR_MISMATCH naming both ids while rank 0 warns and waits on; a rank number claimed
 * by two processes, a WORLD_SIZE other than rank 0's, or a rank beyond the world is DDP_ERR_MISMATCH
 * on every rank. While ranks are missing, rank 0 warns every DDP_INIT_PROGRESS_MS (default 5000).
 * DDP_ERR_INVALID_ARGUMENT at once for a malformed method, a missing variable, or a port
 * (MASTER_PORT, DDP_STORE_PORT, tcp://) outside 1..65535, MASTER_PORT 65535 included when the store
 * takes MASTER_PORT + 1; DDP_ERR_UNSUPPORTED in a build without Gloo. Before any connection, the
 * connections a context over this world will hold (about 4 per other rank) are checked against the
 * process's open-file limit (a soft limit below the hard one is raised, said in the log) and against
 * the kernel's port range shared by the ranks of this host (LOCAL_WORLD_SIZE or the launcher's
 * equivalent): DDP_ERR_UNSUPPORTED at once where they do not fit, giving the numbers and the command
 * that fixes it (ulimit -n, net.ipv4.ip_local_port_range). */
DDP_API ddp_status_t ddp_comm_init_gloo(const char* init_method, int rank, int size, ddp_comm_t* comm);
/* As ddp_comm_init_gloo, with the bound given: `timeout_ms` milliseconds, 0 to wait forever; the
 * whole creation (rendezvous, connections, first barrier) ends within it. Every duration argument of
 * this header and DDP_INIT_TIMEOUT_MS (0 .. 2^62) may be as large as its type holds: a deadline past
 * the clock's range (about 292 years) is forever. A negative `timeout_ms` is DDP_ERR_INVALID_ARGUMENT,
 * here and in every ddp_comm_*_timeout and ddp_comm_join_* call. */
DDP_API ddp_status_t ddp_comm_init_gloo_timeout(const char* init_method, int rank, int size, int64_t timeout_ms,
                                                ddp_comm_t* comm);

/* A communicator that joins a running elastic job (config.elastic, Gloo) over `init_method`'s store
 * (as in ddp_comm_init_gloo; a TCP store must outlive the ranks that died: tools/ddp_store or
 * ddp_launch --elastic), as a replacement for a lost rank or as one more rank. It connects to the
 * store only: it has no rank yet (ddp_comm_rank answers DDP_ERR_INVALID_STATE) and nothing collective
 * runs over it. Make a context over it with the job's config (config.elastic set), register the job's
 * grads in the job's order (and set the job's comm hook, if any), then call ddp_recover: it asks the
 * job to admit this process and waits up to `timeout_ms` (0: forever) for the job's next step
 * boundary (the job's ranks notice the request within about 100 ms, agree on it in their next synced
 * iteration, and admit it at the one after). Until then that context answers DDP_ERR_RANK_JOINING to
 * every call but registration, ddp_set_comm_hook, ddp_recover, ddp_get_stats and ddp_destroy
 * (ddp_comm_size too answers DDP_ERR_INVALID_STATE); a job that ends first says so (DDP_ERR_ABORTED,
 * see ddp_recover). The join goes to the context made over the job's first Gloo communicator (one
 * elastic context per job admits joiners). */
DDP_API ddp_status_t ddp_comm_join_gloo(const char* init_method, int64_t timeout_ms, ddp_comm_t* comm);

/* Host-memory communicator of one rank, needing no MPI: reduction is the identity (scaling still
 * applies). For single-process runs, tests and fuzzing. */
DDP_API ddp_status_t ddp_comm_init_self(ddp_comm_t* comm);

/* A group of `nranks` in-process ranks that communicate through shared memory: each of `nranks`
 * threads calls ddp_comm_init_local with its own rank. For tests of multi-rank behaviour inside one
 * process. The group may be destroyed once every comm made from it is destroyed (destroying it earlier
 * is deferred until then). ddp_local_group_destroy accepts NULL. */
DDP_API ddp_status_t ddp_local_group_create(int nranks, ddp_local_group_t* group);
DDP_API ddp_status_t ddp_comm_init_local(ddp_local_group_t group, int rank, ddp_comm_t* comm);
DDP_API ddp_status_t ddp_local_group_destroy(ddp_local_group_t group);

DDP_API ddp_status_t ddp_comm_rank(ddp_comm_t comm, int* rank);
DDP_API ddp_status_t ddp_comm_size(ddp_comm_t comm, int* size);
/* This process's place as its launcher set it, read as the init method "auto" reads it (see
 * ddp_comm_init_gloo): its rank, the world size, and its local rank, its place among the job's ranks
 * on this host (e.g. to pick the CUDA device for ddp_comm_init_nccl_store: local_rank modulo the
 * device count); the local rank is -1 when no variable gives it and the job may span hosts. Needs no
 * communicator and makes none: callable before any. Any pointer may be NULL. Thread-safe.
 * DDP_ERR_INVALID_ARGUMENT as "auto" refuses: no launcher's variables give a rank and a world size,
 * a value is malformed or out of range, or two launchers' variables disagree (the message names
 * them). (Added in 0.2.) */
DDP_API ddp_status_t ddp_launcher_ranks(int* rank, int* size, int* local_rank);
/* Destroys a communicator. Contexts made over it hold their own duplicates and stay valid.
 * Accepts NULL. A comm hook's bucket->comm is the context's: DDP_ERR_INVALID_ARGUMENT. */
DDP_API ddp_status_t ddp_comm_destroy(ddp_comm_t comm);

/* ------------------------------------------------------------------------------------------------
 * Experimental: device memory (CUDA streams and NCCL), and elastic membership over NCCL.
 *
 * Built and linked by every CUDA build, and tested end to end without a GPU over a simulated CUDA
 * runtime and NCCL (tests/gpusim; docs/gpu.md says what has run on hardware, and where). Not yet
 * proven on GPU hardware or at scale, so kept apart here: their ABI is kept as every call's (nothing
 * is renumbered or removed, functions are only added), but their behaviour may change in a minor
 * release where hardware shows it must. Elastic contexts (config.elastic) over these communicators
 * are experimental in the same way; over Gloo and local groups they are not.
 * --------------------------------------------------------------------------------------------- */

/* NCCL: a new unique id, made on one rank and sent to the others by the caller. */
DDP_API ddp_status_t ddp_nccl_get_unique_id(ddp_nccl_id_t* id);
/* Device-memory communicator over NCCL for rank `rank` of `nranks`, on CUDA device `cuda_device`.
 * Collective. DDP_ERR_UNSUPPORTED in a build without CUDA; DDP_ERR_CUDA when no device is usable.
 * Bounded: with NCCL 2.14 or later the communicator is created without blocking and given up
 * (ncclCommAbort, DDP_ERR_TIMEOUT "rank R of N: the NCCL communicator was not created within T ms:
 * ...") when it is not ready within the environment's DDP_INIT_TIMEOUT_MS milliseconds (default
 * 300000; 0 waits forever), e.g. because a rank never called it with the same id. Older NCCL blocks
 * until every rank has joined. */
DDP_API ddp_status_t ddp_comm_init_nccl(const ddp_nccl_id_t* id, int nranks, int rank, int cuda_device,
                                        ddp_comm_t* comm);
/* As ddp_comm_init_nccl, with the bound given: `timeout_ms` milliseconds, 0 to wait forever. */
DDP_API ddp_status_t ddp_comm_init_nccl_timeout(const ddp_nccl_id_t* id, int nranks, int rank, int cuda_device,
                                                int64_t timeout_ms, ddp_comm_t* comm);
/* As ddp_comm_init_nccl, with the id made on rank 0 of `mpi_comm` (an MPI_Comm*, NULL for world) and
 * broadcast over it. Collective over the MPI communicator, which libddp duplicates and keeps: through
 * it, a collective that times out names the ranks behind and where every rank is (as on MPI). */
DDP_API ddp_status_t ddp_comm_init_nccl_mpi(const void* mpi_comm, int cuda_device, ddp_comm_t* comm);
/* As ddp_comm_init_nccl_mpi, with the bound given (the id's broadcast included). */
DDP_API ddp_status_t ddp_comm_init_nccl_mpi_timeout(const void* mpi_comm, int cuda_device, int64_t timeout_ms,
                                                    ddp_comm_t* comm);
/* As ddp_comm_init_nccl, needing no MPI: the ranks meet as in ddp_comm_init_gloo (same `init_method`,
 * `rank` and `size`), the id made on rank 0 is sent over a Gloo communicator, which stays with the
 * NCCL one for the stall inspector. Bounded by DDP_INIT_TIMEOUT_MS. DDP_ERR_UNSUPPORTED in a build
 * without CUDA or without Gloo. */
DDP_API ddp_status_t ddp_comm_init_nccl_store(const char* init_method, int rank, int size, int cuda_device,
                                              ddp_comm_t* comm);
/* As ddp_comm_init_nccl_store, with the bound given: `timeout_ms` milliseconds, 0 to wait forever. */
DDP_API ddp_status_t ddp_comm_init_nccl_store_timeout(const char* init_method, int rank, int size, int cuda_device,
                                                      int64_t timeout_ms, ddp_comm_t* comm);
/* As ddp_comm_join_gloo, for an elastic job whose ranks made their communicators with
 * ddp_comm_init_nccl_store: the joiner is admitted over the job's Gloo communicator, then makes an
 * NCCL communicator on `cuda_device` with the job's ranks (bounded by `timeout_ms` too). Contexts
 * over NCCL communicators made this way are elastic (config.elastic): after a loss, ddp_recover
 * agrees on the survivors over Gloo and makes a new NCCL communicator over them; the old ones are
 * aborted (ncclCommAbort), never reused. Their control path (the exchange that ends each iteration,
 * the plan, ddp_allreduce_host) runs over the Gloo communicator, so a dead peer's closed connection
 * ends the iteration at once, and NCCL errors count as a loss. DDP_ERR_UNSUPPORTED in a build
 * without CUDA or without Gloo. */
DDP_API ddp_status_t ddp_comm_join_nccl(const char* init_method, int cuda_device, int64_t timeout_ms, ddp_comm_t* comm);
/* Borrows an existing ncclComm_t: libddp uses it (and communicators it splits from it) but never
 * destroys it; it must outlive every context made over the returned comm. */
DDP_API ddp_status_t ddp_comm_wrap_nccl(void* nccl_comm, ddp_comm_t* comm);

/* ------------------------------------------------------------------------------------------------
 * Configuration: a versioned struct, filled by DDP_CONFIG_INITIALIZER or ddp_config_init.
 *
 * The ABI promise (for every release of the same major version):
 * - Fields are only ever appended, never removed, reordered or retyped; `version` counts the appends.
 * - `size` says which fields the caller has: the library reads the fields that lie wholly within
 *   `size` bytes and gives every later field its default. So a program compiled against an older
 *   header (a smaller struct) keeps working with a newer library, its new fields at their defaults.
 * - A program compiled against a newer header (a larger struct) works with an older library too: the
 *   fields that library does not know are ignored (compare ddp_version() with DDP_VERSION_CODE to
 *   know what you run against).
 * - The smallest struct accepted is the first version's (DDP_CONFIG_V1_SIZE bytes, through
 *   inplace_min_numel); `magic` catches a struct that was never initialized.
 * - ddp_config_init writes only `sizeof(ddp_config_t)` of the caller's own header: it never writes
 *   past the caller's struct.
 * --------------------------------------------------------------------------------------------- */

#define DDP_CONFIG_MAGIC 0xDD9C0F16u
#define DDP_CONFIG_VERSION 5u

typedef struct ddp_config {
  size_t size;      /* sizeof(ddp_config_t) as compiled by the caller */
  uint32_t magic;   /* DDP_CONFIG_MAGIC */
  uint32_t version; /* DDP_CONFIG_VERSION */

  /* apex message_size: a bucket closes when it holds at least this many elements. Default 10,000,000.
   * Ignored when any grad is registered with DDP_GRAD_TRIGGER (as in apex). */
  size_t message_size;
  /* apex delay_allreduce: launch nothing during backward; reduce every bucket in ddp_finish_backward. */
  int delay_allreduce;
  /* ddp_layout_t. DDP_LAYOUT_ARENA is apex retain_allreduce_buffers. */
  int layout;
  /* ddp_plan_order_t. */
  int plan_order;
  /* apex allreduce_always_fp32: 16-bit buckets travel as fp32 (cast fused with scaling). On host
   * memory 16-bit buckets always travel as fp32, since MPI has no 16-bit arithmetic. */
  int allreduce_always_fp32;
  /* apex gradient_average: after the sum, multiply by predivide/world. Default 1. */
  int gradient_average;
  /* apex gradient_predivide_factor: multiply by 1/f before the sum. Default 1.0; 2^-126 .. 2^126
   * (1.2e-38 .. 8.5e37: f and 1/f both scale a float without overflow). */
  double gradient_predivide_factor;
  /* apex num_allreduce_streams: bucket i is reduced on stream/communicator i % num_streams. 1..64. */
  int num_streams;
  /* apex allreduce_communicators: NULL, or num_streams communicators to use for the buckets instead of
   * duplicates of the context's communicator. Borrowed: they must outlive the context. The same
   * communicators in the same order on every rank: on host memory ddp_create checks it
   * (DDP_ERR_MISMATCH naming the first that differs). */
  const ddp_comm_t* stream_comms;
  /* A collective that does not complete within this many milliseconds fails with DDP_ERR_TIMEOUT and
   * aborts the context; it also bounds ddp_create. Default 300000 (5 minutes); 0 waits forever.
   * 0 .. 9.2e18: a value that puts the deadline past the clock's range (about 292 years) is forever. */
  int64_t timeout_ms;
  /* ddp_unused_policy_t. */
  int unused_policy;
  /* If not NULL, each rank writes a Chrome trace of bucket events to this path, with ".rank<N>"
   * inserted before the extension (array form, one event per line, flushed every iteration;
   * timestamps in microseconds since the Unix epoch; tools/merge_timeline.py merges the ranks).
   * A rank's second, third ... live context in one process writes ".ctx1.rank<N>", ".ctx2.rank<N>"
   * ... instead, so that no two contexts share a file. The environment variable DDP_TIMELINE does
   * the same. Copied. */
  const char* timeline_path;
  /* If set, every reduced bucket is scanned for NaN/Inf; ddp_stats_t.nonfinite_buckets counts them.
   * Values are never changed. */
  int check_finite;
  /* Copy layout only: an f32/f64 grad of at least this many elements is reduced in place as its own
   * collective instead of being packed. 0 (default) is the library's choice: on host memory, grads
   * of at least one piece (host_piece_bytes) go in place, which skips the pack and unpack passes;
   * on GPUs none. SIZE_MAX: never, and no collective reads or writes the caller's grads (a timed-out
   * MPI collective, which cannot be cancelled, then touches only library memory). */
  size_t inplace_min_numel;
  /* --- version 1 ends here (DDP_CONFIG_V1_SIZE); later fields are appended below --- */

  /* Version 2 (libddp 0.2). Host memory: each bucket's collective is issued in pieces of at most this
   * many bytes, and each piece is scaled and unpacked while it is still in cache. 0 (default) lets the
   * library choose: the environment's DDP_HOST_PIECE_BYTES, else 4 MiB (see docs/performance.md);
   * otherwise at least 4096. Ignored on GPUs. */
  size_t host_piece_bytes;
  /* Version 2. A bucket that has waited this many milliseconds for the other ranks is reported once,
   * as a warning through the log callback (ddp_set_log_callback): which ranks have not arrived and
   * where every rank that answers stands; the wait goes on until timeout_ms. 0 (default) is the
   * library's choice, 60000 (one minute); a value >= timeout_ms never warns before the timeout.
   * 0 .. 9.2e18; past the clock's range (about 292 years) it never warns. One warning per wait,
   * whatever the number of streams. Bucket collectives only: the short control exchanges (agreement,
   * the learned plan's broadcast, the unused-grad report) are bounded by timeout_ms but never warn. */
  int64_t stall_warning_ms;

  /* Version 3 (libddp 0.2). Sharded reduction, for sharded optimizers (ZeRO-1/2, Megatron's
   * distributed optimizer): each bucket is reduce-scattered instead of allreduced, so that
   * ddp_finish_backward leaves in each bucket only this rank's shard reduced and scaled (see
   * ddp_get_shard); the library also keeps a parameter arena of the same layout (ddp_param_ptr) that
   * ddp_gather_params all-gathers after the optimizer updated each rank's shard. Needs
   * DDP_LAYOUT_ARENA and DDP_PLAN_REGISTRATION (the learned plan would move every shard, and the
   * optimizer state over it, after the first iteration); ddp_create refuses other combinations.
   * Not with uneven_inputs or DDP_COMPRESS_INT8 (ddp_create refuses them) nor with a comm hook
   * (ddp_set_comm_hook refuses it); inplace_min_numel does not apply; every other option keeps its
   * meaning. */
  int shard;

  /* Version 4 (libddp 0.2). ddp_compression_t: the type buckets travel in. Default
   * DDP_COMPRESS_NONE. Not with a comm hook (ddp_set_comm_hook: the hook decides). A compressed
   * bucket is always staged: the arena layout converts it into a wire buffer and back, and the copy
   * layout reduces none of its grads in place (inplace_min_numel does not apply). */
  int compression;
  /* Version 4. ddp_uneven_t. With it set, every synced iteration begins (ddp_begin_backward) with one
   * small exchange saying which ranks still contribute, so that a rank that has run out of data can
   * call ddp_join and shadow the others' iterations until every rank has joined. Default
   * DDP_UNEVEN_OFF: no exchange, and ddp_join is DDP_ERR_INVALID_STATE. The exchange (72 bytes per
   * rank; ddp_reduce_all makes it too) returns only once every rank has reached the same point (its
   * own synced iteration, or ddp_join), bounded by timeout_ms; iterations with sync off exchange
   * nothing. Not with config.shard (DDP_ERR_INVALID_ARGUMENT: a joined rank would stop updating the
   * parameter shard every other rank gathers). */
  int uneven_inputs;

  /* Version 5 (libddp 0.2). Elastic: a collective that fails because a peer died, was cut off or
   * stalled past timeout_ms ends the call with DDP_ERR_RANK_LOST instead of aborting the context;
   * ddp_recover then rebuilds it over the ranks that are left (see there). Needs a communicator that
   * can be rebuilt (Gloo, a local group, NCCL made by ddp_comm_init_nccl_store; ddp_create says
   * DDP_ERR_UNSUPPORTED for the others, naming them; ddp_comm_init_self is accepted, a group of one
   * with no peer to lose) and is not available with config.shard, config.uneven_inputs or
   * config.stream_comms. Default 0: off. Processes may join a running job over Gloo
   * (ddp_comm_join_gloo, ddp_comm_join_nccl; DDP_ERR_RANK_JOINING), not a local group. Every synced
   * iteration (and ddp_reduce_all) ends with the small exchange of the unused-grad report, under
   * DDP_UNUSED_ZERO too: it carries the join requests seen (8 bytes). How a loss is found: a dead
   * process at once (its connections close, its port refuses); while a bucket waits, every second
   * each rank asks the others' stall-inspector ports, and a rank whose port refuses or that is silent
   * twice in a row is lost (a cut link: about 2.5 s, or timeout_ms if sooner); a rank that is alive
   * but stalled or stopped (SIGSTOP, a debugger: its port still accepts) at timeout_ms. A rank whose
   * collective fails closes all its connections, so the loss reaches every rank in one hop. */
  int elastic;
  /* Version 5. Stragglers (see ddp_stats_t.straggler_rank): a warning through the log callback when
   * one rank was late by at least this many milliseconds in 8 of the last 10 synced iterations, saying
   * which rank and why (late to start its backward pass, slow backward, slow wire); once, until that
   * rank has been on time for 10 iterations. 0 (default) is the library's choice, 100 ms.
   * 0 .. 9.2e18. */
  int64_t straggler_warning_ms;
} ddp_config_t;

/* The size of the first version of ddp_config_t, through inplace_min_numel: the smallest accepted. */
#define DDP_CONFIG_V1_SIZE (offsetof(ddp_config_t, inplace_min_numel) + sizeof(size_t))

/* The defaults, field by field, in declaration order. */
#define DDP_CONFIG_INITIALIZER                                                        \
  {                                                                                   \
    sizeof(ddp_config_t),   /* size */                                                \
        DDP_CONFIG_MAGIC,   /* magic */                                               \
        DDP_CONFIG_VERSION, /* version */                                             \
        10000000u,          /* message_size: 10M elements */                          \
        0,                  /* delay_allreduce: off */                                \
        DDP_LAYOUT_COPY,    /* layout */                                              \
        DDP_PLAN_LEARNED,   /* plan_order */                                          \
        0,                  /* allreduce_always_fp32: off */                          \
        1,                  /* gradient_average: on */                                \
        1.0,                /* gradient_predivide_factor */                           \
        1,                  /* num_streams */                                         \
        NULL,               /* stream_comms: the context duplicates its own comm */   \
        300000,             /* timeout_ms: 5 minutes */                               \
        DDP_UNUSED_ERROR,   /* unused_policy */                                       \
        NULL,               /* timeline_path: none (DDP_TIMELINE may set one) */      \
        0,                  /* check_finite: off */                                   \
        0,                  /* inplace_min_numel: the library's choice */             \
        0,                  /* host_piece_bytes: the library's choice */              \
        0,                  /* stall_warning_ms: the library's choice (60 s) */       \
        0,                  /* shard: off */                                          \
        DDP_COMPRESS_NONE,  /* compression: none */                                   \
        DDP_UNEVEN_OFF,     /* uneven_inputs: off */                                  \
        0,                  /* elastic: off */                                        \
        0                   /* straggler_warning_ms: the library's choice (100 ms) */ \
  }

/* Fills the first `size` bytes of *config with the defaults (the same as DDP_CONFIG_INITIALIZER) and
 * sets config->size to `size`: every field that lies wholly within `size` bytes is written, nothing
 * past it (a field partly past `size` is not written either). config->version is set to the newest
 * version whose fields all lie within `size`: 1 for DDP_CONFIG_V1_SIZE, this library's
 * DDP_CONFIG_VERSION for its own sizeof(ddp_config_t). A larger size (a newer header's struct) is
 * accepted: the fields this library knows are written, `version` says which (this library's
 * DDP_CONFIG_VERSION), and the bytes past them are left as they were. `size` below DDP_CONFIG_V1_SIZE
 * is DDP_ERR_INVALID_ARGUMENT and nothing is written. Use it through ddp_config_init. */
DDP_API ddp_status_t ddp_config_init_sized(ddp_config_t* config, size_t size);

/* Fills *config with the defaults. A macro over ddp_config_init_sized with the caller's own
 * sizeof(ddp_config_t), so it never writes past the caller's struct. (The function of this name,
 * which programs built against version 0.1 headers call, writes the first version's fields only.) */
DDP_API ddp_status_t ddp_config_init(ddp_config_t* config);
#define ddp_config_init(config) ddp_config_init_sized((config), sizeof(ddp_config_t))

/* ------------------------------------------------------------------------------------------------
 * The context
 * --------------------------------------------------------------------------------------------- */

typedef struct ddp_context* ddp_t;

/* Makes a context over `comm` (duplicated: the comm may be destroyed afterwards). `config` NULL means
 * the defaults. The config is validated here (a value outside its range or enum is
 * DDP_ERR_INVALID_ARGUMENT naming the accepted ones), and the ranks agree here on the fields that
 * shape the collectives (message_size, delay_allreduce, layout, plan_order, allreduce_always_fp32,
 * gradient_average, gradient_predivide_factor, num_streams, unused_policy, inplace_min_numel,
 * host_piece_bytes, shard, compression, uneven_inputs, elastic) and on the memory kind: ranks that
 * differ all get DDP_ERR_MISMATCH naming the field and the values. On host comms the environment
 * variables that size what crosses the wire (DDP_HOST_PIECE_BYTES, DDP_INT8_SCATTER_MIN_WORLD) must
 * read the same on every rank: ranks that differ all get DDP_ERR_MISMATCH naming the variable and the
 * ranks' values. The grads are agreed on when registration closes (see ddp_commit). Collective. */
DDP_API ddp_status_t ddp_create(ddp_comm_t comm, const ddp_config_t* config, ddp_t* ddp);

/* Registers one gradient of `numel` (>= 1) elements of `dtype`; *index receives its index (0, 1, ...
 * in registration order). Every rank must register the same grads (numel, dtype, flags) in the same
 * order. Copy layout: `grad` is the user's buffer (host memory for an MPI comm, device memory for
 * NCCL); it may be changed later with ddp_set_grad_ptr or ddp_grad_ready_ptr. It must be aligned to
 * its dtype's size (2, 4 or 8 bytes; DDP_ERR_INVALID_ARGUMENT "grad I at P is not aligned to its
 * dtype: f32 needs 4-byte alignment" otherwise, also for the pointers those two calls pass), and it
 * must not share a byte with a grad registered before it (a buffer registered twice would be
 * reduced twice): DDP_ERR_INVALID_ARGUMENT "grad I (B bytes at P) overlaps grad J (...)", unless
 * one of the two is flagged DDP_GRAD_STAND_IN. `flags`: DDP_GRAD_TRIGGER, DDP_GRAD_STAND_IN. Arena
 * layout: `grad` must be NULL; the library allocates the storage (zeroed) when registration closes,
 * see ddp_grad_ptr. Only before registration closes. Not thread-safe with other calls on the same
 * context. */
DDP_API ddp_status_t ddp_register_grad(ddp_t ddp, void* grad, size_t numel, ddp_dtype_t dtype, unsigned flags,
                                       int* index);

/* Closes registration: checks that every rank registered the same grads and set a comm hook alike
 * (DDP_ERR_MISMATCH on every rank otherwise, naming the first difference), builds the first plan and
 * allocates buffers. Collective. Optional: ddp_grad_ptr (arena layout), ddp_begin_backward,
 * ddp_reduce_all, ddp_join, ddp_get_plan, ddp_get_bucket, ddp_get_shard and ddp_param_ptr close
 * registration implicitly, so their first call on each rank is collective too; ddp_broadcast,
 * ddp_allreduce_host and ddp_barrier leave it open. Calling it again is a no-op. */
DDP_API ddp_status_t ddp_commit(ddp_t ddp);

/* Where grad `index` lives. Arena layout: the view into the library's buffer (closing registration if
 * open). In the arena layout with the learned plan, the storage moves once, at the end of the first
 * synced backward (values kept): call again after it; ddp_stats_t.layout_epoch counts such moves.
 * Copy layout: the user's current pointer. */
DDP_API ddp_status_t ddp_grad_ptr(ddp_t ddp, int index, void** grad);

/* Copy layout: grad `index` now lives at `grad` (PyTorch's set_to_none allocates new grads every step).
 * Allowed outside backward, or inside before the grad is marked ready. DDP_ERR_INVALID_STATE in the
 * arena layout. */
DDP_API ddp_status_t ddp_set_grad_ptr(ddp_t ddp, int index, void* grad);

/* Starts an iteration's backward pass (apex's forward() bookkeeping). `stream` is where grads are
 * produced (a cudaStream_t for NCCL, ignored for host memory). Closes registration if open. */
DDP_API ddp_status_t ddp_begin_backward(ddp_t ddp, void* stream);

/* The hook: grad `index` holds its final value for this iteration. O(1); takes a lock, allocates
 * nothing. When this completes the next bucket in plan order (and possibly more after it), those
 * buckets are launched: on host memory handed to the bucket's worker thread, on GPUs enqueued behind
 * `stream` of ddp_begin_backward. The grad must not be written again until ddp_finish_backward.
 * Thread-safe: several threads may mark different grads at once (as autograd engines do), and the
 * results are bitwise those of marking them from one thread, in any order: buckets always launch in
 * plan order. Marking a grad twice in one iteration is DDP_ERR_INVALID_STATE. With sync disabled
 * (ddp_set_sync) it only records the mark. */
DDP_API ddp_status_t ddp_grad_ready(ddp_t ddp, int index);

/* ddp_grad_ready with the grad's storage for this iteration (copy layout; NULL keeps the pointer). Only
 * buckets whose pointers changed have their pointer tables rebuilt. */
DDP_API ddp_status_t ddp_grad_ready_ptr(ddp_t ddp, int index, void* grad);

/* Ends the backward pass. Launches whatever is left (grads never marked ready are handled by the
 * unused policy), then waits: host memory returns when every grad holds its reduced value; on GPUs
 * `stream` is made to wait on every bucket (no host sync) and the grads are final in stream order.
 * Errors of any bucket (timeouts, failed collectives) surface here. Collective (when sync is on). */
DDP_API ddp_status_t ddp_finish_backward(ddp_t ddp, void* stream);

/* Inside a backward pass, after grad `index` was marked ready: whether its reduced value can be had
 * before ddp_finish_backward, and if so, waits for it. *reduced = 1: host memory returns once the
 * grad's bucket is reduced and scaled (later buckets may still travel); on GPUs `stream` is made to
 * wait for that bucket (no host sync) and the grad is final in stream order. So a trainer can update
 * each layer as its bucket arrives, overlapping its optimizer with the wire (buckets arrive in plan
 * order: the order grads became ready in the first iteration, or registration order). *reduced = 0,
 * nothing waited for: the bucket is not launched yet (it holds grads not marked ready, or a bucket
 * before it does: buckets launch in plan order), or nothing is launched before ddp_finish_backward
 * (the first iteration of a learned plan, delay_allreduce, sync off), or the context is sharded (its
 * buckets end as shards); the value is final after ddp_finish_backward. Whatever ddp_finish_backward
 * decides comes after an early update: the unused-grad report, check_finite's counts and, in elastic
 * contexts, whether the iteration committed; trainers that skip a step on those update after it.
 * Errors of the buckets launched so far (timeouts, failed collectives) surface here as they would
 * there: a later bucket's error may come first, in a wait for an earlier one. Like every call it holds
 * the context while it runs: ddp_grad_ready from another thread waits until the wait ends, so call it
 * where backward is done with the grads it needs (after the marks, as the example trainer does).
 * DDP_ERR_INVALID_STATE outside a backward pass or before the grad is marked ready; NULL `reduced`
 * is DDP_ERR_INVALID_ARGUMENT. Not collective. */
DDP_API ddp_status_t ddp_wait_grad(ddp_t ddp, int index, void* stream, int* reduced);

/* Turns reduction on (1) or off (0) for the following iterations (apex enable/disable_allreduce,
 * torch no_sync): with it off, backward passes only accumulate locally. Not inside a backward pass.
 * Every rank must use the same setting in each iteration. Ranks that ran different numbers of
 * backward passes with sync off before a synced iteration get DDP_ERR_MISMATCH on every rank, naming
 * each rank's count ("ranks disagree on ddp_set_sync: ..."), and the context aborts: with
 * config.uneven_inputs from ddp_begin_backward, before any bucket; otherwise from
 * ddp_finish_backward of that iteration, through the unused-grad report (not found with
 * DDP_UNUSED_ZERO and uneven_inputs off outside elastic contexts, where the ranks exchange nothing of
 * their own). */
DDP_API ddp_status_t ddp_set_sync(ddp_t ddp, int enabled);

/* apex Reducer.reduce(): reduces every registered grad now, outside a backward pass, with the same
 * bucketing and scaling, and waits as ddp_finish_backward does. Collective. */
DDP_API ddp_status_t ddp_reduce_all(ddp_t ddp, void* stream);

/* Broadcasts `n` buffers from `root` to every rank (parameter sync at start-up, as apex does at
 * construction). buffers[i] holds counts[i] elements of dtypes[i] (any ddp_dtype_t, integers included:
 * a step count travels as DDP_I64), in the comm's memory kind. Uses its
 * own channel, so it may be called before or after registration closes. Blocks until done (host) or
 * until enqueued on `stream` (GPU). Every rank passes the same n, root, counts and dtypes: ranks that
 * differ (or make another collective call) all get DDP_ERR_MISMATCH naming the first difference, and
 * nothing is sent. Collective. */
DDP_API ddp_status_t ddp_broadcast(ddp_t ddp, void* const* buffers, const size_t* counts, const ddp_dtype_t* dtypes,
                                   int n, int root, void* stream);

/* Waits on the host until all work the library enqueued has finished. */
DDP_API ddp_status_t ddp_synchronize(ddp_t ddp);

/* Uneven inputs: this rank has run out of data. Needs config.uneven_inputs. Instead of its next
 * iterations, it shadows the others' synced iterations: it takes part in each bucket's collective
 * with zeros (its grads are reduced as unused grads are, never reported as unused, and receive the
 * reduced values), while the others' averages divide by the ranks that contributed (or by the world:
 * DDP_UNEVEN_BY_WORLD). With the learned plan, a rank that joins before the first synced backward
 * takes part in learning it. Returns when every rank has called it, on every rank, with
 * *all_joined_iteration (may be NULL) set to the number of synced iterations done by then
 * (ddp_stats_t.iterations, the shadowed ones included): the same on every rank. The context is then
 * as before, every rank contributing again (a new epoch may start). Each wait is bounded by
 * timeout_ms: others that spend longer than that between two synced iterations (sync off, an
 * evaluation, a checkpoint) make this rank fail with DDP_ERR_TIMEOUT, which aborts its context. While
 * a rank is in ddp_join the others may run synced iterations, iterations with sync off and ddp_join,
 * but not ddp_allreduce_host or ddp_barrier (every rank gets DDP_ERR_MISMATCH and the contexts abort)
 * nor ddp_broadcast (its channel is not served: it times out). Closes registration if open.
 * DDP_ERR_INVALID_STATE inside a backward pass, without config.uneven_inputs, or with sync off.
 * Collective. */
DDP_API ddp_status_t ddp_join(ddp_t ddp, int64_t* all_joined_iteration);

/* Elastic contexts (config.elastic): what ddp_recover reports. */
typedef struct ddp_membership {
  uint64_t epoch; /* membership changes so far: 0 at ddp_create, then 1, 2 ... one per change */
  int rank;       /* this rank's number from now on, 0 .. world - 1 (the survivors keep their order;
                     joiners come after them) */
  int world;      /* how many ranks there are from now on */
  /* "Before" is the membership this rank last held: the last one ddp_create or a ddp_recover that
   * succeeded gave it, however many ddp_recover attempts failed since (so are `members`' numbers). */
  int old_rank;  /* this rank's number before (-1 on a joiner) */
  int old_world; /* how many ranks there were before (on a joiner: in the job it joined) */
  /* The rank (new number) whose state every rank should take before the next iteration, with
   * ddp_broadcast (parameters, optimizer state, step count) or ddp_broadcast_params: one of the
   * ranks that committed the most iterations. A failed iteration may have completed on some ranks
   * before it failed on others (their ddp_finish_backward returned DDP_SUCCESS and they updated
   * their parameters); this rank is one of those that did, so taking its state makes every rank's
   * identical again. */
  int source;
  int behind;        /* 1 if this rank committed fewer iterations than `source` (its state is stale;
                        always on a joiner, which has none) */
  int64_t committed; /* iterations committed by `source`: the step count every rank continues from */
} ddp_membership_t;

/* Elastic contexts: after a call returned DDP_ERR_RANK_LOST (the iteration in progress was not
 * committed: skip its optimizer update), agrees with the other live ranks on the new membership and
 * rebuilds the context over it. Each rank checks in through the communicator's rendezvous store; the
 * ranks of the old world that never check in and no longer answer (their process is gone, or cut
 * off) are dropped at once; a rank that is alive but late is waited for up to timeout_ms, then
 * dropped (it gets DDP_ERR_RANK_LOST from its own ddp_recover, saying so, and its context is aborted:
 * destroy it and its communicator; to take part again, the same process joins the job as any joiner
 * does, ddp_comm_join_gloo over the job's store, a new context and ddp_recover). The
 * agreement: a survivor proposes the ranks it saw check in and still reaches, and only when they are
 * more than half of the ranks not known to be gone (a port that refuses says a process is gone; one
 * that does not answer may be cut off); the store keeps the first proposal and every survivor adopts
 * it. So on a cut link the larger side goes on and the smaller one is left out, even over a store
 * both reach; an even split, or a host lost with half the ranks (no rank can tell it from a cut),
 * stops with DDP_ERR_TIMEOUT. The
 * survivors keep their order and are renumbered 0 .. world - 1; every registration stays, the plan
 * is kept, and the averages divide by the new world. Afterwards take the state of
 * membership->source (see ddp_membership_t) and go on with the next iteration. Arena layout: the
 * grads may have moved: ask ddp_grad_ptr again. `membership` may be NULL; `members` (may be NULL)
 * receives, for each new rank i below `capacity`, its number in the old world (-1: a joiner): the
 * membership this rank last held, even after attempts that returned DDP_ERR_TIMEOUT (or an
 * admission that returned DDP_ERR_RANK_LOST: a joiner lost while it was being admitted).
 * DDP_ERR_TIMEOUT when the membership could not be agreed within timeout_ms (the store is gone: a
 * TCP store lives in rank 0's process, a file store outlives every rank), or when another rank was
 * lost while the new communicators were being made (each attempt then takes up to about twice
 * timeout_ms); the context then stays lost and ddp_recover may be called again: a loop that retries
 * it a few times survives a second death during a recovery. Collective over the surviving ranks.
 * After a call returned DDP_ERR_RANK_JOINING (nothing of that call was done: ddp_begin_backward or
 * ddp_reduce_all at the step boundary after a synced iteration in which some rank's watch saw a join
 * request), admits the waiting joiners: they become ranks world, world + 1 ..., receive the plan,
 * and every rank, joiners included, then takes the state of membership->source; make the call again
 * afterwards. A joiner whose heartbeat (every 100 ms) stood still for 1.5 s is passed over (and told
 * so: it asks again); one that dies while it is admitted is waited for at most 10 s, then the job goes
 * on as it was (membership and epoch unchanged) and that admission's joiners get DDP_ERR_TIMEOUT
 * within 15 s. Collective over the job's ranks and the joiners.
 * On a joiner's context (ddp_comm_join_gloo, ddp_comm_join_nccl): asks to be admitted and waits for
 * it (the bound given there), then reports the membership it joined; take the state of membership->source
 * (ddp_broadcast, or ddp_broadcast_params) and go on from membership->committed iterations. The job
 * refuses a joiner whose config or grads differ from its own: DDP_ERR_MISMATCH with the job's
 * reason; DDP_ERR_TIMEOUT when no job admitted it in time. Either way it stays a joiner and may ask
 * again. When the job ends first (every rank of its membership called ddp_destroy), the joiner
 * learns it within about 100 ms: DDP_ERR_ABORTED, "the job at ... ended before admitting this
 * process ...: there is no job left to join"; its context is aborted (destroy it).
 * DDP_ERR_INVALID_STATE when no rank was lost and none waits to join (or the context is not
 * elastic). */
DDP_API ddp_status_t ddp_recover(ddp_t ddp, ddp_membership_t* membership, int* members, size_t capacity);

/* Reduces `count` elements of `dtype` (any ddp_dtype_t, integers included) at host address `buf`
 * across the ranks, in place, with `op`: the loss, metrics, token counts. Every rank gets the same
 * bits (floats are summed in rank order, in the type's own precision; 16-bit types in fp32 math).
 * Over the context's control channel, whatever the comm (NCCL included); bounded by timeout_ms. For
 * small buffers (each rank's buffer travels to every rank): count x element size x world at most 2^31
 * bytes (DDP_ERR_INVALID_ARGUMENT beyond); grads go through the buckets. Integers: an average is
 * exact (summed in 128 bits, divided rounding toward zero); a sum that overflows the type wraps
 * around (two's complement). DDP_OP_AVG divides by the world size whatever config.uneven_inputs says;
 * a NaN anywhere makes DDP_OP_MAX and DDP_OP_MIN NaN. `buf` is host memory on every comm (on NCCL,
 * copy a device value out first), aligned to its dtype, used during the call only; `count` 0 is
 * allowed (`buf` may then be NULL) and the ranks still meet. Ranks that pass a different count, dtype
 * or op, or make another collective call, all get DDP_ERR_MISMATCH naming both calls. Leaves
 * registration open. Not inside a backward pass, nor while some rank is in ddp_join. Collective. */
DDP_API ddp_status_t ddp_allreduce_host(ddp_t ddp, void* buf, size_t count, ddp_dtype_t dtype, ddp_op_t op);

/* Returns when every rank has called it (bounded by timeout_ms). Ranks that make another collective
 * call all get DDP_ERR_MISMATCH. Leaves registration open. Not inside a backward pass, nor while some
 * rank is in ddp_join. Collective. */
DDP_API ddp_status_t ddp_barrier(ddp_t ddp);

/* Communication hooks: a bucket handed to the caller's function instead of the library's allreduce. */
typedef struct ddp_hook_bucket {
  /* sizeof(ddp_hook_bucket_t) as the library knows it; fields are only appended: a hook checks it
   * before reading a field the library may not have. */
  size_t size;
  int bucket;         /* the bucket's index in the plan */
  int stream_index;   /* the bucket stream it runs on */
  uint64_t iteration; /* synced iterations before this one */
  /* `count` elements of `dtype`, in the comm's memory kind, reduced in place; grads never marked ready
   * are zeros in it. In the arena layout, for a bucket that travels in its grads' own type, it is the
   * bucket's arena storage itself; otherwise a library buffer the grads are packed into and unpacked
   * from. */
  void* buffer;
  size_t count;
  /* The type the bucket travels in: the grads' type, or f32 for 16-bit grads on host memory or with
   * allreduce_always_fp32. */
  ddp_dtype_t dtype;
  void* stream;    /* GPU: the cudaStream_t to enqueue on; host: NULL (the call itself does the work) */
  ddp_comm_t comm; /* the bucket stream's communicator, valid during the call: for ddp_comm_allreduce */
  int rank;        /* this rank in comm */
  int world;       /* comm's size */
} ddp_hook_bucket_t;

/* A comm hook. The hook scales, not the library (as in torch DDP with a comm hook registered): the
 * buffer handed over holds this rank's grads as they are (no gradient_predivide_factor applied), and
 * what the hook leaves in bucket->buffer on return (host memory) or in `stream` order (GPU) is the
 * reduced gradient, with no averaging applied after it (gradient_average and
 * gradient_predivide_factor are ignored while a hook is set). So a hook that averages, as torch's
 * default hooks do, calls ddp_comm_allreduce with DDP_OP_AVG; one that calls DDP_OP_SUM leaves the
 * sum. It runs for every bucket of every synced iteration (and of ddp_reduce_all, and of the
 * iterations a joined rank shadows), in plan order on each stream, on every rank: on host memory on
 * the bucket stream's worker thread (with num_streams > 1, hooks of different streams run at the same
 * time: state shared through user_data needs its own lock), on GPUs on the thread that launches the
 * bucket, while the library holds the context's lock. It must issue the same collectives on every
 * rank. It may call ddp_comm_allreduce on bucket->comm (and on communicators of its own),
 * ddp_last_error and ddp_status_string, and no other libddp function of this context: any other call
 * on the context (ddp_get_stats, ddp_destroy, ...) returns DDP_ERR_INVALID_STATE ("called from inside
 * this context's comm hook (bucket B): ...") at once. On host memory a hook still running timeout_ms
 * after its bucket started is written off like a stalled collective: ddp_finish_backward returns
 * DDP_ERR_TIMEOUT and the context aborts; when the hook returns, its thread stops for good, so after
 * that it must not use bucket->buffer or bucket->comm. A status other than DDP_SUCCESS fails the
 * bucket as a failed collective does, and the context aborts: ddp_finish_backward returns
 * DDP_ERR_TIMEOUT for a hook's timeout, DDP_ERR_ABORTED otherwise, with the message "comm hook
 * returned S (text) for bucket B: <the hook thread's ddp_last_error()>" (on GPUs the call that
 * launched the bucket, ddp_grad_ready for one, returns that error first). The library cannot check
 * the values a hook leaves: one that returns success without summing gives wrong grads. */
typedef ddp_status_t (*ddp_comm_hook_fn)(const ddp_hook_bucket_t* bucket, void* user_data);

/* Sets the comm hook (NULL: the library's allreduce again) and its `user_data` (borrowed: it must
 * outlive the context). With a hook set the library applies no scaling (neither
 * gradient_predivide_factor nor the averaging): the hook's result is the gradient (see
 * ddp_comm_hook_fn). Before the first backward pass (while registration is open); every rank must set
 * one, or none: when registration closes (ddp_commit or the first backward) ranks that disagree all
 * get DDP_ERR_MISMATCH, naming the ranks that set one and those that did not, and the context aborts.
 * Buckets with a hook are always packed into one buffer and handed over whole: no pieces
 * (host_piece_bytes), no grads reduced in place, no grouping of buckets into one launch. Not with
 * config.shard or config.compression (DDP_ERR_INVALID_STATE). */
DDP_API ddp_status_t ddp_set_comm_hook(ddp_t ddp, ddp_comm_hook_fn hook, void* user_data);

/* In-place allreduce on a communicator: `count` elements of a float `dtype` in the comm's memory kind
 * (host memory: synchronous; NCCL: enqueued on `stream`, a cudaStream_t). For comm hooks, on
 * bucket->comm; also on any host comm outside a context (device memory outside a hook is
 * DDP_ERR_UNSUPPORTED: use NCCL on your own stream). `op` is DDP_OP_SUM or DDP_OP_AVG (divides by the
 * world size; every host comm, self and local ones included, sums then scales). Host comms sum 16-bit
 * types in fp32 math, rounding after each addition. Bounded inside a hook by the bucket's deadline
 * (timeout_ms from the bucket's start), outside by DDP_INIT_TIMEOUT_MS (default 300000 ms). `count` 0
 * returns at once. Calls on one communicator must not overlap (one thread at a time per
 * communicator). `buf` aligned to its dtype. On host comms every rank passes the same count, dtype
 * and op, or all get DDP_ERR_MISMATCH naming each side (one small exchange first, where the comm does
 * not compare them itself as a local group does); NCCL comms do not compare them (the data stays on
 * the stream): a difference there is a bucket that times out. Collective. */
DDP_API ddp_status_t ddp_comm_allreduce(ddp_comm_t comm, void* buf, size_t count, ddp_dtype_t dtype, ddp_op_t op,
                                        void* stream);

/* Counters since creation. A versioned struct, like ddp_config_t: set `size` to sizeof(ddp_stats_t)
 * first; the library writes the fields that lie wholly within `size` bytes (a field partly past
 * `size` is not written) and nothing past them, and leaves `size` as it was. Fields are only ever
 * appended. A larger struct (a newer header's) is accepted: the fields this library does not know are
 * left as they were. The smallest accepted size holds `iterations`; a smaller one is
 * DDP_ERR_INVALID_ARGUMENT and nothing is written. */
typedef struct ddp_stats {
  size_t size;
  uint64_t iterations;      /* synced backward passes finished (and ddp_reduce_all calls) */
  uint64_t buckets_reduced; /* bucket collectives completed */
  /* Payload: the bytes of the buckets handed to their collectives (or to the comm hook), in the wire
   * type. It does not change with the world size, nor with what a hook sends: bytes_sent and
   * bytes_received say what travelled. */
  uint64_t bytes_reduced;
  uint64_t comm_time_ns;      /* summed over buckets: launch to completion (host memory; 0 on GPUs) */
  uint64_t exposed_time_ns;   /* summed over iterations: time ddp_finish_backward and ddp_wait_grad waited */
  uint64_t last_exposed_ns;   /* that time in the last iteration */
  uint64_t library_bytes;     /* memory held by the library beyond user-owned grads (arenas included) */
  uint64_t arena_bytes;       /* of which grad storage in the arena layout */
  uint64_t nonfinite_buckets; /* with check_finite: buckets that held NaN or Inf after reduction */
  uint64_t layout_epoch;      /* times arena storage moved (see ddp_grad_ptr) */
  int world_size;
  int rank;
  /* Added in 0.2. Traffic: the bytes this rank sent to and received from other ranks through the
   * context's communicators, counted where they move: every bucket collective, the int8 exchanges,
   * the sharded reduce-scatter and parameter all-gather, a comm hook's ddp_comm_allreduce calls (a
   * hook that sends bf16 counts bf16 bytes), the host collectives (ddp_allreduce_host, ddp_broadcast,
   * ddp_barrier, ddp_join) and the control exchanges (agreement, the learned plan, the unused-grad
   * report). The host ring (MPI and Gloo buckets) counts each of its exchanges: an allreduce of B
   * bytes over n ranks sends and receives 2 (n - 1) / n x B each (B split into n chunks as evenly as
   * elements allow). Collectives whose algorithm the library does not see are counted by the same
   * collective's ring formula: NCCL's and MPI's own (small MPI pieces, the control path), and the
   * local comm's (in-process ranks): allreduce 2 (n - 1) / n x B each way, reduce-scatter
   * (n - 1) / n x B, all-gather (n - 1) x the per-rank bytes, broadcast B received by every rank but
   * the root and sent by every rank but the one before the root. Zero on a single rank. With
   * config.stream_comms (borrowed), what moved through them since the context was made, including
   * other users' traffic on them. */
  uint64_t bytes_sent;
  uint64_t bytes_received;
  /* Added in 0.2. Stragglers: after each synced iteration every rank knows how late each rank was,
   * measured back from the iteration's end (the last bucket completes at nearly the same moment on
   * every rank, so no clocks need to agree) and split by cause (ddp_late_t): late to start its
   * backward pass (input: data, forward, optimizer), late to mark its last grad ready beyond that
   * (compute: a slow backward), late to start its last bucket's collective beyond that (wire: its
   * stream's worker behind). The times travel with the unused-grad report of the default
   * DDP_UNUSED_ERROR policy; under DDP_UNUSED_ZERO nothing is exchanged after the buckets and
   * nobody is named (straggler_rank stays -1), except in elastic contexts, which always make that
   * exchange. The three fields below are the same on every rank. */
  int straggler_rank;  /* the last synced iteration's latest rank, if at least 2 ms late; -1: none */
  int straggler_kind;  /* ddp_late_t: why it was late; DDP_LATE_NONE when straggler_rank is -1 */
  double straggler_ms; /* how late it was (ms) */
  /* This rank's lateness (ms) by cause over its last 100 synced iterations: median and 99th percentile. */
  double late_input_p50_ms;
  double late_input_p99_ms;
  double late_compute_p50_ms;
  double late_compute_p99_ms;
  double late_wire_p50_ms;
  double late_wire_p99_ms;
  uint64_t straggler_warnings; /* warnings given (config.straggler_warning_ms) */
} ddp_stats_t;

/* Why a rank was late (ddp_stats_t.straggler_kind). */
typedef enum ddp_late {
  DDP_LATE_NONE = 0,
  DDP_LATE_INPUT = 1,   /* began its backward pass late */
  DDP_LATE_COMPUTE = 2, /* marked its last grad ready late (a slow backward) */
  DDP_LATE_WIRE = 3     /* started its last bucket's collective late */
} ddp_late_t;

DDP_API ddp_status_t ddp_get_stats(ddp_t ddp, ddp_stats_t* stats);

/* One bucket of the current plan. A versioned struct, like ddp_stats_t: set `size` to
 * sizeof(ddp_bucket_info_t) first; the library writes the fields that lie wholly within `size` bytes
 * and nothing past them, and leaves `size` as it was; the fields of a larger struct (a newer header's)
 * that this library does not know are left as they were. The smallest accepted size holds `dtype`; a
 * smaller one is DDP_ERR_INVALID_ARGUMENT and nothing is written. (Added in 0.2: 0.1's struct had no
 * `size`, see CHANGELOG.md.) */
typedef struct ddp_bucket_info {
  size_t size;       /* sizeof(ddp_bucket_info_t) as compiled by the caller */
  ddp_dtype_t dtype; /* the grads' type */
  ddp_dtype_t wire;  /* the type the collective sums in */
  size_t numel;      /* elements in the bucket */
  int num_grads;     /* grads in the bucket */
  int stream;        /* the stream/communicator it goes to */
} ddp_bucket_info_t;

/* Number of buckets in the current plan (closing registration if open). *learned is 1 once the plan
 * was learned from a backward pass, 0 for the registration plan (may be NULL). */
DDP_API ddp_status_t ddp_get_plan(ddp_t ddp, int* num_buckets, int* learned);

/* Bucket `bucket` of the current plan into *info (whose `size` the caller set), and up to `capacity`
 * of its grad indices, in bucket order, into `grads` (may be NULL with capacity 0). */
DDP_API ddp_status_t ddp_get_bucket(ddp_t ddp, int bucket, ddp_bucket_info_t* info, int* grads, size_t capacity);

/* ------------------------------------------------------------------------------------------------
 * Sharded contexts (config.shard = 1). Each bucket is padded with zeros to a multiple of
 * world_size * (256 bytes / element size) elements, and cut into world_size equal shards: rank r
 * owns elements [r * shard_numel, (r + 1) * shard_numel) of every bucket, each shard starting
 * 256-byte aligned. Padding is never part of a grad and stays zero unless the caller writes it.
 * After ddp_finish_backward (or ddp_reduce_all) this rank's shard of each bucket holds the reduced,
 * scaled grads (as an unsharded context's grads would); the rest of the bucket holds unspecified
 * values (partial sums): read only the shard, and zero the grads before accumulating the next
 * iteration's (as one does anyway). No-sync iterations accumulate whole local grads as usual.
 * check_finite counts the buckets whose shard on this rank held NaN or Inf (ddp_shard_norm gives the
 * global count). Every call below is DDP_ERR_INVALID_STATE on a context that is not sharded ("this
 * call needs a sharded context ...").
 * --------------------------------------------------------------------------------------------- */

/* This rank's shard of one bucket. A versioned struct, like ddp_bucket_info_t: set `size` to
 * sizeof(ddp_shard_info_t) first; the smallest accepted size holds `grad_shard`. */
typedef struct ddp_shard_info {
  size_t size;         /* sizeof(ddp_shard_info_t) as compiled by the caller */
  ddp_dtype_t dtype;   /* the bucket's type */
  size_t bucket_numel; /* elements of the bucket, padding included: world_size * shard_numel */
  size_t shard_numel;  /* elements of every rank's shard */
  size_t shard_offset; /* this rank's shard's first element, counted from the bucket's start */
  size_t arena_offset; /* the same element, in bytes from the start of the arena */
  void* grad_shard;    /* this rank's shard in the grad arena */
  void* param_shard;   /* the same range of the parameter arena */
  size_t grads_numel;  /* elements of the bucket that belong to grads (the rest is padding) */
} ddp_shard_info_t;

/* This rank's shard of bucket `bucket` (closing registration if open). */
DDP_API ddp_status_t ddp_get_shard(ddp_t ddp, int bucket, ddp_shard_info_t* info);

/* Which elements of grad `index` this rank owns: [*first, *first + *count) of the grad (*count 0 if
 * none), at element *shard_pos of its bucket's shard. Any output may be NULL. */
DDP_API ddp_status_t ddp_grad_shard(ddp_t ddp, int index, size_t* first, size_t* count, size_t* shard_pos);

/* Where parameter `index` (the one grad `index` belongs to, same numel and dtype) lives in the
 * library's parameter arena, which has the grad arena's layout (closing registration if open;
 * allocated zeroed). Fill it yourself on every rank, or on one and call ddp_broadcast_params. */
DDP_API ddp_status_t ddp_param_ptr(ddp_t ddp, int index, void** param);

/* Broadcasts the whole parameter arena from `root`, in stream order on `stream` (GPU) or before it
 * returns (host). Not inside a backward pass. Collective. */
DDP_API ddp_status_t ddp_broadcast_params(ddp_t ddp, int root, void* stream);

/* Launches the all-gather of every bucket's parameter shard, asynchronously: on the bucket streams,
 * in the order the forward pass needs them (the last bucket of the plan first: it holds the first
 * layers' parameters when grads were registered in forward order), the same on every rank. GPU: the
 * gathers start after `stream`'s work so far (the optimizer's update). Allowed once after each
 * reduction (ddp_finish_backward of a synced iteration, ddp_reduce_all) and before any; not inside a
 * backward pass; after a backward pass with sync off only once a synced one followed.
 * DDP_ERR_INVALID_STATE otherwise, saying why ("... already gathered since the last reduction", "the
 * shards are not final ..."). Collective. */
DDP_API ddp_status_t ddp_gather_params(ddp_t ddp, void* stream);

/* Waits for the gather of the bucket that holds parameter `index` (-1: every bucket): host memory
 * returns once it is complete; GPU makes `stream` wait for it (no host sync). So a forward pass can
 * use its first layers while later buckets still travel (Megatron's overlap_param_gather).
 * DDP_ERR_INVALID_STATE ("no parameter gather was launched since the last reduction ...") if none
 * was. Errors of the gather
 * (timeouts) surface here, or at the next call that waits. */
DDP_API ddp_status_t ddp_wait_params(ddp_t ddp, int index, void* stream);

/* The global L2 norm of the reduced grads and the number of their non-finite elements, over every
 * rank's shard: each rank sums its shards (squares in float64, NaN and Inf counted apart and left
 * out of the sum), then one exchange of two numbers; every rank gets the same values. For gradient
 * clipping and loss-scaling overflow checks without the full gradient. GPU: reads the grads after
 * `stream`'s work so far, and waits on the host. Not inside a backward pass. Collective. */
DDP_API ddp_status_t ddp_shard_norm(ddp_t ddp, void* stream, double* norm, uint64_t* nonfinite);

/* Destroys the context: waits for its work (bounded by timeout_ms), frees its buffers (arena views
 * become invalid) and its communicator duplicates. Accepts NULL. Not collective. An elastic rank
 * says in the store that it left (a second at most); when every rank of the membership it held has
 * left, the job has ended, and a joiner still waiting to be admitted is told so at once (see
 * ddp_recover); over a store that outlives the ranks, so is one that asks later, until a new elastic
 * context is made over that store. One rank that leaves while the others go on does not end the job;
 * a job that lost a rank and ends without recovering never marks its end (its joiners wait out their
 * bound). */
DDP_API ddp_status_t ddp_destroy(ddp_t ddp);

/* ------------------------------------------------------------------------------------------------
 * Diagnostics. The library prints nothing unless something is wrong or it is asked to: warnings
 * (a stalled collective, see stall_warning_ms) go to the log callback, by default to stderr. The
 * environment variable DDP_DEBUG=INFO adds information: each context's plan when it is committed
 * and when the learned plan is adopted and, every DDP_DEBUG_EVERY iterations (default 100), a
 * one-line summary; DDP_DEBUG=OFF (or NONE) silences the default's warnings too (the callback, if
 * set, still gets them); WARN is the default. Any case; another value warns once and means WARN.
 * The stall inspector: a timeout's message (and a stall warning) names the ranks that did not answer,
 * those behind this rank, and where every rank that answers stands (iteration, call, buckets launched
 * and reduced). Each context answers these questions in the background while it lives (on MPI over a
 * communicator of its own, polled every 2 ms; the asking rank waits at most 500 ms). Not over an NCCL
 * communicator made without MPI or Gloo (ddp_comm_init_nccl, ddp_comm_wrap_nccl): the message says
 * so.
 * ---------------------------------------------------------------------------------------------- */
typedef enum ddp_log_level { DDP_LOG_WARN = 1, DDP_LOG_INFO = 2 } ddp_log_level_t;

/* A log callback: `message` is one line without a newline, valid during the call only. It may be
 * called from any thread of the process, one call at a time, and must not call into libddp. */
typedef void (*ddp_log_fn)(ddp_log_level_t level, const char* message, void* user);

/* Sets the process-wide log callback and its `user` argument; NULL restores the default (stderr).
 * With a callback set the library itself prints nothing. */
DDP_API ddp_status_t ddp_set_log_callback(ddp_log_fn fn, void* user);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* DDP_H_ */
