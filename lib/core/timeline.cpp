#include "core/timeline.hpp"

#include <chrono>
#include <cinttypes>
#include <set>

#include "core/common.hpp"

namespace ddp {

std::string timeline_rank_path(const std::string& path, int rank, int context) {
  size_t slash = path.find_last_of('/');
  size_t dot = path.find_last_of('.');
  std::string tag = (context > 0 ? format(".ctx%d", context) : std::string()) + format(".rank%d", rank);
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) return path + tag;
  return path.substr(0, dot) + tag + path.substr(dot);
}

namespace {

// The timeline files that live contexts of this process write: two contexts of one rank (a GAN's two
// models, a teacher and a student) must not open one file, or their writes interleave into a trace
// that no viewer reads.
std::mutex g_open_mu;
std::set<std::string> g_open;

// Claims the first free name: the plain rank path, else ".ctx1", ".ctx2", ... before it.
std::string claim_path(const std::string& path, int rank) {
  std::lock_guard<std::mutex> lock(g_open_mu);
  for (int context = 0;; ++context) {
    std::string p = timeline_rank_path(path, rank, context);
    if (g_open.insert(p).second) return p;
  }
}

void release_path(const std::string& p) {
  std::lock_guard<std::mutex> lock(g_open_mu);
  g_open.erase(p);
}

}  // namespace

static uint64_t epoch_ns() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
}

Timeline::Timeline(const std::string& path, int rank, int num_streams) : path_(claim_path(path, rank)), rank_(rank) {
  file_ = std::fopen(path_.c_str(), "w");
  if (!file_) {
    release_path(path_);
    fail(DDP_ERR_INVALID_ARGUMENT, "cannot write the timeline file '%s'", path_.c_str());
  }
  steady_origin_ns_ = now_ns();
  epoch_origin_ns_ = epoch_ns();
  events_.reserve(4096);
  std::fputs("[", file_);
  metadata("process_name", -1, format("rank %d", rank_), rank_);
  metadata("thread_name", 0, "trainer", 0);
  for (int s = 0; s < num_streams; ++s) metadata("thread_name", 1 + s, format("stream %d", s), 1 + s);
  std::fflush(file_);
}

Timeline::~Timeline() {
  flush();
  if (file_) {
    std::fputs("\n]\n", file_);
    std::fclose(file_);
  }
  release_path(path_);
}

void Timeline::next_line() {
  std::fputs(first_ ? "\n" : ",\n", file_);
  first_ = false;
}

// A metadata event: the name of the process (tid < 0) or of one of its threads, and its place in the
// viewer's order.
void Timeline::metadata(const char* what, int tid, const std::string& name, int sort_index) {
  const bool process = tid < 0;
  const std::string at = process ? format("\"pid\":%d", rank_) : format("\"pid\":%d,\"tid\":%d", rank_, tid);
  next_line();
  std::fprintf(file_, "{\"name\":\"%s\",\"ph\":\"M\",%s,\"args\":{\"name\":\"%s\"}}", what, at.c_str(), name.c_str());
  next_line();
  std::fprintf(file_, "{\"name\":\"%s\",\"ph\":\"M\",%s,\"args\":{\"sort_index\":%d}}",
               process ? "process_sort_index" : "thread_sort_index", at.c_str(), sort_index);
}

std::string Timeline::us(uint64_t steady_ns) const {
  const uint64_t t = epoch_origin_ns_ + (steady_ns > steady_origin_ns_ ? steady_ns - steady_origin_ns_ : 0);
  return format("%" PRIu64 ".%03u", t / 1000, static_cast<unsigned>(t % 1000));
}

void Timeline::grad_ready(int grad, uint64_t t_ns) {
  std::lock_guard<std::mutex> lock(mu_);
  events_.push_back(Event{'g', grad, 0, 0, 0, t_ns, 0, 0, 0, 0});
}

void Timeline::bucket(int bucket, int stream, uint64_t iteration, uint64_t ready_ns, uint64_t launch_ns,
                      uint64_t start_ns, uint64_t end_ns, int num_grads, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  events_.push_back(Event{'b', bucket, stream, num_grads, iteration, ready_ns, launch_ns, start_ns, end_ns, bytes});
}

void Timeline::iteration(uint64_t iteration, uint64_t begin_ns, uint64_t end_ns) {
  std::lock_guard<std::mutex> lock(mu_);
  events_.push_back(Event{'i', 0, 0, 0, iteration, begin_ns, end_ns, 0, 0, 0});
}

static double dur_us(uint64_t from, uint64_t to) { return to > from ? static_cast<double>(to - from) / 1000.0 : 0.0; }

void Timeline::write(const Event& e) {
  next_line();
  switch (e.kind) {
    case 'g':
      std::fprintf(
          file_,
          "{\"name\":\"grad %d ready\",\"cat\":\"grad\",\"ph\":\"i\",\"s\":\"t\",\"pid\":%d,\"tid\":0,\"ts\":%s}", e.id,
          rank_, us(e.t0).c_str());
      break;
    case 'b':
      // One span from launch to done; the args keep when it became ready and when its work started.
      std::fprintf(file_,
                   "{\"name\":\"bucket %d\",\"cat\":\"bucket\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%s,"
                   "\"dur\":%.3f,\"args\":{\"iteration\":%" PRIu64
                   ",\"ready_us\":%s,\"launch_us\":%s,"
                   "\"start_us\":%s,\"done_us\":%s,\"grads\":%d,\"bytes\":%" PRIu64 "}}",
                   e.id, rank_, e.stream + 1, us(e.t1).c_str(), dur_us(e.t1, e.t3), e.iteration, us(e.t0).c_str(),
                   us(e.t1).c_str(), us(e.t2).c_str(), us(e.t3).c_str(), e.num_grads, e.bytes);
      break;
    case 'i':
      std::fprintf(file_,
                   "{\"name\":\"iteration %" PRIu64
                   "\",\"cat\":\"iteration\",\"ph\":\"X\",\"pid\":%d,\"tid\":0,"
                   "\"ts\":%s,\"dur\":%.3f}",
                   e.iteration, rank_, us(e.t0).c_str(), dur_us(e.t0, e.t1));
      break;
  }
}

void Timeline::flush() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!file_) return;
  for (const Event& e : events_) write(e);
  events_.clear();
  std::fflush(file_);
}

}  // namespace ddp
