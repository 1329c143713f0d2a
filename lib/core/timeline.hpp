// A Chrome trace (chrome://tracing, Perfetto) of one rank: each bucket's span from launch to done on
// its stream's track, and each grad's ready mark on the trainer's track. The file is the trace event
// format's array form, one event per line: "[", then the events, each but the last written so far
// followed by a comma. A file cut short at any event (a killed process) still loads; the closing "]"
// comes on destroy. Timestamps count microseconds since the Unix epoch (the steady clock's readings,
// moved onto the wall clock once, at creation), so every rank's file shares one time base and the
// files merge (tools/merge_timeline.py). Events are buffered in memory and written and flushed to
// disk at the end of every iteration, at a stall warning, and on destroy.
#pragma once

#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

namespace ddp {

class Timeline {
 public:
  // Opens `path` with ".rank<N>" inserted before its extension (".ctx<K>.rank<N>" when another live
  // context of this process writes that file already, K the smallest free) and writes the process and
  // thread names (pid = rank; tid 0 the trainer, tid 1 + s bucket stream s); throws
  // DDP_ERR_INVALID_ARGUMENT if it cannot be written.
  Timeline(const std::string& path, int rank, int num_streams);
  ~Timeline();

  void grad_ready(int grad, uint64_t t_ns);
  void bucket(int bucket, int stream, uint64_t iteration, uint64_t ready_ns, uint64_t launch_ns, uint64_t start_ns,
              uint64_t end_ns, int num_grads, uint64_t bytes);
  void iteration(uint64_t iteration, uint64_t begin_ns, uint64_t end_ns);
  // Writes the buffered events and flushes the file. Thread-safe.
  void flush();
  // The file written.
  const std::string& path() const { return path_; }

 private:
  struct Event {
    char kind;  // 'g' grad ready, 'b' bucket, 'i' iteration
    int id, stream, num_grads;
    uint64_t iteration, t0, t1, t2, t3, bytes;
  };
  void write(const Event& e);
  void metadata(const char* what, int tid, const std::string& name, int sort_index);
  // Starts the next line: the comma that ends the line before, if any.
  void next_line();
  // A steady-clock reading as microseconds since the epoch, "%llu.%03u" (exact, no rounding).
  std::string us(uint64_t steady_ns) const;

  std::mutex mu_;
  std::vector<Event> events_;
  std::string path_;
  FILE* file_ = nullptr;
  int rank_;
  bool first_ = true;
  uint64_t steady_origin_ns_;  // the steady clock at creation
  uint64_t epoch_origin_ns_;   // the wall clock (since the Unix epoch) at the same moment
};

// The path with ".rank<N>" before the extension: "t.json" -> "t.rank0.json"; for a rank's second,
// third ... live context in one process (context 1, 2, ...): "t.ctx1.rank0.json".
std::string timeline_rank_path(const std::string& path, int rank, int context = 0);

}  // namespace ddp
