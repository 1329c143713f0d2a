#include "core/joins.hpp"

#include <unistd.h>

#include <cinttypes>
#include <cstdio>

namespace ddp {

namespace {
// "ddp-join 1 CONFIG REGISTRATIONS NUM_GRADS HOOK PID HOST GIVE_UP_UNIX_MS"
constexpr const char* kHead = "ddp-join 1";
}  // namespace

std::string join_request(const JoinTerms& mine) {
  char host[256] = "";
  ::gethostname(host, sizeof host - 1);
  return format("%s %016" PRIx64 " %016" PRIx64 " %" PRId64 " %d %ld %s", kHead, mine.config, mine.registrations,
                mine.num_grads, mine.hook, static_cast<long>(::getpid()), host[0] ? host : "?");
}

std::string refuse_join(const std::string& request, const JoinTerms& job, bool* expired) {
  *expired = false;
  JoinTerms t;
  long pid = 0;
  char host[256] = "";
  long long give_up = 0;
  if (request.compare(0, 10, kHead) != 0 ||
      std::sscanf(request.c_str() + 10, " %" SCNx64 " %" SCNx64 " %" SCNd64 " %d %ld %255s %lld", &t.config,
                  &t.registrations, &t.num_grads, &t.hook, &pid, host, &give_up) != 7)
    return "its request is not one this version of libddp understands: '" + request.substr(0, 80) + "'";
  const std::string who = format("the joiner (pid %ld on %s)", pid, host);
  if (t.config != job.config)
    return who + " differs from the job in its config or in the environment on the wire (a field agreed at " +
           "ddp_create, the memory kind, or a DDP_* size knob): make it as the others were made";
  if (t.num_grads != job.num_grads)
    return format("%s registered %lld grads, the job %lld: register the same grads, in the same order", who.c_str(),
                  static_cast<long long>(t.num_grads), static_cast<long long>(job.num_grads));
  if (t.registrations != job.registrations)
    return who + " registered grads that differ from the job's (sizes, dtypes or flags): register the same grads, in " +
           "the same order";
  if (t.hook != job.hook)
    return format("%s %s a comm hook and the job %s: set one before ddp_recover if the job has one", who.c_str(),
                  t.hook ? "set" : "did not set", job.hook ? "has one" : "has none");
  const long long now_ms = static_cast<long long>(
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
  // Its own bound, read on this host's clock with a second to spare for the admission itself.
  *expired = give_up > 0 && give_up < now_ms + 1000;
  return "";
}

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
          desk_->answer(next_, "R" + why);
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
