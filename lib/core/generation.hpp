// A generation: everything of a context that belongs to one membership of ranks (docs/design.md,
// "Generations"). Its communicators (the control path, ddp_broadcast's channel, one per bucket
// stream), its streams, its prober (the stall inspector's and the peer watch's way to ask the other
// ranks where they stand), its reducer and its join watch. A context has one at a time: ddp_create
// makes the first; after a loss or an admission, ddp_recover agrees on the next membership, makes the
// next generation over it and swaps it in (recovery.cpp, admission.cpp), which retires this one.
//
// Made in two steps, so that a membership that was agreed on outlives a failed attempt to stand it
// up: the constructor only takes the membership's communicator (no collective); stand_up() makes the
// rest, collectively. Should it fail (a member lost meanwhile), what stands is enough to agree on
// the next membership over the same numbering.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "core/backend.hpp"
#include "core/config.hpp"
#include "core/joins.hpp"
#include "core/reducer.hpp"

namespace ddp {

class Generation {
 public:
  // Elastic: how often a waiting bucket asks whether its peers still answer.
  static constexpr int64_t kPeerWatchMs = 1000;

  // What the context lends each generation's streams and prober.
  struct Hooks {
    std::function<Position()> position;     // this rank's position, which the prober answers with
    std::function<void(int stream)> stall;  // a bucket of `stream` waited past stall_warning_ms
  };

  // Over `over`: the caller's communicator (the first generation; `owned` empty) or the membership's
  // own (`owned` holds it, and `over` is *owned). `ctrl`: its control communicator, if made already
  // (ddp_create agrees on the config over it first). No collective here.
  Generation(Comm& over, std::unique_ptr<Comm> owned, std::unique_ptr<Comm> ctrl = nullptr);
  // Retires: the join watch, the reducer (its buffers), the streams, the prober, then the
  // communicators, each keeping what a written-off worker may still use.
  ~Generation();
  Generation(const Generation&) = delete;
  Generation& operator=(const Generation&) = delete;

  // The rest, collectively, within the current CreationScope: the control communicator (unless
  // made), ddp_broadcast's, one per stream (or `borrowed`: config.stream_comms), the streams and
  // the prober. Elastic contexts watch their peers while a bucket waits.
  void stand_up(const Settings& cfg, const std::vector<Comm*>& borrowed, Device& device, const Hooks& hooks);
  // config.stream_comms are the same communicators in the same order on every rank (host memory), or
  // DDP_ERR_MISMATCH names the first that differs.
  void check_stream_comms(bool borrowed, Deadline dl) const;

  // The reducer over `plan` (after a commit, or the plan the members agreed on). `env` is filled
  // with this generation's communicators and streams; it must outlive the reducer (the context's).
  Reducer& make_reducer(ReducerEnv& env, const std::vector<GradSpec>& specs, Plan plan,
                        const std::vector<void*>& user_ptrs);
  Reducer* reducer() const { return reducer_.get(); }
  void drop_reducer() { reducer_.reset(); }
  // Elastic: the watch over joiners' requests (from slot `from`), replaced by each call.
  void watch_joins(int64_t from, const JoinTerms& terms);
  JoinWatch* join_watch() const { return join_watch_.get(); }
  void stop_join_watch() { join_watch_.reset(); }

  int rank() const { return rank_; }
  int world() const { return world_; }
  Comm& ctrl() const { return *ctrl_; }
  Comm& bcast() const { return *bcast_; }
  bool standing() const { return standing_; }
  const std::vector<Comm*>& comms() const { return comms_; }
  const std::vector<std::unique_ptr<Stream>>& streams() const { return streams_; }
  // What the next membership is agreed over: the control communicator, or, where standing up failed
  // before it was made, the membership's own.
  Comm& agreement_comm() const { return ctrl_ ? *ctrl_ : *over_; }
  Prober* prober() const { return prober_.get(); }
  // Each rank of this membership's number in prober()'s (a prober kept from the generation before,
  // while this one has none of its own); empty: the same numbers.
  const std::vector<int>& probe_numbers() const { return probe_numbers_; }
  // Keeps `older`'s prober until this generation makes its own: should standing up fail, the next
  // agreement still tells a dead member from a late one, asking each by its old number. `members`:
  // each rank of this membership's number in `older`'s.
  void keep_prober(Generation& older, const std::vector<int>& members);

  // Every peer blocked on this rank fails now, rather than at its timeout (a loss).
  void sever();
  // This rank gives up on this generation's membership, which failed to stand up here: sever, and
  // the other members' waits in its formation end too (Comm::give_up).
  void give_up();
  // A severer of every communicator, callable from any thread after they are gone (a failed bucket's
  // worker spreads a loss with it).
  std::function<void()> severer() const;
  // Gives up on every outstanding collective (a fatal error).
  void abort();
  // Before the buffers of a failed context go away: nothing a transport still holds posted touches them.
  void drop_posted(bool stream_comms_too);
  // Waits for every stream's queued work, each bounded by `dl`; errors (known already) are dropped.
  void drain(Deadline dl);
  // Bytes sent and received through this generation's communicators, each counted once: the bucket
  // streams' and, with `own`, the control path and ddp_broadcast's channel.
  void wire_totals(bool own, uint64_t out[2]) const;
  // Elastic: while a bucket waits, whether the peers still answer; a rank silent in two asks in a row
  // (or whose port refused) is taken for lost, and this rank severs (stall_inspector.cpp's peer watch).
  void watch_peers();

 private:
  Comm* over_;  // the membership's communicator (owned_, or the caller's)
  std::unique_ptr<Comm> owned_;
  std::unique_ptr<Comm> ctrl_;   // agreement, plan broadcast, the unused report
  std::unique_ptr<Comm> bcast_;  // ddp_broadcast's own channel
  std::vector<std::unique_ptr<Comm>> owned_comms_;
  std::vector<Comm*> comms_;  // one per stream
  std::vector<std::unique_ptr<Stream>> streams_;
  std::unique_ptr<Reducer> reducer_;
  std::unique_ptr<JoinWatch> join_watch_;
  std::vector<int> probe_numbers_;
  std::vector<int> silent_;  // per rank: peer watches in a row without an answer
  int rank_, world_;
  bool standing_ = false;
  std::unique_ptr<Prober> prober_;
};

}  // namespace ddp
