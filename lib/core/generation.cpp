#include "core/generation.hpp"

#include <algorithm>
#include <exception>
#include <thread>

#include "core/log.hpp"
#include "core/stragglers.hpp"

namespace ddp {

Generation::Generation(Comm& over, std::unique_ptr<Comm> owned, std::unique_ptr<Comm> ctrl)
    : over_(&over), owned_(std::move(owned)), ctrl_(std::move(ctrl)), rank_(over.rank()), world_(over.size()) {}

// In this order, as the work depends on what follows it: the watch and the reducer's tasks use the
// streams, the streams' workers and the prober use the communicators.
Generation::~Generation() {
  join_watch_.reset();
  reducer_.reset();
  streams_.clear();
  prober_.reset();
  owned_comms_.clear();
  comms_.clear();
  bcast_.reset();
  ctrl_.reset();
  owned_.reset();
}

void Generation::stand_up(const Settings& cfg, const std::vector<Comm*>& borrowed, Device& device, const Hooks& hooks) {
  if (!ctrl_) ctrl_ = over_->dup();
  prober_ = over_->make_prober(hooks.position);
  probe_numbers_.clear();
  bcast_ = over_->dup();
  if (borrowed.empty()) {
    for (int i = 0; i < cfg.c.num_streams; ++i) {
      owned_comms_.push_back(over_->dup());
      comms_.push_back(owned_comms_.back().get());
    }
  } else {
    comms_ = borrowed;
  }
  for (int i = 0; i < cfg.c.num_streams; ++i) streams_.push_back(device.make_stream(i));
  const int64_t stall_ms = cfg.stall_warning_ms();
  for (int i = 0; i < cfg.c.num_streams; ++i)
    streams_[static_cast<size_t>(i)]->set_stall_warning(stall_ms, [stall = hooks.stall, i] { stall(i); });
  if (cfg.c.elastic)
    for (auto& s : streams_) s->set_peer_watch(kPeerWatchMs, [this] { watch_peers(); });
  standing_ = true;
}

// Each carries its index, all at once (a thread each), so that communicators given in different
// orders meet each other (and name the difference) rather than wait for each other. Host memory
// only: device collectives issued in different orders on different threads can deadlock in NCCL;
// there a difference is a bucket that times out.
void Generation::check_stream_comms(bool borrowed, Deadline dl) const {
  if (!borrowed || world_ == 1 || comms_[0]->memory() != Memory::Host) return;
  const size_t n = comms_.size(), world = static_cast<size_t>(world_);
  std::vector<int32_t> seen(n * world, -1);
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < n; ++i)
    threads.emplace_back([&, i] {
      try {
        const int32_t mine = static_cast<int32_t>(i);
        comms_[i]->allgather_host(&mine, &seen[i * world], sizeof mine, dl);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    });
  for (std::thread& t : threads) t.join();
  for (size_t i = 0; i < n; ++i)
    for (size_t r = 0; r < world; ++r)
      if (!errors[i] && seen[i * world + r] != static_cast<int32_t>(i))
        fail(DDP_ERR_MISMATCH,
             "config.stream_comms differ between ranks: stream_comms[%zu] of rank %d is stream_comms[%d] of rank %zu; "
             "give every rank the same communicators in the same order",
             i, rank_, seen[i * world + r], r);
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

Reducer& Generation::make_reducer(ReducerEnv& env, const std::vector<GradSpec>& specs, Plan plan,
                                  const std::vector<void*>& user_ptrs) {
  env.comms = comms_;
  env.streams.clear();
  for (auto& s : streams_) env.streams.push_back(s.get());
  reducer_.reset(new Reducer(env, specs));
  reducer_->adopt(std::move(plan), user_ptrs);
  return *reducer_;
}

void Generation::watch_joins(int64_t from, const JoinTerms& terms) {
  join_watch_.reset();
  std::shared_ptr<JoinDesk> desk = ctrl_->join_desk();
  if (desk) join_watch_.reset(new JoinWatch(std::move(desk), from, terms));
}

void Generation::keep_prober(Generation& older, const std::vector<int>& members) {
  if (!older.prober_) return;
  prober_ = std::move(older.prober_);
  probe_numbers_.clear();
  for (int m : members)
    probe_numbers_.push_back(older.probe_numbers_.empty() ? m : older.probe_numbers_[static_cast<size_t>(m)]);
}

void Generation::sever() {
  if (reducer_) reducer_->cancel();
  for (Comm* c : comms_) c->sever();
  if (ctrl_) ctrl_->sever();
  if (bcast_) bcast_->sever();
}

void Generation::give_up() {
  sever();
  if (owned_) owned_->give_up();  // (the first generation's is the caller's, never given up)
}

std::function<void()> Generation::severer() const {
  std::vector<std::function<void()>> cut;
  for (Comm* c : comms_) cut.push_back(c->severer());
  if (ctrl_) cut.push_back(ctrl_->severer());
  if (bcast_) cut.push_back(bcast_->severer());
  return [cut] {
    for (const auto& f : cut) f();
  };
}

// ddp_broadcast's channel too: the context is over, and a communicator that may share a transport
// with a written-off worker (Gloo's) is then kept rather than torn down under it.
void Generation::abort() {
  if (reducer_) reducer_->cancel();
  for (Comm* c : comms_) c->abort();
  if (ctrl_) ctrl_->abort();
  if (bcast_) bcast_->abort();
}

void Generation::drop_posted(bool stream_comms_too) {
  if (stream_comms_too)
    for (Comm* c : comms_) c->drop_posted();
  if (ctrl_) ctrl_->drop_posted();
  if (bcast_) bcast_->drop_posted();
}

void Generation::drain(Deadline dl) {
  for (auto& s : streams_) {
    try {
      s->drain(dl);
    } catch (...) {  // a failed or written-off task: the failure is known already
    }
  }
}

void Generation::wire_totals(bool own, uint64_t out[2]) const {
  std::vector<const Comm*> all;
  if (own) all = {ctrl_.get(), bcast_.get()};
  for (const Comm* c : comms_)
    if (std::find(all.begin(), all.end(), c) == all.end()) all.push_back(c);
  out[0] = out[1] = 0;
  for (const Comm* c : all) {
    if (!c) continue;
    out[0] += c->wire_bytes()->sent.load(std::memory_order_relaxed);
    out[1] += c->wire_bytes()->received.load(std::memory_order_relaxed);
  }
}

// A rank silent in two watches in a row (or whose port refused: its process is gone) is taken for lost:
// this rank closes its connections (as a bucket worker does when its collective fails), so that its own
// wait ends now and the loss reaches every rank, rather than at timeout_ms. (A send to a dead peer can
// wait for its whole timeout, and a cut link closes nothing.) A rank whose port accepts but which does
// not answer lives, stopped (a debugger, SIGSTOP, a paused machine): a stall, which timeout_ms bounds,
// as for a rank that answers.
void Generation::watch_peers() {
  if (!prober_) return;
  const std::vector<Position> pos = prober_->ask(500);
  silent_.resize(pos.size(), 0);
  int gone = -1;
  for (size_t r = 0; r < pos.size(); ++r) {
    const bool stopped = pos[r].iteration == kAcceptedSilent;
    silent_[r] = stopped ? 0 : silent_asks(silent_[r], liveness_of(pos[r]));
    if (silent_[r] >= kLostAfterAsks && gone < 0) gone = static_cast<int>(r);
  }
  if (gone < 0) return;
  std::fill(silent_.begin(), silent_.end(), 0);
  log(DDP_LOG_WARN,
      "libddp: rank %d: rank %d does not answer (its process is gone, or it is cut off): this rank gives up on it "
      "and closes its connections",
      rank_, gone);
  severer()();
}

}  // namespace ddp
