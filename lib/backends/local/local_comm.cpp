#include "core/comms.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/elementwise.h"
#include "host/host_device.hpp"
#include "host/host_kernels.hpp"
#include "host/membership.hpp"
#include "host/store.hpp"

namespace ddp {

// memcpy of n bytes where either pointer may be null when n is 0 (a rank with no elements passes
// none), which memcpy itself does not allow.
static void copy_bytes(void* dst, const void* src, size_t n) {
  if (n) std::memcpy(dst, src, n);
}

namespace {

// What a rank calls on a channel: the collective, its element type (or root) and its size. Ranks
// whose shapes differ would read past each other's buffers: they fail instead, all of them.
enum class Op : int32_t { Allreduce, AllreduceAs, ReduceScatter, Allgather, Alltoall, AllgatherHost, Broadcast };
struct Shape {
  Op op = Op::Allreduce;
  int32_t arg = 0;     // the dtype (Dtype) of the reductions, the root of a broadcast
  uint64_t count = 0;  // elements of the reductions, bytes of the others
  bool operator==(const Shape& o) const { return op == o.op && arg == o.arg && count == o.count; }
};

std::string describe(const Shape& s) {
  const unsigned long long n = s.count;
  switch (s.op) {
    case Op::Allreduce: return format("an allreduce of %llu elements of %s", n, dtype_name(static_cast<Dtype>(s.arg)));
    case Op::AllreduceAs:
      return format("an allreduce of %llu f32 elements over a %s wire", n, dtype_name(static_cast<Dtype>(s.arg)));
    case Op::ReduceScatter:
      return format("a reduce-scatter of %llu elements of %s a rank", n, dtype_name(static_cast<Dtype>(s.arg)));
    case Op::Allgather: return format("an allgather of %llu bytes a rank", n);
    case Op::Alltoall: return format("an all-to-all of %llu bytes a rank", n);
    case Op::AllgatherHost: return format("a control allgather of %llu bytes a rank", n);
    case Op::Broadcast: return format("a broadcast of %llu bytes from rank %d", n, s.arg);
  }
  return "an unknown collective";
}

// One channel: a reusable barrier plus the buffers each rank posts for the collective in progress.
// Every collective is: post, barrier, read the others, barrier. Ranks sum in rank order, so every
// rank gets bitwise the same result. A rank posts a copy in storage the channel owns, never its own
// buffer: after an abort or a timeout a rank leaves while its peers may still be reading, and frees
// its buffers; the copies live as long as any rank's communicator on the channel.
struct Channel {
  explicit Channel(int n)
      : posted(static_cast<size_t>(n), nullptr), data(static_cast<size_t>(n)), shapes(static_cast<size_t>(n)) {}
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  bool aborted = false;
  int aborted_by = -1;        // the rank that gave up first (its peers' errors name it)
  const char* why = nullptr;  // ... and why
  std::vector<const void*> posted;
  std::vector<std::vector<char>> data;  // per rank: what it posted (grown once, then reused)
  std::vector<Shape> shapes;            // per rank: what it called (compared before anything is read)
};

// The stall inspector's board for one communicator: each rank's position source, while it lives.
// Ranks are threads of one process, so asking is reading the board: nothing can hang.
struct Board {
  explicit Board(int n) : mine(static_cast<size_t>(n)) {}
  std::mutex mu;
  std::vector<std::function<Position()>> mine;  // empty: that rank's context is gone (or not made)
};

class LocalProber final : public Prober {
 public:
  LocalProber(std::shared_ptr<Board> b, int rank, std::function<Position()> mine) : board_(std::move(b)), rank_(rank) {
    std::lock_guard<std::mutex> lock(board_->mu);
    board_->mine[static_cast<size_t>(rank_)] = std::move(mine);
  }
  ~LocalProber() override {
    std::lock_guard<std::mutex> lock(board_->mu);
    board_->mine[static_cast<size_t>(rank_)] = nullptr;
  }
  std::vector<Position> ask(int64_t) override {
    std::lock_guard<std::mutex> lock(board_->mu);
    std::vector<Position> out(board_->mine.size());
    for (size_t r = 0; r < out.size(); ++r) {
      if (board_->mine[r])
        out[r] = board_->mine[r]();
      else
        out[r].iteration = -2;  // that rank's context is gone
    }
    return out;
  }

 private:
  std::shared_ptr<Board> board_;
  int rank_;
};

// The group's store, in memory: what the ranks of an elastic recovery agree through.
class MemoryStore final : public Store {
 public:
  void set(const std::string& key, const std::vector<char>& value, Deadline) override {
    std::lock_guard<std::mutex> lock(mu_);
    kv_[key] = value;
    cv_.notify_all();
  }
  std::vector<char> get(const std::string& key, Deadline dl, const std::string& who) override {
    std::unique_lock<std::mutex> lock(mu_);
    auto there = [&] { return kv_.count(key) > 0; };
    if (dl.infinite())
      cv_.wait(lock, there);
    else if (!cv_.wait_until(lock, dl.at(), there))
      fail(DDP_ERR_TIMEOUT, "local group: %s never arrived (key '%s')", who.c_str(), key.c_str());
    return kv_[key];
  }
  bool claim(const std::string& key, const std::vector<char>& value, std::vector<char>* held, Deadline) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = kv_.find(key);
    if (it != kv_.end()) {
      *held = it->second;
      return false;
    }
    kv_[key] = value;
    cv_.notify_all();
    return true;
  }
  bool try_get(const std::string& key, std::vector<char>* out, Deadline) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = kv_.find(key);
    if (it == kv_.end()) return false;
    *out = it->second;
    return true;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::vector<char>> kv_;
};

}  // namespace

class LocalGroup {
 public:
  explicit LocalGroup(int n) : n_(n), made_(static_cast<size_t>(n), 0) {}
  int size() const { return n_; }
  // The channel named `key`. A communicator's key says how it was made ("3" for a rank's third
  // ddp_comm_init_local, "3/1" for the first dup of that one), so the communicators that match across
  // ranks are those made by the same sequence of calls on each of them, whatever else a rank makes.
  // The group holds its channels and boards weakly: they live while a rank's communicator holds them,
  // so that contexts made and destroyed over one long-lived communicator leave nothing behind.
  std::shared_ptr<Channel> channel(const std::string& key) { return held(channels_, &channels_swept_, key); }
  std::shared_ptr<Board> board(const std::string& key) { return held(boards_, &boards_swept_, key); }
  // The key of rank `rank`'s next communicator made straight from the group.
  std::string next_root_key(int rank) {
    std::lock_guard<std::mutex> lock(mu_);
    return std::to_string(++made_[static_cast<size_t>(rank)]);
  }
  Store& store() { return store_; }
  // The group of `n` ranks that membership `name` agreed on: made by the first survivor that asks.
  std::shared_ptr<LocalGroup> successor(const std::string& name, int n) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& g = successors_[name];
    if (!g) g = std::make_shared<LocalGroup>(n);
    return g;
  }

 private:
  int n_;
  std::mutex mu_;
  MemoryStore store_;
  std::map<std::string, std::shared_ptr<LocalGroup>> successors_;
  std::map<std::string, std::weak_ptr<Channel>> channels_;
  std::map<std::string, std::weak_ptr<Board>> boards_;

  // The live object named `key` in `objects`, made if none lives; entries whose objects died are
  // dropped on the way (a sweep every time the map doubles keeps it as large as what lives).
  template <class T>
  std::shared_ptr<T> held(std::map<std::string, std::weak_ptr<T>>& objects, size_t* swept, const std::string& key) {
    std::lock_guard<std::mutex> lock(mu_);
    std::shared_ptr<T> o = objects[key].lock();
    if (!o) {
      o = std::make_shared<T>(n_);
      objects[key] = o;
    }
    if (objects.size() >= 2 * *swept) {
      for (auto it = objects.begin(); it != objects.end();)
        it = it->second.expired() ? objects.erase(it) : std::next(it);
      *swept = std::max<size_t>(16, objects.size());
    }
    return o;
  }
  size_t channels_swept_ = 16, boards_swept_ = 16;
  std::vector<uint64_t> made_;
};

std::shared_ptr<LocalGroup> make_local_group(int nranks) { return std::make_shared<LocalGroup>(nranks); }
int local_group_size(const LocalGroup& g) { return g.size(); }

namespace {

class LocalComm final : public Comm {
 public:
  LocalComm(std::shared_ptr<LocalGroup> group, int rank, std::string key)
      : group_(std::move(group)), rank_(rank), key_(std::move(key)), channel_(group_->channel(key_)) {}

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  Memory memory() const override { return Memory::Host; }
  std::unique_ptr<Comm> dup() override {
    return std::unique_ptr<Comm>(new LocalComm(group_, rank_, key_ + "/" + std::to_string(++dups_)));
  }
  std::unique_ptr<Device> make_device() override { return std::unique_ptr<Device>(new HostDevice()); }
  std::unique_ptr<Prober> make_prober(std::function<Position()> mine) override {
    return std::unique_ptr<Prober>(
        new LocalProber(group_->board(key_ + "/probe" + std::to_string(++probers_)), rank_, std::move(mine)));
  }
  bool checks_shapes() const override { return true; }
  bool supports_wire(Dtype d) const override { return !is_16bit(d); }
  // A scaled sum (the averages, DDP_OP_AVG of ddp_comm_allreduce) sums, then scales, as MPI does.
  bool supports(RedOp op) const override { return op == RedOp::Sum || op == RedOp::SumScaled; }
  // Pieces as on MPI, so that in-process tests run the same pipeline.
  size_t piece_elems(Dtype d, size_t bytes) const override {
    return std::max<size_t>(1, (bytes ? bytes : piece_bytes_) / dtype_size(d));
  }

  void allreduce(const void* send, void* recv, size_t n, Dtype d, Reduction red, Stream&, Deadline dl) override {
    const double factor = factor_of(red);
    const size_t bytes = n * dtype_size(d);
    // post() copies `send` into the channel, so the sum can go straight into recv, in place or not.
    post(send, bytes, Shape{Op::Allreduce, static_cast<int32_t>(d), n}, dl);
    sum(recv, n, d, 0);
    if (factor != 1.0) host::convert(recv, d, recv, d, n, factor);
    barrier(dl);  // everyone has read every buffer
    // Counted as the ring would move them.
    wire_bytes()->allreduce(bytes, size());
  }

  // The 16-bit wires on f32 buckets, as the host rings' gathered path computes them: every rank's
  // elements cast to the wire, summed widened in rank order, scaled and rounded to the wire once.
  bool can_cast_ring() const override { return true; }
  void allreduce_as(const void* send, void* recv, size_t n, Dtype d, Dtype wire, Reduction red, Stream&,
                    Deadline dl) override {
    if (d != Dtype::F32 || !is_16bit(wire))
      fail(DDP_ERR_INTERNAL, "local comm: a cast ring takes f32 to a 16-bit wire");
    const double factor = factor_of(red);
    const size_t ws = dtype_size(wire);
    float* to = static_cast<float*>(recv);
    if (cast_.size() < n * ws) cast_.resize(n * ws);
    char* mine = cast_.data();  // this rank's cast elements; once posted (a copy), the last add's bits
    host::convert(send, Dtype::F32, mine, wire, n, 1.0);
    post(mine, n * ws, Shape{Op::AllreduceAs, static_cast<int32_t>(wire), n}, dl);
    if (size() == 1)
      host::round_through(static_cast<const float*>(send), to, n, wire, factor);
    else
      host::convert(channel_->posted[0], wire, to, Dtype::F32, n, 1.0);
    for (int r = 1; r < size(); ++r)
      host::add_widened(to, channel_->posted[static_cast<size_t>(r)], wire, to, n, r == size() - 1 ? factor : 1.0,
                        r == size() - 1 ? mine : nullptr);
    barrier(dl);
    wire_bytes()->allreduce(n * ws, size());
  }

  void reduce_scatter(void* buf, size_t m, Dtype d, Reduction red, Stream&, Deadline dl) override {
    const double factor = factor_of(red);
    const size_t es = dtype_size(d), at = static_cast<size_t>(rank_) * m;
    post(buf, m * static_cast<size_t>(size()) * es, Shape{Op::ReduceScatter, static_cast<int32_t>(d), m}, dl);
    char* mine = static_cast<char*>(buf) + at * es;
    sum(mine, m, d, at);
    if (factor != 1.0) host::convert(mine, d, mine, d, m, factor);
    barrier(dl);
    wire_bytes()->reduce_scatter(m * static_cast<size_t>(size()) * es, size());
  }

  void allgather(void* buf, size_t bytes, Stream&, Deadline dl) override {
    char* p = static_cast<char*>(buf);
    post(p + static_cast<size_t>(rank_) * bytes, bytes, Shape{Op::Allgather, 0, bytes}, dl);
    for (int r = 0; r < size(); ++r)
      if (r != rank_) copy_bytes(p + static_cast<size_t>(r) * bytes, channel_->posted[static_cast<size_t>(r)], bytes);
    barrier(dl);
    wire_bytes()->allgather(bytes, size());
  }

  bool has_alltoall() const override { return true; }
  void alltoall(const void* send, void* recv, size_t bytes, Stream&, Deadline dl) override {
    post(send, bytes * static_cast<size_t>(size()), Shape{Op::Alltoall, 0, bytes}, dl);
    const size_t mine = static_cast<size_t>(rank_) * bytes;
    for (int r = 0; r < size(); ++r)
      copy_bytes(static_cast<char*>(recv) + static_cast<size_t>(r) * bytes,
                 static_cast<const char*>(channel_->posted[static_cast<size_t>(r)]) + mine, bytes);
    barrier(dl);
    wire_bytes()->alltoall(bytes, size());
  }

  void broadcast(void* buf, size_t bytes, int root, void*, Deadline dl) override {
    broadcast_host(buf, bytes, root, dl);
  }

  void allgather_host(const void* in, void* out, size_t bytes, Deadline dl) override {
    post(in, bytes, Shape{Op::AllgatherHost, 0, bytes}, dl);
    for (int r = 0; r < size(); ++r)
      copy_bytes(static_cast<char*>(out) + static_cast<size_t>(r) * bytes, channel_->posted[static_cast<size_t>(r)],
                 bytes);
    barrier(dl);
    wire_bytes()->allgather(bytes, size());
  }

  void broadcast_host(void* buf, size_t bytes, int root, Deadline dl) override {
    if (root < 0 || root >= size()) fail(DDP_ERR_INVALID_ARGUMENT, "broadcast root %d out of range", root);
    post(buf, rank_ == root ? bytes : 0, Shape{Op::Broadcast, root, bytes}, dl);
    if (rank_ != root && bytes) std::memmove(buf, channel_->posted[static_cast<size_t>(root)], bytes);
    barrier(dl);
    wire_bytes()->broadcast(bytes, size(), rank_, root);
  }

  void abort() override {
    std::lock_guard<std::mutex> lock(channel_->mu);
    give_up(*channel_, rank_, "its context failed or was destroyed: see that rank's error");
  }

  // Elastic contexts: a local group is rebuilt over the ranks left, which agree through the group's
  // store (host/membership.hpp) and meet in a group of their own.
  bool can_regroup() const override { return true; }
  void sever() override { severer()(); }
  std::function<void()> severer() override {
    std::shared_ptr<Channel> c = channel_;
    const int rank = rank_;
    return [c, rank] {
      std::lock_guard<std::mutex> lock(c->mu);
      give_up(*c, rank, "a peer was lost: this rank gave up on its communicators");
    };
  }
  Regrouped regroup(const std::string& epoch, int64_t committed,
                    const std::function<std::vector<Liveness>()>& answering, Deadline window, Deadline dl) override {
    const std::string base = key_ + ".e" + epoch;
    const Agreed a = agree_membership(group_->store(), base, epoch, rank_, size(), committed, answering, window, dl);
    Regrouped g;
    g.members = a.members;
    g.committed = a.committed;
    g.comm.reset(new LocalComm(group_->successor(base, static_cast<int>(a.members.size())), a.me, "1"));
    return g;
  }

 private:
  static double factor_of(Reduction red) {
    if (red.op != RedOp::Sum && red.op != RedOp::SumScaled) fail(DDP_ERR_INTERNAL, "local comm: only sums are fused");
    return red.op == RedOp::SumScaled ? red.factor : 1.0;
  }

  // out[i] = the sum over ranks of posted[r][from + i], added in rank order (16-bit types in fp32
  // math, rounded after each addition, as the host ring does: a 16-bit wire of compressed buckets).
  void sum(void* out, size_t n, Dtype d, size_t from) {
    if (n == 0) return;  // (a rank with no elements may pass no buffer: nothing to read or write)
    if (d == Dtype::F32) return sum<float>(out, n, from);
    if (d == Dtype::F64) return sum<double>(out, n, from);
    const size_t es = dtype_size(d);
    std::memcpy(out, static_cast<const char*>(channel_->posted[0]) + from * es, n * es);
    for (int r = 1; r < size(); ++r)
      host::sum_scaled(out, static_cast<const char*>(channel_->posted[static_cast<size_t>(r)]) + from * es, out, n, d,
                       1.0);
  }
  template <class T>
  void sum(void* out, size_t n, size_t from) {
    T* acc = static_cast<T*>(out);
    const T* first = static_cast<const T*>(channel_->posted[0]) + from;
    std::memcpy(acc, first, n * sizeof(T));
    for (int r = 1; r < size(); ++r) {
      const T* p = static_cast<const T*>(channel_->posted[static_cast<size_t>(r)]) + from;
      for (size_t i = 0; i < n; ++i) acc[i] += p[i];
    }
  }

  // Posts a copy of `bytes` of `buf` for collective `shape`, waits for every rank, and fails (on every
  // rank alike) when the ranks' shapes differ.
  void post(const void* buf, size_t bytes, Shape shape, Deadline dl) {
    {
      Channel& c = *channel_;
      std::lock_guard<std::mutex> lock(c.mu);
      // After an abort a peer may still be reading this rank's previous copy: leave it alone.
      if (c.aborted) fail_aborted(c, rank_, size());
      std::vector<char>& mine = c.data[static_cast<size_t>(rank_)];
      if (mine.size() < bytes) mine.resize(bytes);
      copy_bytes(mine.data(), buf, bytes);
      c.posted[static_cast<size_t>(rank_)] = mine.data();
      c.shapes[static_cast<size_t>(rank_)] = shape;
    }
    barrier(dl);
    // Stable until every rank has passed the next barrier, which none reaches if any differs.
    for (int r = 0; r < size(); ++r)
      if (!(channel_->shapes[static_cast<size_t>(r)] == shape))
        fail(DDP_ERR_MISMATCH,
             "local group: the ranks called different collectives on one communicator: rank %d %s, rank %d %s", rank_,
             describe(shape).c_str(), r, describe(channel_->shapes[static_cast<size_t>(r)]).c_str());
  }

  // A worker written off while it waits here (its stream's timeout) may wake after its comm is gone:
  // from the wait on, it touches only the channel it holds and the copies below, never `this`.
  void barrier(Deadline dl) {
    const std::shared_ptr<Channel> keep = channel_;
    const int me = rank_, world = size();
    Channel& c = *keep;
    std::unique_lock<std::mutex> lock(c.mu);
    if (c.aborted) fail_aborted(c, me, world);
    uint64_t gen = c.generation;
    if (++c.arrived == world) {
      c.arrived = 0;
      ++c.generation;
      c.cv.notify_all();
      return;
    }
    auto done = [&] { return c.generation != gen || c.aborted; };
    if (dl.infinite()) {
      c.cv.wait(lock, done);
    } else if (!c.cv.wait_until(lock, dl.at(), done)) {
      // Leave the channel poisoned: the peers that are late would otherwise pair with a later call.
      give_up(c, me, "it waited past its deadline for the others");
      fail(DDP_ERR_TIMEOUT, "local comm: rank %d waited past the deadline for the other ranks", me);
    }
    if (c.generation == gen) fail_aborted(c, me, world);
  }

  // Poisons the channel (its lock held), naming this rank as the one that gave up, unless one did first.
  static void give_up(Channel& c, int rank, const char* why) {
    if (!c.aborted) {
      c.aborted_by = rank;
      c.why = why;
    }
    c.aborted = true;
    c.cv.notify_all();
  }
  // The channel was poisoned (its lock held): who gave up, and why.
  [[noreturn]] static void fail_aborted(const Channel& c, int rank, int world) {
    if (c.aborted_by == rank) fail(DDP_ERR_ABORTED, "local comm: aborted (this rank gave up on it: %s)", c.why);
    fail(DDP_ERR_ABORTED, "local comm: aborted by rank %d of %d (%s)", c.aborted_by, world, c.why);
  }

  std::shared_ptr<LocalGroup> group_;
  int rank_;
  std::string key_;
  std::atomic<uint64_t> dups_{0};
  std::atomic<uint64_t> probers_{0};
  std::shared_ptr<Channel> channel_;
  size_t piece_bytes_ = host::piece_bytes();
  std::vector<char> cast_;  // allreduce_as: this rank's elements in the wire type
};

}  // namespace

std::unique_ptr<Comm> make_local_comm(std::shared_ptr<LocalGroup> group, int rank) {
  std::string key = group->next_root_key(rank);
  return std::unique_ptr<Comm>(new LocalComm(std::move(group), rank, std::move(key)));
}

}  // namespace ddp
