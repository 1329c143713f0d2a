#include "core/timeline.hpp"

#include <cinttypes>

#include "core/common.hpp"

namespace ddp {

std::string timeline_rank_path(const std::string& path, int rank) {
  size_t slash = path.find_last_of('/');
  size_t dot = path.find_last_of('.');
  std::string tag = format(".rank%d", rank);
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) return path + tag;
  return path.substr(0, dot) + tag + path.substr(dot);
}

Timeline::Timeline(const std::string& path, int rank) : path_(timeline_rank_path(path, rank)), rank_(rank) {
  file_ = std::fopen(path_.c_str(), "w");
  if (!file_) fail(DDP_ERR_INVALID_ARGUMENT, "cannot write the timeline file '%s'", path_.c_str());
  origin_ns_ = now_ns();
  events_.reserve(4096);
  std::fprintf(file_, "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n");
  std::fprintf(file_, "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"name\":\"rank %d\"}}", rank_,
               rank_);
  std::fprintf(
      file_,
      ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":0,\"args\":{\"name\":\"backward (grad ready)\"}}",
      rank_);
  first_ = false;
}

Timeline::~Timeline() {
  flush();
  if (file_) {
    std::fprintf(file_, "\n]}\n");
    std::fclose(file_);
  }
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

static double us(uint64_t t, uint64_t origin) { return t > origin ? static_cast<double>(t - origin) / 1000.0 : 0.0; }

void Timeline::write(const Event& e) {
  const char* sep = first_ ? "" : ",\n";
  first_ = false;
  switch (e.kind) {
    case 'g':
      std::fprintf(
          file_,
          "%s{\"name\":\"grad %d ready\",\"cat\":\"grad\",\"ph\":\"i\",\"s\":\"t\",\"pid\":%d,\"tid\":0,\"ts\":%.3f}",
          sep, e.id, rank_, us(e.t0, origin_ns_));
      break;
    case 'b': {
      // One span from launch to done; the args keep when it became ready and when its work started.
      double ts = us(e.t1, origin_ns_), end = us(e.t3, origin_ns_);
      std::fprintf(file_,
                   "%s{\"name\":\"bucket %d\",\"cat\":\"bucket\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,"
                   "\"dur\":%.3f,\"args\":{\"iteration\":%" PRIu64
                   ",\"ready_us\":%.3f,\"launch_us\":%.3f,"
                   "\"start_us\":%.3f,\"done_us\":%.3f,\"grads\":%d,\"bytes\":%" PRIu64 "}}",
                   sep, e.id, rank_, e.stream + 1, ts, end > ts ? end - ts : 0.0, e.iteration, us(e.t0, origin_ns_), ts,
                   us(e.t2, origin_ns_), end, e.num_grads, e.bytes);
      break;
    }
    case 'i': {
      double ts = us(e.t0, origin_ns_), end = us(e.t1, origin_ns_);
      std::fprintf(file_,
                   "%s{\"name\":\"iteration %" PRIu64
                   "\",\"cat\":\"iteration\",\"ph\":\"X\",\"pid\":%d,\"tid\":0,"
                   "\"ts\":%.3f,\"dur\":%.3f}",
                   sep, e.iteration, rank_, ts, end > ts ? end - ts : 0.0);
      break;
    }
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
