// The backend interfaces: what the reducer asks of a device (memory, streams, element work) and of a
// communicator (collectives). The planner and reducer see only these; the backends decide no policy.
//
//   Host memory:   HostDevice (thread-backed streams)  +  MpiComm / LocalComm
//   Device memory: CudaDevice (CUDA streams, kernels)  +  NcclComm
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/common.hpp"
#include "core/join_protocol.hpp"
#include "core/inspector.hpp"

namespace ddp {

enum class Memory { Host, Device };

// Work run on a stream in submission order. Host streams run it on their worker thread; CUDA streams
// run it at once on the submitting thread, where it only enqueues GPU work. Preallocated, one per
// bucket: submitting allocates nothing.
class Task {
 public:
  virtual ~Task() = default;
  virtual void run() = 0;
};

// Something that enqueues work on a stream and can fail asynchronously (an NCCL communicator).
class AsyncErrorSource {
 public:
  virtual ~AsyncErrorSource() = default;
  // Throws if the source has failed asynchronously (ncclCommGetAsyncError).
  virtual void check_async() = 0;
  // Work of this source on a stream did not complete by its deadline: it is stuck.
  virtual void mark_stalled() = 0;
  // Who this source is, for messages ("rank 2 of 4"); empty if nothing useful.
  virtual std::string who() const { return std::string(); }
};

// An ordered queue of work, one per bucket stream.
class Stream {
 public:
  virtual ~Stream() = default;
  // Makes room for `n` tasks in flight so that submit never allocates.
  virtual void reserve(size_t n) = 0;
  // Runs `task` after everything submitted before it. May throw (CUDA: an enqueue failed).
  virtual void submit(Task* task) = 0;
  // Host waits until every submitted task has finished; rethrows the first error a task raised (and
  // clears it). Throws DDP_ERR_TIMEOUT at the deadline, or when a task has been blocked in a
  // collective for longer than the task timeout (the stream then writes that task off).
  virtual void drain(Deadline deadline) = 0;
  // Tasks submitted so far: a mark for drain_to (host streams; 0 elsewhere).
  virtual uint64_t submitted() { return 0; }
  // Host waits until the tasks submitted before `mark` have finished (later ones may still run), with
  // drain's errors and bounds. Streams that run their tasks inline drain.
  virtual void drain_to(uint64_t mark, Deadline deadline) { drain(deadline); }
  // Whether submit runs a task at once on the submitting thread, where it only enqueues device work
  // (CUDA); otherwise a worker runs it to completion, so that timing run() times the work (host).
  virtual bool runs_inline() const = 0;
  // How long (ms, 0: forever) one task may stay blocked in a collective before drain gives up on it.
  virtual void set_task_timeout(int64_t ms) {}
  // The stall warning: drain calls `warn` (without holding the stream's locks) once for each task
  // (host) or each drain (GPU) still waiting after `ms` (0: never), and goes on waiting.
  virtual void set_stall_warning(int64_t ms, std::function<void()> warn) {}
  // The peer watch (elastic contexts): while a task is blocked in a collective, drain calls `check`
  // (without holding the stream's locks) every `ms` milliseconds (0: never), and goes on waiting.
  virtual void set_peer_watch(int64_t ms, std::function<void()> check) {}
  // cudaStream_t for CUDA streams, nullptr for host streams.
  virtual void* native() = 0;
  // `src` just enqueued work on this stream that must complete by `dl`: the stream polls it for
  // asynchronous errors and names it when the work is late (GPU streams; host streams run their
  // collectives synchronously and need no watch).
  virtual void watch(AsyncErrorSource* src, Deadline dl) {}
  // Bucket `tag` has enqueued all its work on this stream. Returns false when that work has already
  // run (host streams: the caller counts it done now); true when the stream adds 1 to `*done` itself
  // once the work completes (GPU streams). `done` must outlive the stream.
  virtual bool finishes_later(int tag, std::atomic<int32_t>* done) { return false; }
  // The tag of the oldest bucket announced by finishes_later whose work has not completed, or -1.
  virtual int oldest_unfinished() { return -1; }
  // Makes `user_stream` wait for the work of bucket `tag` announced by finishes_later (GPU streams);
  // nothing when that work has completed already. Host streams: nothing.
  virtual void user_wait_tag(void* user_stream, int tag) {}
  // Rethrows (and clears) the first error a task raised, without waiting.
  virtual void poll_error() = 0;
  // Stops running queued tasks (after a fatal error): they are dropped as if finished.
  virtual void cancel() = 0;
  // Runs `f` (the caller's comm hook, on this stream's worker) as a call that may block for good:
  // a drain bounds it by the task timeout as it bounds a blocked collective, and writes the worker
  // off when it is late (host streams); elsewhere it just calls `f`.
  virtual void run_blocking(const std::function<void()>& f) { f(); }
};

// One grad's place in a bucket's flat buffer.
struct Segment {
  void* ptr;      // the grad's storage (copy layout) or view (arena)
  size_t offset;  // in elements, from the bucket's start
  size_t numel;
  uint32_t zero;  // pack writes zeros instead of reading ptr (an unused grad)
};

// A range of flat elements [lo, hi) of a bucket.
struct Span {
  size_t lo, hi;
};

// The segments of one bucket. `version` changes whenever a pointer or zero flag changes, so that a
// device that keeps its own copy of the table (GPU pointer tables) re-uploads only then.
struct SegmentTable {
  std::vector<Segment> segs;
  uint64_t version = 0;
  std::shared_ptr<void> device_state;  // owned by the device, lives as long as the table
};

class Device {
 public:
  virtual ~Device() = default;
  virtual Memory memory() const = 0;
  // Zeroed storage of `bytes`; throws DDP_ERR_OUT_OF_MEMORY. free accepts nullptr.
  virtual void* alloc(size_t bytes) = 0;
  virtual void free(void* p) = 0;
  // Gives back a buffer that collectives of this device's streams used: freed, unless work the device
  // had to abandon (a collective that cannot be cancelled) may still write it; then the device keeps
  // it allocated until the process exits. Accepts nullptr.
  virtual void release(void* p) { free(p); }
  // Synchronous copy between two buffers of this device's memory (used when the arena moves).
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  virtual std::unique_ptr<Stream> make_stream(int index) = 0;

  // Throws if the user's stream cannot carry an iteration (GPU: DDP_ERR_UNSUPPORTED while it is
  // being captured into a CUDA graph). Called by ddp_begin_backward before anything changes.
  virtual void check_user_stream(void* user_stream) {}
  // Ordering with the user's stream (no-ops on host, where grads are final when marked ready).
  virtual void stream_wait_user(Stream& s, void* user_stream) = 0;
  virtual void user_wait_stream(void* user_stream, Stream& s) = 0;

  // Element work, in stream order on `s` (host: done now by the calling thread), over the flat
  // elements `span` of the table (devices whose comms cut no pieces need only support all of them).
  // dst[seg.offset + i] = wire(src_seg[i] * scale), or 0 for zero segments.
  virtual void pack(SegmentTable& table, Dtype src, void* dst, Dtype wire, double scale, Span span, Stream& s) = 0;
  // dst_seg[i] = dtype(src[seg.offset + i] * scale), for every segment (zero ones included).
  virtual void unpack(const void* src, Dtype wire, SegmentTable& table, Dtype dst, double scale, Span span,
                      Stream& s) = 0;
  // buf[i] *= scale, in place.
  virtual void scale(void* buf, size_t n, Dtype d, double scale, Stream& s) = 0;
  virtual void fill_zero(void* buf, size_t n, Dtype d, Stream& s) = 0;
  // Finiteness flags, one per slot (a bucket), kept by the device. scan_nonfinite sets flag `slot` if
  // buf holds a NaN or Inf, in stream order on `s`, with no host wait; take_nonfinite returns and
  // clears it, and may synchronize `s` with the host (call it where the host waits anyway).
  virtual void reserve_flags(size_t slots) = 0;
  virtual void scan_nonfinite(const void* buf, size_t n, Dtype d, size_t slot, Stream& s) = 0;
  virtual bool take_nonfinite(size_t slot, Stream& s) = 0;
  // Adds to out[0] the sum of the squares of buf's finite elements (float64) and to out[1] the number
  // of its NaN and Inf, read after `s`'s work so far; the host waits for the answer (bounded by the
  // deadlines of the collectives queued on `s`).
  virtual void norm_terms(const void* buf, size_t n, Dtype d, Stream& s, double out[2]) = 0;
  // The int8 wire (DDP_COMPRESS_INT8), in stream order on `s`: int8_quantize sends `x`'s n elements
  // (F32 or F64) plus `residual` (n floats, this rank's error feedback, updated) as this rank's chunk
  // of elem::int8_chunk_bytes(n) bytes; int8_dequant_sum writes to `out` the sum over `world` such
  // chunks, chunk_bytes apart, in rank order. Host devices only (the context refuses the rest).
  virtual void int8_quantize(const void* x, Dtype d, size_t n, float* residual, void* chunk, Stream& s) {
    fail(DDP_ERR_UNSUPPORTED, "this device has no int8 wire");
  }
  virtual void int8_dequant_sum(const void* chunks, size_t chunk_bytes, int world, size_t n, Dtype d, void* out,
                                Stream& s) {
    fail(DDP_ERR_UNSUPPORTED, "this device has no int8 wire");
  }
  // The same for an all-gather round of the copy layout with no staging pass: int8_quantize_grads
  // quantizes the elements `span` of the table as pack would write them (scaled by `pre`, zeros for
  // zero segments) with `residual` (the span's errors) into `chunk`, laid out for the span's length;
  // int8_dequant_grads writes the sum of `world` such chunks into the span's grads as unpack would
  // (scaled by `post`). The bits are those of pack, int8_quantize, int8_dequant_sum and unpack.
  virtual void int8_quantize_grads(SegmentTable& table, Dtype d, double pre, Span span, float* residual, void* chunk,
                                   Stream& s) {
    fail(DDP_ERR_UNSUPPORTED, "this device has no int8 wire");
  }
  virtual void int8_dequant_grads(const void* chunks, size_t chunk_bytes, int world, Span span, SegmentTable& table,
                                  Dtype d, double post, Stream& s) {
    fail(DDP_ERR_UNSUPPORTED, "this device has no int8 wire");
  }
  // Completion marks, one per slot (a bucket's parameter gather): mark records where `s` stands now,
  // user_wait_mark makes the user's stream wait for it. GPU only: host streams finish their tasks on
  // workers, and the reducer waits for those itself.
  virtual void reserve_marks(size_t slots) {}
  virtual void mark(size_t slot, Stream& s) {}
  virtual void user_wait_mark(void* user_stream, size_t slot) {}
};

// The reductions a collective can fuse. PreMulSum multiplies every input by `factor` before summing
// (NCCL's ncclRedOpCreatePreMulSum); Avg divides the sum by the world size (ncclAvg); SumScaled
// multiplies the sum by `factor` (the host ring folds it into the pass that adds the last
// contribution, so the averaging costs no pass of its own).
enum class RedOp { Sum, Avg, PreMulSum, SumScaled };
struct Reduction {
  RedOp op = RedOp::Sum;
  double factor = 1.0;
};

// The bytes one rank sent and received on the wire (ddp_stats_t.bytes_sent, bytes_received), added by
// each communicator where the bytes move. Shared: a collective written off after a timeout may still
// count into it after its communicator is gone. Collectives whose algorithm the library does not run
// itself (MPI's below the ring, NCCL's) are counted by the ring formula of the same collective.
struct WireBytes {
  std::atomic<uint64_t> sent{0}, received{0};
  void add(uint64_t s, uint64_t r) {
    sent.fetch_add(s, std::memory_order_relaxed);
    received.fetch_add(r, std::memory_order_relaxed);
  }
  // A ring allreduce of `bytes`: 2 (w - 1) / w of them each way.
  void allreduce(uint64_t bytes, int w) { ring_steps(bytes, w, 2); }
  // A ring reduce-scatter of `bytes` in all (w chunks): (w - 1) / w of them each way.
  void reduce_scatter(uint64_t bytes, int w) { ring_steps(bytes, w, 1); }
  // An all-gather of `bytes` per rank: every other rank's chunk in, (w - 1) chunks out.
  void allgather(uint64_t bytes, int w) { add(bytes * uint64_t(w - 1), bytes * uint64_t(w - 1)); }
  // An all-to-all of `bytes` per block: (w - 1) blocks out, (w - 1) in.
  void alltoall(uint64_t bytes, int w) { allgather(bytes, w); }
  // A chain broadcast of `bytes` from `root`: every rank but the root receives them, every rank but
  // the last of the chain (root - 1) sends them on.
  void broadcast(uint64_t bytes, int w, int rank, int root) {
    if (w < 2) return;
    add(rank == (root + w - 1) % w ? 0 : bytes, rank == root ? 0 : bytes);
  }

 private:
  void ring_steps(uint64_t bytes, int w, int passes) {
    const uint64_t each = w < 2 ? 0 : bytes * uint64_t(passes) * uint64_t(w - 1) / uint64_t(w);
    add(each, each);
  }
};

// An all-gather in rounds (Comm::allgather_rounds): round k all-gathers in place the size() chunks
// of bytes(k) at buffer(k); fill(k) writes this rank's chunk before the round goes out and done(k)
// reads the round's chunks once they arrived. The buffers of two consecutive rounds must not overlap.
class AllgatherRounds {
 public:
  virtual ~AllgatherRounds() = default;
  virtual size_t count() = 0;
  virtual char* buffer(size_t k) = 0;
  virtual size_t bytes(size_t k) = 0;
  virtual void fill(size_t k) = 0;
  virtual void done(size_t k) = 0;
};

// Elastic joins: the job's join requests, as the ranks of a running job see them (Comm::join_desk).
// A joiner files its request in the first free slot (0, 1, 2 ...) and waits for the answer in the
// same slot. Safe from any thread at any time (it holds what it needs).
class JoinDesk {
 public:
  virtual ~JoinDesk() = default;
  // The request filed in `slot`, if one is (no wait).
  virtual bool request(int64_t slot, std::string* text) = 0;
  // Answers the joiner of `slot` (refused, or passed over: its heartbeat had stopped and it asks again).
  // The first answer stands.
  virtual void answer(int64_t slot, const JoinAnswer& answer) = 0;
  // The joiner's heartbeat while it waits (a counter it bumps every 100 ms), if it has one.
  virtual bool beat(int64_t slot, std::string* value) = 0;
  // Whether `slot` holds an answer already (a request of an earlier job over the same store, whose
  // joiner learned that job's end, is settled so).
  virtual bool answered(int64_t slot) = 0;
  // A context that admits joiners starts (rank 0): whatever an earlier one over this store did, its
  // job has not ended.
  virtual void open(Deadline dl) = 0;
  // Rank `rank` of the `world` ranks of the membership this desk came from (Comm::join_desk of its
  // communicator) leaves the job, its context destroyed. The last of them to leave marks the job
  // ended, so that a joiner still waiting is told at once instead of waiting out its bound. Within
  // `dl`; throws if the store fails.
  virtual void leave(int rank, int world, Deadline dl) = 0;
  // Blocks until a request is filed in `slot`, `dl` passes or stop_waiting() is called, and returns
  // true; false at once from a desk that cannot block (its watch then looks every 100 ms).
  virtual bool wait_request(int64_t slot, Deadline dl) { return false; }
  // Ends the wait_request under way, and every later one, at once (the watch stops). Any thread.
  virtual void stop_waiting() {}
};

class Comm;
// What Comm::regroup agreed on: the new communicator and, for each of its ranks, its number in the old
// one and the iterations it had committed.
struct Regrouped {
  std::unique_ptr<Comm> comm;
  std::vector<int> members;
  std::vector<int64_t> committed;
};

// What Comm::join brings back: the job's answer and, when admitted, the communicator over the new
// membership; `job` says where the job meets (for messages).
struct JoinOutcome {
  JoinAnswer answer;
  std::unique_ptr<Comm> comm;
  std::string job;
};

class Comm {
 public:
  virtual ~Comm() = default;
  // What this communicator moved on the wire so far (read from any thread).
  const std::shared_ptr<WireBytes>& wire_bytes() const { return wire_bytes_; }

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Memory memory() const = 0;
  // A new communicator over the same ranks with its own channel. Collective.
  virtual std::unique_ptr<Comm> dup() = 0;
  // The device that owns this communicator's memory kind.
  virtual std::unique_ptr<Device> make_device() = 0;

  // Whether the comm itself fails every rank, with DDP_ERR_MISMATCH, when the ranks pass different
  // sizes or types to one collective (the local group compares them); otherwise callers that cannot
  // vouch for their ranks' arguments (ddp_comm_allreduce) compare them first.
  virtual bool checks_shapes() const { return false; }
  // Whether `d` can be summed natively on the wire, and whether `op` can be fused.
  virtual bool supports_wire(Dtype d) const = 0;
  virtual bool supports(RedOp op) const = 0;

  // Allreduce of `n` elements from `send` into `recv` in the comm's memory kind, in stream order on
  // `s`. `send == recv` reduces in place; otherwise the two do not overlap and `send` is only read
  // (a copy-layout piece that lies in one grad goes straight from the grad, with no pack).
  virtual void allreduce(const void* send, void* recv, size_t n, Dtype d, Reduction red, Stream& s, Deadline dl) = 0;
  // Whether allreduce_as is implemented (host comms: the 16-bit wires cast inside the ring).
  virtual bool can_cast_ring() const { return false; }
  // Allreduce of `n` f32 elements (`d` is F32) whose bytes travel as the 16-bit `wire`: partial sums
  // stay f32, every rank's contribution is rounded to the wire where it is sent, and the result is
  // rounded to the wire once (then widened): the same values on every rank. As allreduce otherwise.
  virtual void allreduce_as(const void* send, void* recv, size_t n, Dtype d, Dtype wire, Reduction red, Stream& s,
                            Deadline dl) {
    fail(DDP_ERR_UNSUPPORTED, "this communicator cannot cast inside its allreduce");
  }
  // Sharded reduction, in place, in stream order on `s`. `buf` holds size() chunks of `m` elements;
  // afterwards chunk rank() holds the reduction over ranks of every rank's chunk rank(), and the other
  // chunks hold unspecified values. The same bytes cross the wire as in allreduce's first half.
  virtual void reduce_scatter(void* buf, size_t m, Dtype d, Reduction red, Stream& s, Deadline dl) {
    fail(DDP_ERR_UNSUPPORTED, "this communicator has no reduce-scatter");
  }
  // All-gather in place: `buf` holds size() chunks of `bytes`; chunk rank() of every rank reaches
  // chunk rank() of every other rank's `buf`.
  virtual void allgather(void* buf, size_t bytes, Stream& s, Deadline dl) {
    fail(DDP_ERR_UNSUPPORTED, "this communicator has no all-gather");
  }
  // All-gathers `rounds` round after round; host rings overlap each round's transfer with the
  // previous round's done() and the next one's fill(). By default one round after another, whole.
  virtual void allgather_rounds(AllgatherRounds& rounds, Stream& s, Deadline dl) {
    for (size_t k = 0; k < rounds.count(); ++k) {
      rounds.fill(k);
      allgather(rounds.buffer(k), rounds.bytes(k), s, dl);
      rounds.done(k);
    }
  }
  // Whether alltoall is implemented (the int8 wire's reduce-scatter needs it).
  virtual bool has_alltoall() const { return false; }
  // All-to-all: `send` and `recv` (not overlapping) hold size() blocks of `bytes`; block j of `send`
  // reaches rank j, and block i of `recv` comes from rank i (block rank() is copied).
  virtual void alltoall(const void* send, void* recv, size_t bytes, Stream& s, Deadline dl) {
    fail(DDP_ERR_UNSUPPORTED, "this communicator has no all-to-all");
  }
  // In-place broadcast of `bytes` from `root` in the comm's memory kind, in stream order on the
  // user's `user_stream` (a cudaStream_t for NCCL; host comms run it synchronously).
  virtual void broadcast(void* buf, size_t bytes, int root, void* user_stream, Deadline dl) = 0;
  // Whether several collectives can be issued as one group (ncclGroupStart/End).
  virtual bool can_group() const { return false; }
  // The largest allreduce worth issuing at once, in elements of `d` (0: no limit). The reducer cuts
  // a bucket into pieces of this size and scales each piece while it is still in cache. `bytes` is
  // the caller's wish (ddp_config_t.host_piece_bytes, 0: the comm's own choice); comms that cut
  // pieces honour it within their own limits, the others keep returning 0.
  virtual size_t piece_elems(Dtype d, size_t bytes) const { return 0; }
  // Brackets several collectives issued together (ncclGroupStart/End); no-ops elsewhere.
  virtual void group_start() {}
  virtual void group_end() {}

  // The control path: small synchronous collectives on host memory (agreement, plan broadcast).
  virtual void allgather_host(const void* in, void* out, size_t bytes_per_rank, Deadline dl) = 0;
  virtual void broadcast_host(void* buf, size_t bytes, int root, Deadline dl) = 0;

  // A prober over the same ranks (collective), or nullptr where positions cannot be exchanged
  // without risking a hang (then a timeout names only this rank's own position).
  virtual std::unique_ptr<Prober> make_prober(std::function<Position()> mine) { return nullptr; }

  // Memory the communicator holds for its collectives (the host ring's receive buffer), counted in
  // ddp_stats_t.library_bytes. Read from any thread.
  virtual size_t buffer_bytes() const { return 0; }

  // Gives up on every outstanding collective after a fatal error (ncclCommAbort). After it, the
  // communicator is unusable.
  virtual void abort() {}

  // Elastic contexts. Whether regroup is implemented (communicators that can be rebuilt over fewer
  // ranks: Gloo).
  virtual bool can_regroup() const { return false; }
  // Closes this rank's connections at once, so that every peer blocked on this rank fails now rather
  // than at its timeout (a rank that lost a peer severs, and the loss spreads through the world in
  // one hop). After it, the communicator is unusable.
  virtual void sever() { abort(); }
  // This rank gives up on the membership this communicator was made for, while it is still being
  // formed (the recovery or admission failed here): sever, and tell the other members, whose waits
  // on this rank in its formation then end too (Gloo: their waits in the store). Default: nothing
  // (only Gloo forms elastic memberships).
  virtual void give_up() {}
  // Before the buffers of a failed context go away: stops the transport from touching memory that an
  // exchange posted before a failure still refers to (Gloo closes the connections of a communicator
  // whose exchange failed: a send posted there goes out on Gloo's own thread when the peer's receive
  // arrives, even after the collective failed here). Default: nothing is left posted.
  virtual void drop_posted() {}
  // What sever does to the connections, as a call that any thread may make at any time, even after
  // the communicator is gone (it holds what it needs): a bucket's worker severs this way the moment
  // its collective fails, without waiting for the caller's thread to see the error.
  virtual std::function<void()> severer() {
    return [] {};
  }
  // Agrees on the ranks of membership `epoch` (a name every survivor gives alike) and makes a communicator over them.
  // This rank checks in with `committed` (its committed iterations); the wait ends when every rank of this communicator
  // has checked in or is gone (no answer to `answering`, which says which ranks' processes still answer, twice in a
  // row), or at `window` (the late are left out). Every rank that checked in adopts the one membership set first (so
  // all agree); one left out of it gets DDP_ERR_RANK_LOST. Throws DDP_ERR_TIMEOUT at `dl`.
  virtual Regrouped regroup(const std::string& epoch, int64_t committed,
                            const std::function<std::vector<Liveness>()>& answering, Deadline window, Deadline dl) {
    fail(DDP_ERR_UNSUPPORTED, "this communicator cannot be rebuilt over fewer ranks");
  }
  // Joins. The job's join requests for contexts over this communicator's lineage (its duplicates and
  // regrouped successors share it), or nullptr where ranks cannot join.
  virtual std::shared_ptr<JoinDesk> join_desk() { return nullptr; }
  // A communicator over this one's ranks (same numbers) followed by the joiners of `slots` (numbered
  // size(), size() + 1 ... in that order), agreed under `name` (alike on every rank). Rank 0 answers
  // each of them with where to meet and `note`; the joiners meet it in Comm::join. Collective over
  // this communicator's ranks; throws DDP_ERR_TIMEOUT at `dl` (a joiner that never came).
  virtual std::unique_ptr<Comm> admit(const std::string& name, const std::vector<int64_t>& slots,
                                      const std::string& note, Deadline dl) {
    fail(DDP_ERR_UNSUPPORTED, "ranks cannot join this communicator");
  }
  // Whether this is a joiner's communicator (ddp_comm_join_gloo): no rank until admitted, nothing but
  // join() may be called.
  virtual bool joining() const { return false; }
  // A joiner's communicator: files a request with `terms` (bounded by this communicator's own bound,
  // which the request carries) with the running job and waits for its answer until `dl`; asks again
  // when passed over. Returns the answer: admitted (with the communicator over the new membership),
  // refused, or the job's end. DDP_ERR_TIMEOUT when no answer came in time.
  virtual JoinOutcome join(const JoinTerms& terms, Deadline dl) {
    fail(DDP_ERR_INVALID_STATE, "this communicator is not a joiner's");
  }

 private:
  std::shared_ptr<WireBytes> wire_bytes_ = std::make_shared<WireBytes>();
};

}  // namespace ddp
