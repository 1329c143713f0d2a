// The reducer's insides, shared by its two files (reducer.cpp: the plan's runtime, readiness and
// launches; bucket_steps.cpp: what a launched bucket's task runs).
#pragma once

#include <atomic>
#include <utility>
#include <vector>

#include "core/reducer.hpp"

namespace ddp {

// One step of a bucket's program, as a task of its own: the whole bucket (a host worker, or a GPU
// bucket launched alone), or one of the steps a grouped GPU launch interleaves across buckets.
struct Reducer::StepTask final : Task {
  Reducer* reducer = nullptr;
  int bucket = 0;
  Step step = Step::Whole;
  void run() override { reducer->run_step(bucket, step); }
};

// A bucket's runtime: what changes while the program runs (pointers, readiness, progress).
struct Reducer::BucketRt {
  StepTask whole, in, collectives, out;
  SegmentTable packed;                                  // staged: grads packed into staging; arena: each grad's view
  SegmentTable direct;                                  // copy layout: grads reduced in place, each its own collective
  std::vector<std::pair<SegmentTable*, size_t>> where;  // per slot: its table entry
  size_t stage_offset = 0;                              // bytes into its stream's staging buffer
  std::atomic<bool> done{false};  // this iteration's work finished (names the bucket a timeout hit)
  int size = 0;
  int ready = 0;
  char* base = nullptr;  // arena: the bucket's storage
  uint64_t ready_ns = 0, launch_ns = 0, start_ns = 0;
  uint64_t mark = 0;  // host streams: its stream's task count once its task was submitted (drain_to)
};

}  // namespace ddp
