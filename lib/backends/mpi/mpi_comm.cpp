// The MPI communicator: host memory, Open MPI as the engine. An MPI collective cannot be cancelled.
// On a host stream's worker, allreduce blocks and the thread that waits for the stream keeps the
// deadline (it writes the worker off if a peer never arrives); everywhere else a collective is issued
// nonblocking and polled against its deadline.
//
// Allreduces of host pieces are libddp's ring (host/ring.hpp) over MPI point-to-point
// messages rather than MPI_Allreduce: averaging is folded into the last addition (a separate pass
// over a piece measured 25-55% of the allreduce's time on this engine) and every rank receives the
// same bits. Small ones stay MPI_Allreduce, whose algorithms suit latency-bound sizes better.
#include "core/comms.hpp"
#include "core/knobs.hpp"

#include <mpi.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "host/host_device.hpp"
#include "host/ring.hpp"

namespace ddp {

namespace {

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return format("MPI error %d", code);
  return std::string(text, static_cast<size_t>(len));
}

#define DDP_MPI_CHECK(call)                                                                                         \
  do {                                                                                                              \
    int ddp_mpi_rc_ = (call);                                                                                       \
    if (ddp_mpi_rc_ != MPI_SUCCESS) fail(DDP_ERR_MPI, "%s failed: %s", #call, mpi_error_text(ddp_mpi_rc_).c_str()); \
  } while (0)

std::once_flag g_init_once, g_hook_once;
bool g_we_initialized = false;

// Set once a request of this process was left posted at its deadline (a collective or a duplication
// that timed out): a peer may be dead. With that, or with a stream worker written off inside a
// collective (host::any_written_off), MPI_Finalize is unsafe (it unloads the transports under a
// blocked worker) and may wait forever (for the dead peer): it is skipped at exit. An abort with
// nothing left inside MPI (a mismatch, the unused-grad error, a failed hook) finalizes as usual.
std::atomic<bool> g_gave_up{false};
void gave_up() { g_gave_up.store(true); }

// The stall inspector's responder threads (MpiProber::serve) that are running, so that MPI_Finalize,
// whoever calls it, first stops them: a thread inside MPI_Iprobe while MPI shuts down crashes.
struct Responders {
  std::mutex mu;
  std::vector<std::function<void()>*> stops;
};
Responders& responders() {
  static auto* r = new Responders();  // never destroyed: used at exit
  return *r;
}
void stop_responders() {
  Responders& r = responders();
  std::lock_guard<std::mutex> lock(r.mu);
  for (std::function<void()>* stop : r.stops) (*stop)();
  r.stops.clear();
}

// Attributes of MPI_COMM_SELF are deleted first thing in MPI_Finalize, while MPI still works.
int on_finalize(MPI_Comm, int, void*, void*) {
  stop_responders();
  return MPI_SUCCESS;
}
void hook_finalize() {
  std::call_once(g_hook_once, [] {
    int key = MPI_KEYVAL_INVALID;
    if (MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, on_finalize, &key, nullptr) == MPI_SUCCESS)
      MPI_Comm_set_attr(MPI_COMM_SELF, key, nullptr);
  });
}

// The library's own MPI_Finalize, when it initialized MPI: skipped after a collective gave up.
void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  stop_responders();
  if (!g_gave_up.load() && !host::any_written_off()) MPI_Finalize();
}

void ensure_mpi() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    std::call_once(g_init_once, [] {
      int provided = 0;
      if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided) == MPI_SUCCESS) {
        g_we_initialized = true;
        std::atexit(finalize_at_exit);
      }
    });
    MPI_Initialized(&initialized);
    if (!initialized) fail(DDP_ERR_MPI, "MPI_Init_thread failed");
  }
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) fail(DDP_ERR_INVALID_STATE, "MPI has already been finalized");
  hook_finalize();
  int level = 0;
  MPI_Query_thread(&level);
  if (level < MPI_THREAD_MULTIPLE)
    fail(DDP_ERR_UNSUPPORTED,
         "MPI was initialized with thread level %d; libddp needs MPI_THREAD_MULTIPLE (%d), since its "
         "bucket streams call MPI from worker threads: use MPI_Init_thread",
         level, MPI_THREAD_MULTIPLE);
}

MPI_Datatype mpi_type(Dtype d) {
  switch (d) {
    case Dtype::F32: return MPI_FLOAT;
    case Dtype::F64: return MPI_DOUBLE;
    default: fail(DDP_ERR_INTERNAL, "MPI has no %s arithmetic", dtype_name(d));
  }
}

// Waits for `req`, driving MPI progress, until the deadline. Yields between polls so that ranks
// oversubscribed on few cores still make progress.
void wait_request(MPI_Request* req, Deadline dl, const char* what) {
  for (unsigned spin = 0;; ++spin) {
    int done = 0;
    DDP_MPI_CHECK(MPI_Test(req, &done, MPI_STATUS_IGNORE));
    if (done) return;
    if ((spin & 63u) == 63u && dl.passed()) {
      gave_up();  // the request stays posted
      fail(DDP_ERR_TIMEOUT,
           "%s did not complete before the timeout: another rank stalled, died or "
           "issued a different collective",
           what);
    }
    sched_yield();
  }
}

// MPI_Comm_dup waits for every rank and cannot be stopped: the nonblocking MPI_Comm_idup instead,
// polled until `dl`. One left posted at the deadline completes whenever the last rank comes, into a
// handle kept until exit.
MPI_Comm idup_within(MPI_Comm base, Deadline dl, const char* why) {
  auto out = std::make_shared<MPI_Comm>(MPI_COMM_NULL);
  MPI_Request req;
  DDP_MPI_CHECK(MPI_Comm_idup(base, out.get(), &req));
  try {
    wait_request(
        &req, dl,
        format("the duplication of the MPI communicator (MPI_Comm_idup, waiting for every rank to %s)", why).c_str());
  } catch (const Error& e) {
    if (e.status() == DDP_ERR_TIMEOUT) host::keep_until_exit(out);
    throw;
  }
  return *out;
}

// Counts larger than an int are sent in pieces.
constexpr size_t kMaxChunk = size_t(1) << 30;
// The ring (host/ring.hpp): from this many bytes on (below, MPI_Allreduce and a scaling pass).
constexpr size_t kRingMinBytes = size_t(64) << 10;
constexpr int kRingTag = 0x7ddb;

// The ring's neighbours over MPI. On a stream worker, one blocking MPI_Sendrecv (the thread that
// drains the stream keeps the deadline); elsewhere nonblocking, polled against the deadline.
class MpiRingLink final : public host::RingLink {
 public:
  MpiRingLink(MPI_Comm c, int rank, int size, bool worker, Deadline dl)
      : comm_(c), rank_(rank), size_(size), worker_(worker), dl_(dl) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  bool worker() const { return worker_; }
  void exchange_with(int right, const void* out, size_t sn, int left, void* in, size_t rn) override {
    if (worker_) {
      DDP_MPI_CHECK(MPI_Sendrecv(out, static_cast<int>(sn), MPI_BYTE, right, kRingTag, in, static_cast<int>(rn),
                                 MPI_BYTE, left, kRingTag, comm_, MPI_STATUS_IGNORE));
      return;
    }
    post_with(right, out, sn, left, in, rn);
    wait_posted();
  }
  // Nonblocking halves; on a worker the wait blocks in MPI (no polling), elsewhere it polls against
  // the deadline.
  void post_with(int right, const void* out, size_t sn, int left, void* in, size_t rn) override {
    DDP_MPI_CHECK(MPI_Irecv(in, static_cast<int>(rn), MPI_BYTE, left, kRingTag, comm_, &req_[0]));
    DDP_MPI_CHECK(MPI_Isend(out, static_cast<int>(sn), MPI_BYTE, right, kRingTag, comm_, &req_[1]));
  }
  void wait_posted() override {
    if (worker_) {
      DDP_MPI_CHECK(MPI_Waitall(2, req_, MPI_STATUSES_IGNORE));
      return;
    }
    wait_request(&req_[0], dl_, "MPI ring allreduce (receive)");
    wait_request(&req_[1], dl_, "MPI ring allreduce (send)");
  }

 private:
  MPI_Comm comm_;
  int rank_, size_;
  bool worker_;
  Deadline dl_;
  MPI_Request req_[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
};

// The stall inspector's exchange (see Prober): a communicator of its own; a thread that answers
// queries, polling MPI_Iprobe every 2 ms (no blocking MPI wait can be stopped); and asks that post
// nonblocking sends and receives and wait at most wait_ms, so that a dead rank is simply "no
// answer". Messages that may never complete are left posted, their buffers kept until exit.
class MpiProber final : public Prober {
 public:
  MpiProber(MPI_Comm c, std::function<Position()> mine) : comm_(c), mine_(std::move(mine)) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    if (size_ < 2) return;
    Responders& r = responders();
    std::lock_guard<std::mutex> lock(r.mu);
    responder_ = std::thread([this] { serve(); });
    r.stops.push_back(&stop_and_join_);
  }
  ~MpiProber() override {
    {
      Responders& r = responders();
      std::lock_guard<std::mutex> lock(r.mu);
      r.stops.erase(std::remove(r.stops.begin(), r.stops.end(), &stop_and_join_), r.stops.end());
      stop_and_join_();
    }
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && !left_posted_) MPI_Comm_free(&comm_);
  }

  std::vector<Position> ask(int64_t wait_ms) override {
    std::vector<Position> out(static_cast<size_t>(size_));
    out[static_cast<size_t>(rank_)] = mine_();
    if (size_ == 1) return out;
    const uint64_t seq = ++seq_;
    auto query = std::make_shared<uint64_t>(seq);
    auto answers = std::make_shared<std::vector<Answer>>(static_cast<size_t>(size_));
    std::vector<MPI_Request> sends(static_cast<size_t>(size_), MPI_REQUEST_NULL);
    std::vector<MPI_Request> recvs(static_cast<size_t>(size_), MPI_REQUEST_NULL);
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      MPI_Irecv(&(*answers)[static_cast<size_t>(r)], sizeof(Answer), MPI_BYTE, r, kAnswer, comm_,
                &recvs[static_cast<size_t>(r)]);
      MPI_Isend(query.get(), 1, MPI_UINT64_T, r, kQuery, comm_, &sends[static_cast<size_t>(r)]);
    }
    const Deadline dl = Deadline::after_ms(std::max<int64_t>(1, wait_ms));
    for (int open = size_ - 1; open > 0 && !dl.passed();) {
      open = 0;
      for (int r = 0; r < size_; ++r) {
        MPI_Request& q = recvs[static_cast<size_t>(r)];
        if (q == MPI_REQUEST_NULL) continue;
        int done = 0;
        if (MPI_Test(&q, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
          q = MPI_REQUEST_NULL;  // an error: no answer from this rank
          continue;
        }
        Answer& a = (*answers)[static_cast<size_t>(r)];
        if (done && a.seq == seq) {
          out[static_cast<size_t>(r)] = a.pos;
        } else if (done) {  // a late answer to an earlier ask: wait for this one's
          MPI_Irecv(&a, sizeof(Answer), MPI_BYTE, r, kAnswer, comm_, &q);
          ++open;
        } else {
          ++open;
        }
      }
      if (open) std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
    bool posted = false;
    for (MPI_Request& q : recvs)
      if (q != MPI_REQUEST_NULL) {
        MPI_Cancel(&q);
        MPI_Request_free(&q);
        posted = true;
      }
    for (MPI_Request& q : sends) {
      int done = 0;
      if (q != MPI_REQUEST_NULL && (MPI_Test(&q, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || !done)) {
        MPI_Request_free(&q);
        posted = true;
      }
    }
    if (posted) {
      left_posted_ = true;
      host::keep_until_exit(query);
      host::keep_until_exit(answers);
    }
    return out;
  }

 private:
  struct Answer {
    uint64_t seq;
    Position pos;
  };
  static constexpr int kQuery = 1, kAnswer = 2;

  void serve() {
    name_this_thread("ddp-inspector");
    while (!stop_) {
      int flag = 0;
      MPI_Status st;
      if (MPI_Iprobe(MPI_ANY_SOURCE, kQuery, comm_, &flag, &st) != MPI_SUCCESS) return;
      if (!flag) {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        continue;
      }
      uint64_t seq = 0;
      if (MPI_Recv(&seq, 1, MPI_UINT64_T, st.MPI_SOURCE, kQuery, comm_, MPI_STATUS_IGNORE) != MPI_SUCCESS) return;
      auto a = std::make_shared<Answer>(Answer{seq, mine_()});
      MPI_Request req;
      if (MPI_Isend(a.get(), sizeof(Answer), MPI_BYTE, st.MPI_SOURCE, kAnswer, comm_, &req) != MPI_SUCCESS) continue;
      int done = 0;
      for (int i = 0; i < 100 && !done && !stop_; ++i) {
        MPI_Test(&req, &done, MPI_STATUS_IGNORE);
        if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (!done) {  // the asker is gone: leave the answer posted
        MPI_Request_free(&req);
        left_posted_ = true;
        host::keep_until_exit(a);
      }
    }
  }

  MPI_Comm comm_;
  std::function<Position()> mine_;
  int rank_ = 0, size_ = 1;
  uint64_t seq_ = 0;
  std::atomic<bool> stop_{false}, left_posted_{false};
  std::thread responder_;
  // Called under responders().mu, by the destructor or by MPI_Finalize (on_finalize).
  std::function<void()> stop_and_join_ = [this] {
    stop_ = true;
    if (responder_.joinable()) responder_.join();
  };
};

class MpiComm final : public Comm {
 public:
  explicit MpiComm(MPI_Comm c) : comm_(c), ring_(std::make_shared<host::RingBuffer>()) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiComm() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && !aborted_) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Memory memory() const override { return Memory::Host; }

  std::unique_ptr<Comm> dup() override { return std::unique_ptr<Comm>(new MpiComm(dup_within(creation_deadline()))); }
  std::unique_ptr<Device> make_device() override { return std::unique_ptr<Device>(new HostDevice()); }
  std::unique_ptr<Prober> make_prober(std::function<Position()> mine) override {
    return std::unique_ptr<Prober>(new MpiProber(dup_within(creation_deadline()), std::move(mine)));
  }
  bool supports_wire(Dtype d) const override { return !is_16bit(d); }
  bool supports(RedOp op) const override { return op == RedOp::Sum || op == RedOp::SumScaled; }
  size_t buffer_bytes() const override { return ring_->bytes.load(); }
  size_t piece_elems(Dtype d, size_t bytes) const override {
    return std::max<size_t>(1, std::min(kMaxChunk, (bytes ? bytes : piece_bytes_) / dtype_size(d)));
  }

  void allreduce(const void* send, void* recv, size_t n, Dtype d, Reduction red, Stream&, Deadline dl) override {
    if (red.op != RedOp::Sum && red.op != RedOp::SumScaled) fail(DDP_ERR_INTERNAL, "MPI comm: only sums are fused");
    const double factor = red.op == RedOp::SumScaled ? red.factor : 1.0;
    const size_t es = dtype_size(d);
    if (size_ == 1) {
      host::convert(send, d, recv, d, n, factor);
      return;
    }
    // The whole call is one blocking call: a worker written off inside it parks when it returns.
    const size_t step = n * es >= kRingMinBytes ? host::kRingMaxBytes / es : kMaxChunk;
    run_ring(
        [&](host::RingBuffer& ring, MpiRingLink& link) {
          // A worker written off inside a blocking call below goes on here when it returns, after the
          // comm may be gone: past the first call, only the link, the ring and the caller's arguments.
          const int world = link.size();
          for (size_t done = 0; done < n;) {
            const size_t k = std::min(step, n - done);
            void* to = static_cast<char*>(recv) + done * es;
            const void* from = static_cast<const char*>(send) + done * es;
            if (k * es >= kRingMinBytes || (is_16bit(d) && k >= static_cast<size_t>(world))) {
              // MPI has no 16-bit arithmetic: a 16-bit wire (compression) always takes the ring.
              host::ring_allreduce(link, ring, from, to, k, d, factor);
            } else if (is_16bit(d)) {
              gathered_allreduce(ring, from, to, k, d, factor, link.worker(), dl);
              link.wire->allgather(k * es, world);
            } else {
              mpi_allreduce(send == recv ? MPI_IN_PLACE : from, to, k, d, link.worker(), dl);
              link.wire->allreduce(k * es, world);
              if (factor != 1.0) host::convert(to, d, to, d, k, factor);
            }
            done += k;
          }
        },
        dl);
  }

  // The 16-bit wires on f32 buckets: the ring whenever every rank has a chunk (MPI has no 16-bit
  // arithmetic), else every rank's cast elements gathered and summed in rank order.
  bool can_cast_ring() const override { return true; }
  void allreduce_as(const void* send, void* recv, size_t n, Dtype d, Dtype wire, Reduction red, Stream&,
                    Deadline dl) override {
    if (d != Dtype::F32 || !is_16bit(wire)) fail(DDP_ERR_INTERNAL, "MPI comm: a cast ring takes f32 to a 16-bit wire");
    if (red.op != RedOp::Sum && red.op != RedOp::SumScaled) fail(DDP_ERR_INTERNAL, "MPI comm: only sums are fused");
    const double factor = red.op == RedOp::SumScaled ? red.factor : 1.0;
    const float* from = static_cast<const float*>(send);
    float* to = static_cast<float*>(recv);
    if (size_ == 1) return host::round_through(from, to, n, wire, factor);
    run_ring(
        [&](host::RingBuffer& ring, MpiRingLink& link) {
          for (size_t done = 0; done < n;) {
            const size_t k = std::min(host::kRingMaxBytes / dtype_size(wire), n - done);
            if (k >= static_cast<size_t>(link.size()))
              host::ring_allreduce_cast(link, ring, from + done, to + done, k, wire, factor);
            else
              host::gathered_allreduce_cast(link, ring, from + done, to + done, k, wire, factor);
            done += k;
          }
        },
        dl);
  }

  // Always the ring (libddp's own, as for large allreduces), on the bucket worker.
  void reduce_scatter(void* buf, size_t m, Dtype d, Reduction red, Stream&, Deadline dl) override {
    if (red.op != RedOp::Sum && red.op != RedOp::SumScaled) fail(DDP_ERR_INTERNAL, "MPI comm: only sums are fused");
    const double factor = red.op == RedOp::SumScaled ? red.factor : 1.0;
    char* p = static_cast<char*>(buf);
    if (size_ == 1) {
      host::convert(p, d, p, d, m, factor);
      return;
    }
    run_ring([&](host::RingBuffer& ring,
                 MpiRingLink& link) { host::ring_reduce_scatter(link, ring, p, m, d, factor, piece_bytes_); },
             dl);
  }

  void allgather(void* buf, size_t bytes, Stream&, Deadline dl) override {
    if (size_ == 1) return;
    run_ring([&](host::RingBuffer&, MpiRingLink& link) { host::ring_allgather(link, static_cast<char*>(buf), bytes); },
             dl);
  }

  void allgather_rounds(AllgatherRounds& rounds, Stream& s, Deadline dl) override {
    if (size_ == 1) return Comm::allgather_rounds(rounds, s, dl);
    run_ring([&](host::RingBuffer&, MpiRingLink& link) { host::ring_allgather_rounds(link, rounds); }, dl);
  }

  bool has_alltoall() const override { return true; }
  void alltoall(const void* send, void* recv, size_t bytes, Stream&, Deadline dl) override {
    run_ring(
        [&](host::RingBuffer&, MpiRingLink& link) {
          host::pairwise_alltoall(link, static_cast<const char*>(send), static_cast<char*>(recv), bytes);
        },
        dl);
  }

  // ddp_broadcast: the caller's buffers, in place.
  void broadcast(void* buf, size_t bytes, int root, void*, Deadline dl) override {
    if (root < 0 || root >= size_)
      fail(DDP_ERR_INVALID_ARGUMENT, "broadcast root %d out of range 0..%d", root, size_ - 1);
    bcast_pieces(static_cast<char*>(buf), bytes, root, dl);
  }

  // The control path (agreement, plan, unused-grad report) runs on buffers this comm owns, not on
  // the callers' locals: a collective that timed out stays posted and writes into its buffer
  // whenever the late rank arrives, so after a timeout those buffers are kept, never freed.
  void allgather_host(const void* in, void* out, size_t bytes, Deadline dl) override {
    if (bytes > kMaxChunk) fail(DDP_ERR_INTERNAL, "allgather of %zu bytes per rank", bytes);
    send_.assign(static_cast<const char*>(in), static_cast<const char*>(in) + bytes);
    recv_.resize(bytes * static_cast<size_t>(size_));
    MPI_Request req;
    DDP_MPI_CHECK(MPI_Iallgather(send_.data(), static_cast<int>(bytes), MPI_BYTE, recv_.data(), static_cast<int>(bytes),
                                 MPI_BYTE, comm_, &req));
    control_wait(&req, dl, "MPI allgather");
    wire_bytes()->allgather(bytes, size_);
    if (bytes) std::memcpy(out, recv_.data(), recv_.size());
  }

  void broadcast_host(void* buf, size_t bytes, int root, Deadline dl) override {
    if (root < 0 || root >= size_)
      fail(DDP_ERR_INVALID_ARGUMENT, "broadcast root %d out of range 0..%d", root, size_ - 1);
    send_.assign(static_cast<const char*>(buf), static_cast<const char*>(buf) + bytes);
    try {
      bcast_pieces(send_.data(), bytes, root, dl);
    } catch (const Error& e) {
      if (e.status() == DDP_ERR_TIMEOUT) keep_control_buffers();
      throw;
    }
    if (bytes) std::memcpy(buf, send_.data(), bytes);
  }

  // An MPI collective cannot be cancelled; the communicator is simply never used (or freed) again,
  // and the ring's buffer is kept for a message still on its way.
  void abort() override {
    aborted_ = true;
    host::keep_until_exit(ring_);
  }

 private:
  MPI_Comm dup_within(Deadline dl) {
    try {
      return idup_within(comm_, dl, "create its context");
    } catch (const Error& e) {
      if (e.status() == DDP_ERR_TIMEOUT) aborted_ = true;  // out of step with its peers: never freed
      throw;
    }
  }

  // One blocking call over the ring: a worker written off inside it parks when it returns, and a
  // message left posted may still land in the ring's buffer, which is then kept.
  template <class F>
  void run_ring(F&& f, Deadline dl) {
    std::shared_ptr<host::RingBuffer> ring = ring_;
    host::BlockingCall call;
    MpiRingLink link(comm_, rank_, size_, call.on_worker(), dl);
    link.wire = wire_bytes();
    try {
      f(*ring, link);
    } catch (const Error& e) {
      if (e.status() == DDP_ERR_TIMEOUT) host::keep_until_exit(ring);
      throw;
    }
  }

  // Fewer elements than ranks, of a type MPI cannot sum: every rank's elements to every rank, then a
  // sum in rank order (the same bits everywhere).
  void gathered_allreduce(host::RingBuffer& ring, const void* from, void* to, size_t k, Dtype d, double factor,
                          bool worker, Deadline dl) {
    const size_t bytes = k * dtype_size(d);
    const int world = size_;  // read before the blocking call (see allreduce)
    char* all = ring.ensure(bytes * static_cast<size_t>(world));
    const int n = static_cast<int>(bytes);
    if (worker) {
      DDP_MPI_CHECK(MPI_Allgather(from, n, MPI_BYTE, all, n, MPI_BYTE, comm_));
    } else {
      MPI_Request req;
      DDP_MPI_CHECK(MPI_Iallgather(from, n, MPI_BYTE, all, n, MPI_BYTE, comm_, &req));
      wait_request(&req, dl, "MPI allgather");
    }
    host::convert(all, d, to, d, k, 1.0);
    for (int r = 1; r < world; ++r)
      host::sum_scaled(to, all + static_cast<size_t>(r) * bytes, to, k, d, r == world - 1 ? factor : 1.0);
  }

  void mpi_allreduce(const void* from, void* to, size_t k, Dtype d, bool worker, Deadline dl) {
    if (worker) {
      DDP_MPI_CHECK(MPI_Allreduce(from, to, static_cast<int>(k), mpi_type(d), MPI_SUM, comm_));
      return;
    }
    MPI_Request req;
    DDP_MPI_CHECK(MPI_Iallreduce(from, to, static_cast<int>(k), mpi_type(d), MPI_SUM, comm_, &req));
    wait_request(&req, dl, "MPI allreduce");
  }

  void bcast_pieces(char* p, size_t bytes, int root, Deadline dl) {
    for (size_t done = 0; done < bytes;) {
      size_t k = std::min(kMaxChunk, bytes - done);
      MPI_Request req;
      DDP_MPI_CHECK(MPI_Ibcast(p + done, static_cast<int>(k), MPI_BYTE, root, comm_, &req));
      wait_request(&req, dl, "MPI broadcast");
      wire_bytes()->broadcast(k, size_, rank_, root);
      done += k;
    }
  }
  void control_wait(MPI_Request* req, Deadline dl, const char* what) {
    try {
      wait_request(req, dl, what);
    } catch (const Error& e) {
      if (e.status() == DDP_ERR_TIMEOUT) keep_control_buffers();
      throw;
    }
  }
  void keep_control_buffers() {
    host::keep_until_exit(std::make_shared<std::vector<char>>(std::move(send_)));
    host::keep_until_exit(std::make_shared<std::vector<char>>(std::move(recv_)));
    send_ = std::vector<char>();
    recv_ = std::vector<char>();
  }

  MPI_Comm comm_;
  std::shared_ptr<host::RingBuffer> ring_;
  size_t piece_bytes_ = host::piece_bytes();
  int rank_ = 0, size_ = 1;
  bool aborted_ = false;
  std::vector<char> send_, recv_;  // control-path buffers (see allgather_host)
};

}  // namespace

std::unique_ptr<Comm> make_mpi_comm(const void* mpi_comm) {
  ensure_mpi();
  MPI_Comm base = mpi_comm ? *static_cast<const MPI_Comm*>(mpi_comm) : MPI_COMM_WORLD;
  if (base == MPI_COMM_NULL) fail(DDP_ERR_INVALID_ARGUMENT, "the MPI communicator is MPI_COMM_NULL");
  return std::unique_ptr<Comm>(
      new MpiComm(idup_within(base, Deadline::after_ms(knobs::init_timeout_ms()), "call ddp_comm_init_mpi")));
}

}  // namespace ddp
