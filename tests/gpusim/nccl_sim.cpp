// The simulated NCCL (tests only), over MPI: one MPI communicator per NCCL communicator, one rank
// per process. Built from NCCL's documented semantics: collectives are enqueued on a CUDA stream and
// run in stream order, and in call order per communicator; ncclGroupStart/End defers the calls to the
// group's end; in place means sendbuff == recvbuff (for all-gather, sendbuff == recvbuff + rank *
// sendcount); ncclAvg and ncclRedOpCreatePreMulSum (the scalar read at creation for
// ncclScalarHostImmediate, at run time from device memory for ncclScalarDevice); sums of f16 and
// bf16 in float with one rounding. Where it is knowingly simpler than NCCL: tests/gpusim/README.md.
#include <dirent.h>
#include <stddef.h>
#include <mpi.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <set>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gpusim.h"
#include "kernels/elementwise.h"

namespace {

using ddp::elem::BF16;
using ddp::elem::F16;
using ddp::elem::F32;
using ddp::elem::F64;

template <class T>
struct Int {
  typedef T storage;
  typedef T math;
  static math load(storage v) { return v; }
  static storage store(math v) { return v; }
};

struct PreMul {
  ncclDataType_t type;
  ncclScalarResidence_t residence;
  double value;        // host immediate: read at creation
  const void* scalar;  // device: read when the collective runs
};

struct CommState {
  MPI_Comm mpi = MPI_COMM_NULL;   // the collectives, run by stream threads
  MPI_Comm ctrl = MPI_COMM_NULL;  // host-side calls (split), never used by two threads at once
  int rank = 0, nranks = 1, device = 0;
  std::atomic<bool> aborted{false};
  std::atomic<int> async{ncclSuccess};
  std::atomic<bool> abandoned{false};  // a request was left posted: the MPI comms are never freed
  std::mutex mu;
  std::condition_variable cv;
  uint64_t issued = 0, executed = 0;
  std::map<int, PreMul> ops;
  int next_op = ncclNumOps;
  // Nonblocking communicators (ncclConfig_t.blocking = 0): creation runs on `init` and reports
  // ncclInProgress until it ends; every other call answers ncclInProgress and is "in progress" for
  // `pending` more polls of ncclCommGetAsyncError, during which any other call is a usage error.
  bool nonblocking = false;
  std::atomic<bool> initializing{false};
  std::atomic<int> pending{0};
  std::thread init;
};

}  // namespace

struct ncclComm {
  std::shared_ptr<CommState> st;
};

namespace {

std::mutex g_error_mu;
std::string g_last_error;

ncclResult_t err(ncclResult_t rc, const std::string& text) {
  std::lock_guard<std::mutex> lock(g_error_mu);
  g_last_error = "simulated NCCL: " + text;
  return rc;
}

size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8: return 1;
    case ncclFloat16:
    case ncclBfloat16: return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32: return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64: return 8;
    default: return 0;
  }
}

ncclResult_t ensure_mpi() {
  int init = 0;
  MPI_Initialized(&init);
  if (!init) {
    int provided = 0;
    if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS)
      return err(ncclSystemError, "MPI_Init_thread failed");
    atexit([] {
      int fin = 0;
      MPI_Finalized(&fin);
      if (!fin) MPI_Finalize();
    });
  }
  int level = 0;
  MPI_Query_thread(&level);
  if (level < MPI_THREAD_MULTIPLE)
    return err(ncclSystemError, "MPI must be initialized with MPI_THREAD_MULTIPLE (stream threads call it)");
  return ncclSuccess;
}

// Waits for a request while watching for an abort; false if the communicator was aborted (the
// request stays posted and its buffers are kept).
bool wait_req(CommState& st, MPI_Request* req) {
  for (unsigned spin = 0;; ++spin) {
    int done = 0;
    if (MPI_Test(req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
      st.async = ncclSystemError;
      err(ncclSystemError, "an MPI call of a collective failed");
      return false;
    }
    if (done) return true;
    if (st.aborted) {
      st.abandoned = true;
      return false;
    }
    if (spin < 256)
      sched_yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

// Every rank's `bytes` from `in`, in rank order, into a buffer of nranks * bytes (null if aborted).
std::shared_ptr<std::vector<char>> gather_all(CommState& st, const void* in, size_t bytes) {
  auto mine = std::make_shared<std::vector<char>>(static_cast<const char*>(in), static_cast<const char*>(in) + bytes);
  auto all = std::make_shared<std::vector<char>>(bytes * static_cast<size_t>(st.nranks));
  MPI_Request req;
  if (MPI_Iallgather(mine->data(), static_cast<int>(bytes), MPI_BYTE, all->data(), static_cast<int>(bytes), MPI_BYTE,
                     st.mpi, &req) != MPI_SUCCESS) {
    st.async = ncclSystemError;
    return nullptr;
  }
  if (!wait_req(st, &req)) {
    new std::shared_ptr<std::vector<char>>(mine);  // a late rank may still write into them: kept
    new std::shared_ptr<std::vector<char>>(all);
    return nullptr;
  }
  return all;
}

template <class T>
typename T::math apply(ncclRedOp_t op, typename T::math a, typename T::math b) {
  switch (op) {
    case ncclProd: return a * b;
    case ncclMax: return a > b ? a : b;
    case ncclMin: return a < b ? a : b;
    default: return a + b;  // sum, average, premultiplied sum
  }
}

// out[i] = op over ranks (in rank order) of rank r's element first + i, one rounding at the store.
// Floating averages premultiply by 1/nranks (as NCCL does for floating types); integer ones divide
// the sum.
template <class T>
void reduce_typed(const char* all, size_t stride, size_t first, size_t n, int nranks, ncclRedOp_t op, bool premul,
                  double factor, void* out) {
  typedef typename T::math M;
  typedef typename T::storage S;
  const bool floating = static_cast<M>(0.5) != static_cast<M>(0);
  const bool pre = premul || (op == ncclAvg && floating);
  const M f = static_cast<M>(premul ? factor : 1.0 / nranks);
  S* o = static_cast<S*>(out);
  for (size_t i = 0; i < n; ++i) {
    M acc = M();
    for (int r = 0; r < nranks; ++r) {
      S v;
      memcpy(&v, all + static_cast<size_t>(r) * stride + (first + i) * sizeof(S), sizeof(S));
      M x = T::load(v);
      if (pre) x = x * f;
      acc = r == 0 ? x : apply<T>(op, acc, x);
    }
    if (op == ncclAvg && !floating) acc = acc / static_cast<M>(nranks);
    o[i] = T::store(acc);
  }
}

void reduce(ncclDataType_t t, const char* all, size_t stride, size_t first, size_t n, int nranks, ncclRedOp_t op,
            bool premul, double factor, void* out) {
  switch (t) {
    case ncclInt8: return reduce_typed<Int<int8_t>>(all, stride, first, n, nranks, op, premul, factor, out);
    case ncclUint8: return reduce_typed<Int<uint8_t>>(all, stride, first, n, nranks, op, premul, factor, out);
    case ncclInt32: return reduce_typed<Int<int32_t>>(all, stride, first, n, nranks, op, premul, factor, out);
    case ncclUint32: return reduce_typed<Int<uint32_t>>(all, stride, first, n, nranks, op, premul, factor, out);
    case ncclInt64: return reduce_typed<Int<int64_t>>(all, stride, first, n, nranks, op, premul, factor, out);
    case ncclUint64: return reduce_typed<Int<uint64_t>>(all, stride, first, n, nranks, op, premul, factor, out);
    case ncclFloat16: return reduce_typed<F16>(all, stride, first, n, nranks, op, premul, factor, out);
    case ncclBfloat16: return reduce_typed<BF16>(all, stride, first, n, nranks, op, premul, factor, out);
    case ncclFloat32: return reduce_typed<F32>(all, stride, first, n, nranks, op, premul, factor, out);
    case ncclFloat64: return reduce_typed<F64>(all, stride, first, n, nranks, op, premul, factor, out);
    default: return;
  }
}

double scalar_value(ncclDataType_t t, const void* p) {
  switch (t) {
    case ncclFloat16: return F16::load(*static_cast<const uint16_t*>(p));
    case ncclBfloat16: return BF16::load(*static_cast<const uint16_t*>(p));
    case ncclFloat32: return *static_cast<const float*>(p);
    case ncclFloat64: return *static_cast<const double*>(p);
    case ncclInt32: return *static_cast<const int32_t*>(p);
    case ncclUint32: return *static_cast<const uint32_t*>(p);
    case ncclInt64: return static_cast<double>(*static_cast<const int64_t*>(p));
    case ncclUint64: return static_cast<double>(*static_cast<const uint64_t*>(p));
    case ncclInt8: return *static_cast<const int8_t*>(p);
    case ncclUint8: return *static_cast<const uint8_t*>(p);
    default: return 0;
  }
}

// A call waiting for its group's end (or issued at once outside a group).
struct P2p {
  bool send;
  char* buf;  // the sendbuff for a send
  size_t bytes;
  int peer;
};

struct Call {
  std::shared_ptr<CommState> st;
  cudaStream_t stream;
  std::function<void(CommState&)> run;
  std::shared_ptr<std::vector<P2p>> p2p = nullptr;  // a send or a receive: the group's are merged into one call
};

std::atomic<int> g_fail{ncclSuccess};
std::atomic<bool> g_stall{false};
std::mutex g_stuck_mu;
std::set<const CommState*> g_stuck;  // communicators with a collective held by the stall
std::atomic<int> g_splits{0}, g_shared_splits{0};

// The injected faults, where a collective starts running: true if it must not run.
bool injected(CommState& st) {
  if (g_fail != ncclSuccess) {
    st.async = g_fail.load();
    err(static_cast<ncclResult_t>(g_fail.load()), "injected failure of a collective");
    return true;
  }
  if (!g_stall) return false;
  {
    std::lock_guard<std::mutex> lock(g_stuck_mu);
    g_stuck.insert(&st);
  }
  while (!st.aborted) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::lock_guard<std::mutex> lock(g_stuck_mu);
  g_stuck.erase(&st);
  return true;
}

// NCCL's abort frees the communicator's device memory, which waits for the device: a kernel of
// another communicator spinning on a dead peer holds it until that one is aborted too. So an abort
// waits here until every stuck collective of its device belongs to an aborted communicator: aborts
// issued one after another hang (given up after 3 s, with a line on stderr, so that a test fails
// instead of hanging), aborts issued together do not.
void wait_for_siblings(const CommState& st) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  for (;;) {
    bool spinning = false;
    {
      std::lock_guard<std::mutex> lock(g_stuck_mu);
      for (const CommState* o : g_stuck) spinning = spinning || (o != &st && o->device == st.device && !o->aborted);
    }
    if (!spinning) return;
    if (std::chrono::steady_clock::now() > give_up) {
      fprintf(stderr, "gpusim: ncclCommAbort deadlocked: another communicator's collective spins on device %d\n",
              st.device);
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// What a nonblocking communicator answers for a call that was accepted: in progress, for a poll.
ncclResult_t accepted(CommState& st, ncclResult_t rc) {
  if (rc != ncclSuccess || !st.nonblocking) return rc;
  st.pending = 1;
  return ncclInProgress;
}

thread_local int t_group_depth = 0;
thread_local std::vector<Call> t_group;

// Enqueues a call on its stream; it runs when the stream gets there and every earlier call of its
// communicator has run (NCCL runs a communicator's operations in the order they were issued).
ncclResult_t issue(Call c) {
  uint64_t seq;
  {
    std::lock_guard<std::mutex> lock(c.st->mu);
    seq = c.st->issued++;
  }
  std::shared_ptr<CommState> st = c.st;
  auto run = std::move(c.run);
  cudaError_t rc = gpusim::enqueue(c.stream, [st, seq, run] {
    {
      std::unique_lock<std::mutex> lock(st->mu);
      st->cv.wait(lock, [&] { return st->executed == seq || st->aborted; });
    }
    if (!st->aborted && st->async == ncclSuccess && !injected(*st)) run(*st);
    std::lock_guard<std::mutex> lock(st->mu);
    if (st->executed <= seq) st->executed = seq + 1;
    st->cv.notify_all();
  });
  if (rc != cudaSuccess) {
    std::lock_guard<std::mutex> lock(st->mu);
    ++st->executed;  // never runs: do not hold up the calls after it
    st->cv.notify_all();
    return err(ncclUnhandledCudaError, std::string("enqueueing on the stream failed: ") + cudaGetErrorString(rc));
  }
  return ncclSuccess;
}

ncclResult_t submit(Call c) {
  if (t_group_depth > 0) {
    t_group.push_back(std::move(c));
    return ncclSuccess;
  }
  std::shared_ptr<CommState> st = c.st;
  return accepted(*st, issue(std::move(c)));
}

// A group's sends and receives of one communicator, all posted before any is waited for (NCCL runs
// them together, so a rank may send to and receive from every peer in one group). The bytes travel
// through buffers of their own: an aborted wait leaves MPI writing those, never the caller's memory.
void run_p2p(CommState& st, const std::vector<P2p>& ops) {
  auto bufs = std::make_shared<std::vector<std::vector<char>>>(ops.size());
  std::vector<MPI_Request> reqs(ops.size(), MPI_REQUEST_NULL);
  for (size_t i = 0; i < ops.size(); ++i) {
    const P2p& o = ops[i];
    std::vector<char>& b = (*bufs)[i];
    b.resize(o.bytes);
    if (o.send && o.bytes) memcpy(b.data(), o.buf, o.bytes);
    const int rc = o.send ? MPI_Isend(b.data(), static_cast<int>(o.bytes), MPI_BYTE, o.peer, 7, st.mpi, &reqs[i])
                          : MPI_Irecv(b.data(), static_cast<int>(o.bytes), MPI_BYTE, o.peer, 7, st.mpi, &reqs[i]);
    if (rc != MPI_SUCCESS) {
      st.async = ncclSystemError;
      new std::shared_ptr<std::vector<std::vector<char>>>(bufs);  // posted ones may still complete
      return;
    }
  }
  for (MPI_Request& r : reqs)
    if (!wait_req(st, &r)) {
      new std::shared_ptr<std::vector<std::vector<char>>>(bufs);
      return;
    }
  for (size_t i = 0; i < ops.size(); ++i)
    if (!ops[i].send && ops[i].bytes) memcpy(ops[i].buf, (*bufs)[i].data(), ops[i].bytes);
}

ncclResult_t check_comm(ncclComm_t comm) {
  if (!comm || !comm->st) return err(ncclInvalidArgument, "comm is NULL");
  if (comm->st->aborted) return err(ncclInvalidUsage, "the communicator was aborted");
  if (comm->st->initializing || comm->st->pending > 0)
    return err(ncclInvalidUsage,
               "a call on a nonblocking communicator while an earlier one is in progress "
               "(poll ncclCommGetAsyncError until it is no longer ncclInProgress)");
  return ncclSuccess;
}

// The checks NCCL makes before enqueueing: the buffers are device memory of the communicator's
// device, the stream is of that device, the type and op are valid for the communicator.
ncclResult_t check_call(ncclComm_t comm, const void* send, size_t send_bytes, const void* recv, size_t recv_bytes,
                        ncclDataType_t type, cudaStream_t stream) {
  if (ncclResult_t r = check_comm(comm)) return r;
  if (type_size(type) == 0) return err(ncclInvalidArgument, "invalid datatype " + std::to_string(type));
  const int dev = comm->st->device;
  const int sd = gpusim::stream_device(stream);
  if (sd < 0) return err(ncclInvalidArgument, "invalid CUDA stream");
  if (sd != dev)
    return err(ncclInvalidUsage,
               "stream of device " + std::to_string(sd) + " for a communicator of device " + std::to_string(dev));
  int d = -1;
  if (send_bytes && (!gpusim::device_range(send, send_bytes, &d) || d != dev))
    return err(ncclInvalidArgument, "sendbuff is not device memory of the communicator's device");
  if (recv_bytes && (!gpusim::device_range(recv, recv_bytes, &d) || d != dev))
    return err(ncclInvalidArgument, "recvbuff is not device memory of the communicator's device");
  return ncclSuccess;
}

ncclResult_t check_op(CommState& st, ncclRedOp_t op, ncclDataType_t type, PreMul* pm) {
  if (op >= ncclSum && op < ncclNumOps) return ncclSuccess;
  std::lock_guard<std::mutex> lock(st.mu);
  auto it = st.ops.find(op);
  if (it == st.ops.end()) return err(ncclInvalidArgument, "invalid reduction operation " + std::to_string(op));
  if (it->second.type != type) return err(ncclInvalidArgument, "a premultiplied sum created for another datatype");
  *pm = it->second;
  return ncclSuccess;
}

long env_long(const char* name, long fallback) {
  const char* v = getenv(name);
  return v && *v ? atol(v) : fallback;
}

struct IdBody {
  char magic[8];
  uint64_t nonce;
};

// The ranks of a new communicator find each other through a directory named by the id: each writes
// its MPI_COMM_WORLD rank into a file named by its NCCL rank, and reads the others' once all are
// there. Then MPI_Comm_create_group over MPI_COMM_WORLD builds the communicator in NCCL rank order.
ncclResult_t rendezvous(const IdBody& id, int nranks, int rank, MPI_Comm* out, const std::atomic<bool>* aborted) {
  if (nranks == 1) {
    if (MPI_Comm_dup(MPI_COMM_SELF, out) != MPI_SUCCESS) return err(ncclSystemError, "MPI_Comm_dup failed");
    return ncclSuccess;
  }
  const char* tmp = getenv("TMPDIR");
  char dir[512];
  snprintf(dir, sizeof dir, "%s/ddpsim-nccl-%016llx", tmp && *tmp ? tmp : "/tmp",
           static_cast<unsigned long long>(id.nonce));
  mkdir(dir, 0700);
  int world = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world);
  char path[600], part[620];
  snprintf(path, sizeof path, "%s/%d", dir, rank);
  snprintf(part, sizeof part, "%s/.%d.part", dir, rank);
  if (access(path, F_OK) == 0) return err(ncclInvalidUsage, "rank " + std::to_string(rank) + " joined twice");
  if (FILE* f = fopen(part, "w")) {
    fprintf(f, "%d\n", world);
    fclose(f);
    rename(part, path);
  } else {
    return err(ncclSystemError, std::string("cannot write the rendezvous file ") + part);
  }
  std::vector<int> ranks(static_cast<size_t>(nranks), -1);
  const auto until =
      std::chrono::steady_clock::now() + std::chrono::seconds(env_long("DDP_GPUSIM_INIT_TIMEOUT_S", 120));
  for (;;) {
    int found = 0;
    for (int r = 0; r < nranks; ++r) {
      char p[600];
      snprintf(p, sizeof p, "%s/%d", dir, r);
      if (FILE* f = fopen(p, "r")) {
        if (fscanf(f, "%d", &ranks[static_cast<size_t>(r)]) == 1) ++found;
        fclose(f);
      }
    }
    if (found == nranks) break;
    if (aborted && *aborted) {
      unlink(path);  // the others must not count this rank in
      return err(ncclInvalidUsage, "ncclCommInitRankConfig: aborted while waiting for the other ranks");
    }
    if (std::chrono::steady_clock::now() > until)
      return err(ncclSystemError, "ncclCommInitRank: timed out waiting for the other ranks to join");
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  MPI_Group wg, g;
  MPI_Comm_group(MPI_COMM_WORLD, &wg);
  MPI_Group_incl(wg, nranks, ranks.data(), &g);
  const int rc = MPI_Comm_create_group(MPI_COMM_WORLD, g, static_cast<int>(id.nonce % 30000), out);
  MPI_Group_free(&g);
  MPI_Group_free(&wg);
  if (rc != MPI_SUCCESS) return err(ncclSystemError, "MPI_Comm_create_group failed");
  MPI_Barrier(*out);  // every rank has read the directory
  if (rank == 0) {
    for (int r = 0; r < nranks; ++r) {
      char p[600];
      snprintf(p, sizeof p, "%s/%d", dir, r);
      unlink(p);
    }
    rmdir(dir);
  }
  return ncclSuccess;
}

void init_state(CommState* st, MPI_Comm mpi, int device) {
  st->mpi = mpi;
  MPI_Comm_set_errhandler(mpi, MPI_ERRORS_RETURN);
  MPI_Comm_dup(mpi, &st->ctrl);
  MPI_Comm_rank(mpi, &st->rank);
  MPI_Comm_size(mpi, &st->nranks);
  st->device = device;
}

ncclComm_t make_comm(MPI_Comm mpi, int device) {
  auto st = std::make_shared<CommState>();
  init_state(st.get(), mpi, device);
  return new ncclComm{st};
}

// Waits for a nonblocking creation's thread. One that an abort cut short may be stuck in MPI for a
// rank that died (MPI_Comm_create_group, MPI_Comm_split never return then): it is left behind, its
// closure keeping the state alive, as a real NCCL leaves a dead peer's bootstrap to the abort.
void join_init(CommState& st) {
  if (!st.init.joinable()) return;
  if (st.aborted && st.initializing)
    st.init.detach();
  else
    st.init.join();
}

ncclResult_t need_device(int* device) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    return err(ncclUnhandledCudaError, "no CUDA device");
  }
  *device = gpusim::current_device();
  return ncclSuccess;
}

// What both creation calls check first: the arguments, the id, a device, MPI.
ncclResult_t check_init(ncclComm_t* comm, int nranks, const ncclUniqueId& id, int rank, IdBody* body, int* device) {
  if (!comm) return err(ncclInvalidArgument, "comm is NULL");
  *comm = nullptr;
  if (nranks < 1 || rank < 0 || rank >= nranks)
    return err(ncclInvalidArgument, "rank " + std::to_string(rank) + " of " + std::to_string(nranks));
  memcpy(body, id.internal, sizeof *body);
  if (memcmp(body->magic, "ddpsim1", 8) != 0) return err(ncclInvalidArgument, "not a unique id of ncclGetUniqueId");
  if (ncclResult_t r = need_device(device)) return r;
  return ensure_mpi();
}

}  // namespace

namespace gpusim {
void nccl_inject_async_error(ncclComm_t comm, ncclResult_t error) {
  if (comm && comm->st) comm->st->async = error;
}
void nccl_fail_collectives(ncclResult_t error) { g_fail = error; }
void nccl_stall_collectives(bool stall) { g_stall = stall; }

void nccl_split_counts(int* splits, int* shared) {
  *splits = g_splits;
  *shared = g_shared_splits;
}
}  // namespace gpusim

extern "C" {

ncclResult_t ncclGetVersion(int* version) {
  if (!version) return err(ncclInvalidArgument, "version is NULL");
  *version = static_cast<int>(env_long("DDP_GPUSIM_NCCL_VERSION", NCCL_VERSION_CODE));
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

const char* ncclGetLastError(ncclComm_t) {
  static thread_local std::string copy;
  std::lock_guard<std::mutex> lock(g_error_mu);
  copy = g_last_error;
  return copy.c_str();
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (!id) return err(ncclInvalidArgument, "uniqueId is NULL");
  static std::atomic<uint64_t> made{0};
  std::random_device rd;
  IdBody body;
  memcpy(body.magic, "ddpsim1", 8);
  body.nonce = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ (static_cast<uint64_t>(getpid()) << 20) ^
               static_cast<uint64_t>(time(nullptr)) ^ made.fetch_add(1) * 0x9e3779b97f4a7c15ull;
  memset(id, 0, sizeof *id);
  memcpy(id->internal, &body, sizeof body);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank) {
  IdBody body;
  int device = 0;
  if (ncclResult_t r = check_init(comm, nranks, commId, rank, &body, &device)) return r;
  MPI_Comm c;
  if (ncclResult_t r = rendezvous(body, nranks, rank, &c, nullptr)) return r;
  *comm = make_comm(c, device);
  return ncclSuccess;
}

// Blocking unless config->blocking is 0: then the rendezvous runs in the background, the handle is
// returned at once with ncclInProgress, and ncclCommGetAsyncError says when it is ready (or failed);
// ncclCommAbort stops a rendezvous that waits for a rank that never comes.
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank, ncclConfig_t* config) {
  if (config && (config->magic != 0xcafebeef || config->size < offsetof(ncclConfig_t, blocking) + sizeof(int)))
    return err(ncclInvalidArgument, "ncclConfig_t not made by NCCL_CONFIG_INITIALIZER");
  if (!config || config->blocking != 0) return ncclCommInitRank(comm, nranks, commId, rank);
  IdBody body;
  int device = 0;
  if (ncclResult_t r = check_init(comm, nranks, commId, rank, &body, &device)) return r;
  auto st = std::make_shared<CommState>();
  st->nonblocking = true;
  st->initializing = true;
  st->rank = rank;
  st->nranks = nranks;
  st->device = device;
  CommState* raw = st.get();
  st->init = std::thread([raw, keep = st, body, nranks, rank, device] {
    MPI_Comm c;
    ncclResult_t r = rendezvous(body, nranks, rank, &c, &raw->aborted);
    if (r == ncclSuccess) init_state(raw, c, device);
    raw->async = r;
    raw->initializing = false;
  });
  *comm = new ncclComm{st};
  return ncclInProgress;
}

ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist) {
  if (!comms || ndev < 1) return err(ncclInvalidArgument, "ncclCommInitAll: no devices");
  if (ndev > 1)
    return err(ncclInvalidUsage, "the simulation runs one rank per process: ncclCommInitAll of several devices");
  if (devlist && cudaSetDevice(devlist[0]) != cudaSuccess) return err(ncclInvalidArgument, "invalid device");
  ncclUniqueId id;
  ncclGetUniqueId(&id);
  return ncclCommInitRank(comms, 1, id, 0);
}

// A config's blocking field decides whether the new communicator is nonblocking; without a config
// (or with blocking left undefined) it inherits its parent's.
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config) {
  if (ncclResult_t r = check_comm(comm)) return r;
  if (!newcomm) return err(ncclInvalidArgument, "newcomm is NULL");
  if (config && config->magic != 0xcafebeef) return err(ncclInvalidArgument, "config not initialized");
  ++g_splits;
  if (config && config->splitShare == 1) ++g_shared_splits;
  const bool nonblocking =
      config && config->blocking != NCCL_CONFIG_UNDEF_INT ? config->blocking == 0 : comm->st->nonblocking;
  if (nonblocking && color != NCCL_SPLIT_NOCOLOR) {
    // In the background, as NCCL does: a split that waits for a rank that died ends at the caller's
    // deadline (ncclCommAbort), not never.
    auto st = std::make_shared<CommState>();
    st->nonblocking = true;
    st->initializing = true;
    st->device = comm->st->device;
    CommState* raw = st.get();
    const MPI_Comm parent = comm->st->ctrl;
    st->init = std::thread([raw, keep = st, parent, color, key] {
      MPI_Comm c = MPI_COMM_NULL;
      if (MPI_Comm_split(parent, color, key, &c) == MPI_SUCCESS && c != MPI_COMM_NULL) {
        init_state(raw, c, raw->device);
      } else {
        raw->async = err(ncclSystemError, "MPI_Comm_split failed");
      }
      raw->initializing = false;
    });
    *newcomm = new ncclComm{st};
    return ncclInProgress;
  }
  MPI_Comm c;
  if (MPI_Comm_split(comm->st->ctrl, color == NCCL_SPLIT_NOCOLOR ? MPI_UNDEFINED : color, key, &c) != MPI_SUCCESS)
    return err(ncclSystemError, "MPI_Comm_split failed");
  *newcomm = c == MPI_COMM_NULL ? nullptr : make_comm(c, comm->st->device);
  if (!*newcomm || !nonblocking) return ncclSuccess;
  (*newcomm)->st->nonblocking = true;
  return accepted(*(*newcomm)->st, ncclSuccess);
}

// Waits for the communicator's operations, then frees it.
ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (!comm) return err(ncclInvalidArgument, "comm is NULL");
  std::shared_ptr<CommState> st = comm->st;
  if (st->initializing) return err(ncclInvalidUsage, "ncclCommDestroy of a communicator still being created");
  join_init(*st);
  if (st->mpi == MPI_COMM_NULL) {  // creation failed: nothing to free but the handle
    delete comm;
    return ncclSuccess;
  }
  {
    std::unique_lock<std::mutex> lock(st->mu);
    st->cv.wait(lock, [&] { return st->executed == st->issued || st->aborted; });
  }
  if (!st->aborted && !st->abandoned) {
    MPI_Comm_free(&st->mpi);
    MPI_Comm_free(&st->ctrl);
  }
  delete comm;
  return ncclSuccess;
}

// Stops the communicator's operations where they are (a collective waiting for a peer returns), then
// frees the handle. MPI communicators with a request left posted are never freed.
ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (!comm) return err(ncclInvalidArgument, "comm is NULL");
  std::shared_ptr<CommState> st = comm->st;
  {
    std::lock_guard<std::mutex> lock(st->mu);
    st->aborted = true;
    st->cv.notify_all();
  }
  wait_for_siblings(*st);
  join_init(*st);
  delete comm;
  return ncclSuccess;
}

// Waits for the communicator's operations; on a nonblocking communicator, in the background.
ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  if (ncclResult_t r = check_comm(comm)) return r;
  std::shared_ptr<CommState> st = comm->st;
  if (st->nonblocking) return accepted(*st, ncclSuccess);
  std::unique_lock<std::mutex> lock(st->mu);
  st->cv.wait(lock, [&] { return st->executed == st->issued || st->aborted; });
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError) {
  if (!comm || !asyncError) return err(ncclInvalidArgument, "NULL argument");
  CommState& st = *comm->st;
  ncclResult_t a = static_cast<ncclResult_t>(st.async.load());
  if (a == ncclSuccess && st.initializing) a = ncclInProgress;
  if (a == ncclSuccess && st.pending > 0) {
    --st.pending;
    a = ncclInProgress;
  }
  *asyncError = a;
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  if (!comm || !count) return err(ncclInvalidArgument, "NULL argument");
  *count = comm->st->nranks;
  return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device) {
  if (!comm || !device) return err(ncclInvalidArgument, "NULL argument");
  *device = comm->st->device;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  if (!comm || !rank) return err(ncclInvalidArgument, "NULL argument");
  *rank = comm->st->rank;
  return ncclSuccess;
}

ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t* op, void* scalar, ncclDataType_t datatype,
                                      ncclScalarResidence_t residence, ncclComm_t comm) {
  if (ncclResult_t r = check_comm(comm)) return r;
  if (!op || !scalar) return err(ncclInvalidArgument, "NULL argument");
  if (type_size(datatype) == 0) return err(ncclInvalidArgument, "invalid datatype");
  PreMul pm{datatype, residence, 0.0, nullptr};
  if (residence == ncclScalarHostImmediate) {
    pm.value = scalar_value(datatype, scalar);
  } else if (residence == ncclScalarDevice) {
    if (!gpusim::device_range(scalar, type_size(datatype)))
      return err(ncclInvalidArgument, "a device scalar that is not device memory");
    pm.scalar = scalar;
  } else {
    return err(ncclInvalidArgument, "invalid scalar residence");
  }
  std::lock_guard<std::mutex> lock(comm->st->mu);
  const int id = comm->st->next_op++;
  comm->st->ops[id] = pm;
  *op = static_cast<ncclRedOp_t>(id);
  return ncclSuccess;
}

ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm) {
  if (ncclResult_t r = check_comm(comm)) return r;
  std::lock_guard<std::mutex> lock(comm->st->mu);
  if (!comm->st->ops.erase(op)) return err(ncclInvalidArgument, "ncclRedOpDestroy of an op this comm did not make");
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
  const size_t bytes = count * type_size(datatype);
  if (ncclResult_t r = check_call(comm, sendbuff, bytes, recvbuff, bytes, datatype, stream)) return r;
  PreMul pm{datatype, ncclScalarHostImmediate, 1.0, nullptr};
  if (ncclResult_t r = check_op(*comm->st, op, datatype, &pm)) return r;
  const bool premul = op >= ncclNumOps;
  return submit(Call{comm->st, stream, [=](CommState& st) {
                       auto all = gather_all(st, sendbuff, bytes);
                       if (!all) return;
                       const double f = pm.scalar ? scalar_value(datatype, pm.scalar) : pm.value;
                       reduce(datatype, all->data(), bytes, 0, count, st.nranks, premul ? ncclSum : op, premul, f,
                              recvbuff);
                     }});
}

ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                        int root, ncclComm_t comm, cudaStream_t stream) {
  if (ncclResult_t r = check_comm(comm)) return r;
  if (root < 0 || root >= comm->st->nranks) return err(ncclInvalidArgument, "root out of range");
  const size_t bytes = count * type_size(datatype);
  const bool is_root = comm->st->rank == root;
  if (ncclResult_t r = check_call(comm, sendbuff, bytes, recvbuff, is_root ? bytes : 0, datatype, stream)) return r;
  PreMul pm{datatype, ncclScalarHostImmediate, 1.0, nullptr};
  if (ncclResult_t r = check_op(*comm->st, op, datatype, &pm)) return r;
  const bool premul = op >= ncclNumOps;
  return submit(Call{comm->st, stream, [=](CommState& st) {
                       auto all = gather_all(st, sendbuff, bytes);
                       if (!all || !is_root) return;
                       const double f = pm.scalar ? scalar_value(datatype, pm.scalar) : pm.value;
                       reduce(datatype, all->data(), bytes, 0, count, st.nranks, premul ? ncclSum : op, premul, f,
                              recvbuff);
                     }});
}

ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream) {
  if (ncclResult_t r = check_comm(comm)) return r;
  if (root < 0 || root >= comm->st->nranks) return err(ncclInvalidArgument, "root out of range");
  const size_t bytes = count * type_size(datatype);
  const bool is_root = comm->st->rank == root;
  if (ncclResult_t r = check_call(comm, sendbuff, is_root ? bytes : 0, recvbuff, bytes, datatype, stream)) return r;
  return submit(Call{comm->st, stream, [=](CommState& st) {
                       auto buf = std::make_shared<std::vector<char>>(bytes);
                       if (is_root && bytes) memcpy(buf->data(), sendbuff, bytes);
                       MPI_Request req;
                       if (MPI_Ibcast(buf->data(), static_cast<int>(bytes), MPI_BYTE, root, st.mpi, &req) !=
                           MPI_SUCCESS) {
                         st.async = ncclSystemError;
                         return;
                       }
                       if (!wait_req(st, &req)) {
                         new std::shared_ptr<std::vector<char>>(buf);
                         return;
                       }
                       if (bytes) memcpy(recvbuff, buf->data(), bytes);
                     }});
}

ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream) {
  if (ncclResult_t r = check_comm(comm)) return r;
  const size_t bytes = sendcount * type_size(datatype);
  if (ncclResult_t r =
          check_call(comm, sendbuff, bytes, recvbuff, bytes * static_cast<size_t>(comm->st->nranks), datatype, stream))
    return r;
  return submit(Call{comm->st, stream, [=](CommState& st) {
                       auto all = gather_all(st, sendbuff, bytes);
                       if (all && !all->empty()) memcpy(recvbuff, all->data(), all->size());
                     }});
}

ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  if (ncclResult_t r = check_comm(comm)) return r;
  const size_t bytes = recvcount * type_size(datatype);
  const size_t total = bytes * static_cast<size_t>(comm->st->nranks);
  if (ncclResult_t r = check_call(comm, sendbuff, total, recvbuff, bytes, datatype, stream)) return r;
  PreMul pm{datatype, ncclScalarHostImmediate, 1.0, nullptr};
  if (ncclResult_t r = check_op(*comm->st, op, datatype, &pm)) return r;
  const bool premul = op >= ncclNumOps;
  return submit(Call{comm->st, stream, [=](CommState& st) {
                       auto all = gather_all(st, sendbuff, total);
                       if (!all) return;
                       const double f = pm.scalar ? scalar_value(datatype, pm.scalar) : pm.value;
                       reduce(datatype, all->data(), total, recvcount * static_cast<size_t>(st.rank), recvcount,
                              st.nranks, premul ? ncclSum : op, premul, f, recvbuff);
                     }});
}

// Point to point: checked as NCCL checks them, and run as one call with the rest of their group.
static ncclResult_t p2p_call(bool send, void* buf, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                             cudaStream_t stream) {
  if (ncclResult_t r = check_comm(comm)) return r;
  if (peer < 0 || peer >= comm->st->nranks) return err(ncclInvalidArgument, "peer out of range");
  const size_t bytes = count * type_size(datatype);
  if (ncclResult_t r = check_call(comm, send ? buf : nullptr, send ? bytes : 0, send ? nullptr : buf, send ? 0 : bytes,
                                  datatype, stream))
    return r;
  auto ops = std::make_shared<std::vector<P2p>>(1, P2p{send, static_cast<char*>(buf), bytes, peer});
  return submit(Call{comm->st, stream, [ops](CommState& st) { run_p2p(st, *ops); }, ops});
}

ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return p2p_call(true, const_cast<void*>(sendbuff), count, datatype, peer, comm, stream);
}

ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return p2p_call(false, recvbuff, count, datatype, peer, comm, stream);
}

ncclResult_t ncclGroupStart(void) {
  ++t_group_depth;
  return ncclSuccess;
}

// The group's calls are issued here, in the order they were made.
ncclResult_t ncclGroupEnd(void) {
  if (t_group_depth == 0) return err(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  if (--t_group_depth > 0) return ncclSuccess;
  std::vector<Call> held, calls;
  held.swap(t_group);
  // Consecutive sends and receives of one communicator on one stream become one call.
  for (Call& c : held) {
    Call* last = calls.empty() ? nullptr : &calls.back();
    if (c.p2p && last && last->p2p && last->st == c.st && last->stream == c.stream)
      last->p2p->insert(last->p2p->end(), c.p2p->begin(), c.p2p->end());
    else
      calls.push_back(std::move(c));
  }
  ncclResult_t first = ncclSuccess;
  bool nonblocking = false;
  for (Call& c : calls) {
    std::shared_ptr<CommState> st = c.st;
    ncclResult_t r = issue(std::move(c));
    if (r != ncclSuccess && first == ncclSuccess) first = r;
    if (r == ncclSuccess && st->nonblocking) {
      nonblocking = true;
      accepted(*st, r);
    }
  }
  return first == ncclSuccess && nonblocking ? ncclInProgress : first;
}

}  // extern "C"
