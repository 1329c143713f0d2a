// A Chrome trace (chrome://tracing, Perfetto) of one rank: each bucket's span from launch to done on
// its stream's track, and each grad's ready mark on the trainer's track. Events are buffered in memory
// and appended to the file at the end of every iteration; the file is closed into valid JSON on destroy.
#pragma once

#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

namespace ddp {

class Timeline {
 public:
  // Opens `path` with ".rank<N>" inserted before its extension; throws DDP_ERR_INVALID_ARGUMENT if it
  // cannot be written.
  Timeline(const std::string& path, int rank);
  ~Timeline();

  void grad_ready(int grad, uint64_t t_ns);
  void bucket(int bucket, int stream, uint64_t iteration, uint64_t ready_ns, uint64_t launch_ns, uint64_t start_ns,
              uint64_t end_ns, int num_grads, uint64_t bytes);
  void iteration(uint64_t iteration, uint64_t begin_ns, uint64_t end_ns);
  void flush();

 private:
  struct Event {
    char kind;  // 'g' grad ready, 'b' bucket, 'i' iteration
    int id, stream, num_grads;
    uint64_t iteration, t0, t1, t2, t3, bytes;
  };
  void write(const Event& e);

  std::mutex mu_;
  std::vector<Event> events_;
  std::string path_;
  FILE* file_ = nullptr;
  int rank_;
  bool first_ = true;
  uint64_t origin_ns_;
};

// The path with ".rank<N>" before the extension: "t.json" -> "t.rank0.json".
std::string timeline_rank_path(const std::string& path, int rank);

}  // namespace ddp
