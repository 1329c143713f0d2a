#include "core/joins.hpp"

#include <unistd.h>

#include <cinttypes>
#include <cstdio>

namespace ddp {

JoinWatch::JoinWatch(std::shared_ptr<JoinDesk> desk, int64_t from, const JoinTerms& job)
    : desk_(std::move(desk)), job_(job), next_(from), upto_(from), thread_([this] { run(); }) {}

JoinWatch::~JoinWatch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  desk_->stop_waiting();
  cv_.notify_all();
  thread_.join();
}

bool JoinWatch::alive(int64_t slot) {
  std::lock_guard<std::mutex> lock(beats_mu_);
  auto it = beats_.find(slot);
  return it == beats_.end() || now_ns() - it->second.changed_ns < kDeadMs * 1000000ull;
}

bool JoinWatch::idle() {
  std::lock_guard<std::mutex> lock(beats_mu_);
  return beats_.empty();
}

void JoinWatch::read_beats() {
  std::vector<int64_t> slots;
  {
    std::lock_guard<std::mutex> lock(beats_mu_);
    for (const auto& b : beats_) slots.push_back(b.first);
  }
  for (int64_t slot : slots) {
    std::string v;
    if (!desk_->beat(slot, &v)) continue;
    std::lock_guard<std::mutex> lock(beats_mu_);
    Beat& b = beats_[slot];
    if (v != b.value) b.value = v, b.changed_ns = now_ns();
  }
}

// While no joiner is being followed, the watch blocks on the next slot (the store answers when a
// request is filed there) instead of looking every 100 ms.
void JoinWatch::run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    lock.unlock();
    bool waited = false;
    try {
      std::string text;
      while (desk_->request(next_, &text)) {
        bool expired = false;
        const std::string why = refuse_join(text, job_, &expired);
        if (desk_->answered(next_)) {  // settled before this job saw it
        } else if (!why.empty()) {
          desk_->answer(next_, JoinAnswer::refused(why));
        } else if (!expired) {
          std::lock_guard<std::mutex> beats(beats_mu_);
          beats_[next_] = Beat{"", now_ns()};
          upto_.store(next_ + 1, std::memory_order_relaxed);
        }
        ++next_;
      }
      read_beats();
      if (idle()) waited = desk_->wait_request(next_, Deadline::after_ms(kIdleWaitMs));
    } catch (const Error&) {  // the store is out of reach now: try again at the next look
    }
    lock.lock();
    if (!waited) cv_.wait_for(lock, std::chrono::milliseconds(100), [this] { return stop_; });
  }
}

}  // namespace ddp
