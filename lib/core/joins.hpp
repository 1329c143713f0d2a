// Elastic joins: a process started after the job (a replacement for a lost rank, or one more rank)
// asks through the job's store to be admitted; the ranks of the job notice it on a thread of their own
// (no store traffic in the iteration), learn it together through the exchange that ends each synced
// iteration, and admit it at the next step boundary (ddp_recover). This file holds the watch over the
// requests; what a request and an answer say, and whether the job can take a joiner, is
// core/join_protocol.hpp.
#pragma once

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "core/backend.hpp"
#include "core/join_protocol.hpp"

namespace ddp {

// The watch: a thread that reads the job's requests from slot `from` on, refuses those the job cannot
// take (answered at once, so the joiner need not wait for its timeout), and counts the others. It
// blocks on the next slot while no joiner is waiting (a desk that cannot block: it looks every 100 ms),
// and follows the waiting joiners' heartbeats every 100 ms.
class JoinWatch {
 public:
  JoinWatch(std::shared_ptr<JoinDesk> desk, int64_t from, const JoinTerms& job);
  ~JoinWatch();
  // One past the last slot that holds a request the job can take (`from` when none does).
  int64_t upto() const { return upto_.load(std::memory_order_relaxed); }
  // Whether the joiner of `slot` still waits: false once its heartbeat stood still for kDeadMs (it
  // died or gave up), so that the job does not wait for it to arrive; true for a slot not watched yet.
  bool alive(int64_t slot);
  static constexpr uint64_t kDeadMs = 1500;

 private:
  void run();
  bool idle();  // no joiner to follow
  void read_beats();
  static constexpr int64_t kIdleWaitMs = 60000;  // one request a minute while idle
  struct Beat {
    std::string value;
    uint64_t changed_ns;
  };
  std::mutex beats_mu_;
  std::map<int64_t, Beat> beats_;  // of the requests the job can take
  std::shared_ptr<JoinDesk> desk_;
  JoinTerms job_;
  int64_t next_;
  std::atomic<int64_t> upto_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace ddp
