// The reducer drives GPU-style streams (tasks run at once on the caller and only enqueue) with a
// recording device and communicator: buckets that become ready together are issued as every pack,
// then every collective inside one group, then every unpack; single buckets are issued whole; and
// buckets always leave in plan order.
#include <doctest.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/reducer.hpp"

using namespace ddp;

namespace {

std::vector<std::string> g_log;
std::vector<void*> g_pack_dst;  // where each pack wrote

class InlineStream final : public Stream {
 public:
  void reserve(size_t) override {}
  void submit(Task* t) override { t->run(); }
  void drain(Deadline) override { g_log.push_back("drain"); }
  bool runs_inline() const override { return true; }
  void* native() override { return nullptr; }
  void poll_error() override {}
  void cancel() override {}
  void set_task_timeout(int64_t) override {}
};

class RecordingDevice final : public Device {
 public:
  Memory memory() const override { return Memory::Device; }
  void* alloc(size_t bytes) override { return std::calloc(1, bytes); }
  void free(void* p) override { std::free(p); }
  void copy(void*, const void*, size_t) override {}
  std::unique_ptr<Stream> make_stream(int) override { return std::unique_ptr<Stream>(new InlineStream()); }
  void stream_wait_user(Stream&, void*) override { g_log.push_back("wait"); }
  void user_wait_stream(void*, Stream&) override {}
  void pack(SegmentTable& t, Dtype, void* dst, Dtype, double, Span, Stream&) override {
    g_pack_dst.push_back(dst);
    g_log.push_back("pack" + std::to_string(t.segs.size()));
  }
  void unpack(const void*, Dtype, SegmentTable& t, Dtype, double s, Span, Stream&) override {
    g_log.push_back("unpack" + std::to_string(t.segs.size()) + (s != 1.0 ? "x" : ""));
  }
  void scale(void*, size_t, Dtype, double s, Stream&) override {
    if (s != 1.0) g_log.push_back("scale");
  }
  void fill_zero(void*, size_t, Dtype, Stream&) override { g_log.push_back("zero"); }
  void reserve_flags(size_t) override {}
  void scan_nonfinite(const void*, size_t, Dtype, size_t slot, Stream&) override {
    g_log.push_back("scan" + std::to_string(slot));
  }
  bool take_nonfinite(size_t slot, Stream&) override {
    g_log.push_back("take" + std::to_string(slot));
    return false;
  }
  void norm_terms(const void*, size_t, Dtype, Stream&, double*) override { g_log.push_back("norm"); }
};

class RecordingComm final : public Comm {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  Memory memory() const override { return Memory::Device; }
  std::unique_ptr<Comm> dup() override { return std::unique_ptr<Comm>(new RecordingComm()); }
  std::unique_ptr<Device> make_device() override { return std::unique_ptr<Device>(new RecordingDevice()); }
  bool supports_wire(Dtype) const override { return true; }
  bool supports(RedOp op) const override { return op != RedOp::SumScaled; }  // like NCCL: Avg, PreMulSum
  bool can_group() const override { return true; }
  void allreduce(const void*, void*, size_t n, Dtype, Reduction red, Stream&, Deadline) override {
    g_log.push_back("ar" + std::to_string(n) +
                    (red.op == RedOp::Avg         ? "avg"
                     : red.op == RedOp::PreMulSum ? "pre"
                                                  : "sum"));
  }
  void broadcast(void*, size_t, int, void*, Deadline) override {}
  void group_start() override { g_log.push_back("gs"); }
  void group_end() override { g_log.push_back("ge"); }
  void allgather_host(const void*, void*, size_t, Deadline) override {}
  void broadcast_host(void*, size_t, int, Deadline) override {}
};

struct Rig {
  RecordingComm comm;
  RecordingDevice device;
  std::vector<std::unique_ptr<Stream>> streams;
  Stats counters;
  Progress progress;
  std::vector<GradSpec> specs;
  std::vector<std::vector<float>> bufs;
  ReducerEnv env;  // the reducer reads it for its life
  std::unique_ptr<Reducer> reducer;
  Rig(bool arena, int num_streams, size_t inplace = 0, double predivide = 1.0, bool check_finite = false,
      Dtype dtype = Dtype::F32) {
    for (int i = 0; i < 4; ++i) specs.push_back(GradSpec{100, dtype, 0});
    bufs.assign(4, std::vector<float>(100));
    env.device = &device;
    for (int s = 0; s < num_streams; ++s) {
      streams.push_back(device.make_stream(s));
      env.streams.push_back(streams.back().get());
      env.comms.push_back(&comm);
    }
    env.program.world = 2;
    env.program.arena = arena;
    env.program.predivide = predivide;
    env.program.inplace_min_numel = inplace;
    env.check_finite = check_finite;
    env.stats = &counters;
    env.progress = &progress;
    reducer.reset(new Reducer(env, specs));
    std::vector<void*> ptrs;
    for (auto& b : bufs) ptrs.push_back(arena ? nullptr : b.data());
    reducer->adopt(registration_plan(specs, 100, num_streams), ptrs);  // one grad per bucket: 3,2,1,0
    reducer->begin(nullptr, 0);
    g_log.clear();
  }
};

std::vector<std::string> L(std::initializer_list<const char*> l) {
  return std::vector<std::string>(l.begin(), l.end());
}

}  // namespace

TEST_CASE("GPU streams: buckets ready together are grouped; alone they are issued whole") {
  Rig rig(false, 2);
  // Grads 0, 1, 2 ready: buckets 1..3 are complete but wait for bucket 0 (grad 3): nothing is issued.
  rig.reducer->mark_ready(0, true, 0);
  rig.reducer->mark_ready(1, true, 0);
  rig.reducer->mark_ready(2, true, 0);
  CHECK(g_log.empty());
  // Grad 3 completes bucket 0: all four leave together, as one group, in plan order.
  rig.reducer->mark_ready(3, true, 0);
  CHECK(g_log == L({"wait", "pack1", "wait", "pack1", "wait", "pack1", "wait", "pack1", "gs", "ar100avg", "ar100avg",
                    "ar100avg", "ar100avg", "ge", "unpack1", "unpack1", "unpack1", "unpack1"}));
  CHECK(rig.counters.buckets_reduced.load() == 4);
  CHECK(rig.reducer->launched() == 4);

  // Next iteration, in plan order: each bucket leaves alone, whole.
  rig.reducer->begin(nullptr, 1);
  g_log.clear();
  rig.reducer->mark_ready(3, true, 0);
  CHECK(g_log == L({"wait", "pack1", "ar100avg", "unpack1"}));
}

TEST_CASE("GPU streams: buckets grouped on one stream pack into separate staging ranges") {
  // Every pack of a group runs before its first collective, so two buckets sharing a range would
  // reduce each other's grads (found by the simulated GPU suite).
  Rig rig(false, 1);
  g_pack_dst.clear();
  for (int g = 0; g < 4; ++g) rig.reducer->mark_ready(g, true, 0);
  REQUIRE(g_pack_dst.size() == 4);
  std::vector<char*> d;
  for (void* p : g_pack_dst) d.push_back(static_cast<char*>(p));
  std::sort(d.begin(), d.end());
  for (size_t i = 1; i < d.size(); ++i) CHECK(d[i] - d[i - 1] >= static_cast<std::ptrdiff_t>(100 * sizeof(float)));
}

TEST_CASE("GPU streams: the arena reduces in place; unfused factors become in-place passes") {
  Rig rig(true, 1, 0, 4.0);  // predivide 4: PreMulSum(1/4) fused, post factor 4/2 as a pass
  rig.reducer->mark_ready(3, true, 0);
  CHECK(g_log == L({"wait", "ar100pre", "scale"}));
  g_log.clear();
  rig.reducer->mark_ready(1, true, 0);
  rig.reducer->mark_ready(2, true, 0);
  CHECK(g_log == L({"wait", "wait", "gs", "ar100pre", "ar100pre", "ge", "scale", "scale"}));
}

TEST_CASE("GPU streams: a pre-division factor 16 bits cannot hold is a pass, never a 16-bit premultiplied sum") {
  // NCCL multiplies by the scalar in the wire type: 1/3 in bf16 is 0.33398, a bias of 0.2% on every grad.
  for (Dtype dt : {Dtype::F16, Dtype::BF16}) {
    Rig third(true, 1, 0, 3.0, false, dt);
    third.reducer->mark_ready(3, true, 0);
    CHECK(g_log == L({"wait", "scale", "ar100sum", "scale"}));
    Rig quarter(true, 1, 0, 4.0, false, dt);  // 1/4 is exact in 16 bits: fused
    quarter.reducer->mark_ready(3, true, 0);
    CHECK(g_log == L({"wait", "ar100pre", "scale"}));
  }
}

TEST_CASE("GPU streams: in-place large grads join the bucket's group, never a nested one when grouped") {
  Rig rig(false, 1, 50);  // every grad (100 elements) is reduced in place
  rig.reducer->mark_ready(3, true, 0);
  CHECK(g_log == L({"wait", "ar100avg"}));
  g_log.clear();
  rig.reducer->launch_rest();  // the rest leave together, unused grads as zeros
  CHECK(g_log == L({"wait", "zero", "wait", "zero", "wait", "zero", "gs", "ar100avg", "ar100avg", "ar100avg", "ge"}));
}

TEST_CASE("check_finite: the hook only enqueues scans; the flags are read once, at finish") {
  for (bool arena : {false, true}) {
    CAPTURE(arena);
    Rig rig(arena, 2, 0, 1.0, true);
    for (int g = 3; g >= 0; --g) rig.reducer->mark_ready(g, true, 0);
    // Inside the hook: one scan per bucket into its own flag, and nothing that waits.
    std::vector<std::string> hook = g_log;
    for (const std::string& e : hook) {
      CHECK(e != "drain");
      CHECK(e.compare(0, 4, "take") != 0);
    }
    for (const char* scan : {"scan0", "scan1", "scan2", "scan3"})
      CHECK(std::count(hook.begin(), hook.end(), std::string(scan)) == 1);
    g_log.clear();
    rig.reducer->finish(nullptr, Deadline::never());
    CHECK(g_log == L({"take0", "take1", "take2", "take3"}));
  }
}

// --- host comms: pieces, in-place grads, the scaled sum ----------------------------------------

namespace {

// A host communicator (MPI-like): pieces of 100 elements, sums and scaled sums only. Records where
// each collective reads and writes.
struct RecordedCall {
  const void* send;
  void* recv;
  size_t n;
  Reduction red;
};
std::vector<RecordedCall> g_calls;

class HostRecordingComm final : public Comm {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  Memory memory() const override { return Memory::Host; }
  std::unique_ptr<Comm> dup() override { return std::unique_ptr<Comm>(new HostRecordingComm()); }
  std::unique_ptr<Device> make_device() override { return std::unique_ptr<Device>(new RecordingDevice()); }
  bool supports_wire(Dtype) const override { return true; }
  bool supports(RedOp op) const override { return op == RedOp::Sum || op == RedOp::SumScaled; }
  size_t piece_elems(Dtype, size_t) const override { return 100; }
  void allreduce(const void* send, void* recv, size_t n, Dtype, Reduction red, Stream&, Deadline) override {
    g_calls.push_back(RecordedCall{send, recv, n, red});
  }
  void broadcast(void*, size_t, int, void*, Deadline) override {}
  void allgather_host(const void*, void*, size_t, Deadline) override {}
  void broadcast_host(void*, size_t, int, Deadline) override {}
};

// Copy layout, one bucket of four grads: 300 and 150 elements (at least a piece), 40 and 60.
struct HostRig {
  HostRecordingComm comm;
  RecordingDevice device;
  std::unique_ptr<Stream> stream;
  Stats counters;
  Progress progress;
  std::vector<GradSpec> specs;
  std::vector<std::vector<float>> bufs;
  ReducerEnv env;  // the reducer reads it for its life
  std::unique_ptr<Reducer> reducer;
  HostRig(size_t inplace, bool average = true, double predivide = 1.0) {
    for (size_t n : {300, 40, 60, 150}) {
      specs.push_back(GradSpec{n, Dtype::F32, 0});
      bufs.emplace_back(n);
    }
    env.device = &device;
    stream = device.make_stream(0);
    env.streams.push_back(stream.get());
    env.comms.push_back(&comm);
    env.program.world = 2;
    env.program.average = average;
    env.program.predivide = predivide;
    env.program.inplace_min_numel = inplace;
    env.stats = &counters;
    env.progress = &progress;
    reducer.reset(new Reducer(env, specs));
    std::vector<void*> ptrs;
    for (auto& b : bufs) ptrs.push_back(b.data());
    reducer->adopt(registration_plan(specs, 100000, 1), ptrs);
    reducer->begin(nullptr, 0);
    g_log.clear();
    g_calls.clear();
    for (int g = 0; g < 4; ++g) reducer->mark_ready(g, true, 0);
  }
  // The grad whose buffer holds p, or -1.
  int grad_at(const void* p) const {
    const char* c = static_cast<const char*>(p);
    for (size_t g = 0; g < bufs.size(); ++g) {
      const char* lo = reinterpret_cast<const char*>(bufs[g].data());
      if (c >= lo && c < lo + bufs[g].size() * sizeof(float)) return static_cast<int>(g);
    }
    return -1;
  }
  size_t total() const {
    size_t n = 0;
    for (const RecordedCall& c : g_calls) n += c.n;
    return n;
  }
};

}  // namespace

TEST_CASE("host comms: by default grads of at least a piece are reduced in place, the rest packed") {
  HostRig rig(0);
  CHECK(rig.total() == 550);
  size_t in_place = 0, packed = 0;
  for (const RecordedCall& c : g_calls) {
    CHECK(c.n <= 100);
    const int g = rig.grad_at(c.recv);
    if (g >= 0) {
      CHECK(c.send == c.recv);
      CHECK((g == 0 || g == 3));
      in_place += c.n;
    } else {
      CHECK(rig.grad_at(c.send) == -1);  // 40 + 60 packed: the piece spans two grads
      packed += c.n;
    }
  }
  CHECK(in_place == 450);
  CHECK(packed == 100);
}

TEST_CASE("host comms: inplace_min_numel SIZE_MAX keeps every collective off the caller's grads") {
  HostRig rig(SIZE_MAX);
  CHECK(rig.total() == 550);
  for (const RecordedCall& c : g_calls) {
    CHECK(rig.grad_at(c.send) == -1);
    CHECK(rig.grad_at(c.recv) == -1);
  }
}

TEST_CASE("host comms: with nothing in place, a piece inside one grad is sent from it, never written there") {
  HostRig rig(100000);
  CHECK(rig.total() == 550);
  int from_grad = 0;
  for (const RecordedCall& c : g_calls) {
    CHECK(rig.grad_at(c.recv) == -1);
    if (rig.grad_at(c.send) >= 0) ++from_grad;
  }
  // 550 packed elements in six pieces; those that lie in one grad (300 and 150 hold some) go without
  // a pack.
  CHECK(g_calls.size() == 6);
  CHECK(from_grad >= 3);
}

TEST_CASE("host comms: the averaging factor rides on the collective, no scaling pass") {
  for (size_t inplace : {size_t(0), SIZE_MAX}) {
    CAPTURE(inplace);
    HostRig rig(inplace);
    for (const RecordedCall& c : g_calls) {
      CHECK(c.red.op == RedOp::SumScaled);
      CHECK(c.red.factor == 0.5);
    }
    for (const std::string& e : g_log) {
      CHECK(e != "scale");
      CHECK(e.back() != 'x');  // no unpack scales
    }
  }
  HostRig sum(0, false);
  for (const RecordedCall& c : g_calls) CHECK(c.red.op == RedOp::Sum);
  // Pre-division: the pre-scale stays a pass (in cache, per piece), the post factor (3 / 2) fused.
  HostRig pre(0, true, 3.0);
  for (const RecordedCall& c : g_calls) {
    CHECK(c.red.op == RedOp::SumScaled);
    CHECK(c.red.factor == 1.5);
  }
  CHECK(std::count(g_log.begin(), g_log.end(), std::string("scale")) > 0);
}
