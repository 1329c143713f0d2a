// The stall inspector's vocabulary: where a rank stands (its iteration, the call it is in, its
// buckets), kept as it changes (Progress) and exchanged between ranks (Position, through a Prober
// each communicator provides). The inspector itself, which turns positions into the messages of a
// stall warning or a timeout, is lib/core/stall_inspector.cpp.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace ddp {

// Where a rank stands, as the stall inspector reports it: its iteration, the call it is in, its
// buckets of that iteration, and how many control-path exchanges it has entered (so that a rank that
// never reached a barrier or ddp_commit the others wait in is behind them). Fixed size, so that ranks can send it to
// each other as bytes.
enum class Call : int32_t {
  Idle = 0,
  Commit,
  Backward,
  Finish,
  ReduceAll,
  Broadcast,
  Destroyed,
  WaitParams,
  ShardNorm,
  Join,
  HostAllreduce,
  Barrier,
  WaitGrad
};
struct Position {
  // -1: the rank did not answer; -2: its port refused (the process is gone); kAcceptedSilent: its port
  // accepted the connection but nothing answered (the process lives but is stopped: a debugger, SIGSTOP)
  int64_t iteration = -1;
  int32_t call = 0;
  int32_t launched = 0, done = 0, buckets = 0;
  int64_t calls = 0;  // control-path exchanges entered (ddp_commit, host collectives, barriers, votes)
};
static_assert(sizeof(Position) == 32, "Position travels as 32 bytes");
constexpr int64_t kAcceptedSilent = -3;

// What asking a rank said (elastic contexts): it answered; it did not answer in time (dead, stuck or
// cut off: nobody can tell); or nothing listens on its port (its process is gone).
enum class Liveness : int8_t { Alive, Silent, Gone };
inline Liveness liveness_of(const Position& p) {
  return p.iteration >= 0 ? Liveness::Alive : p.iteration == -2 ? Liveness::Gone : Liveness::Silent;
}
// A rank is taken for lost after kLostAfterAsks asks in a row without an answer, or one refusal (its
// process is gone). silent_asks: that count after one more ask that said `l`.
constexpr int kLostAfterAsks = 2;
inline int silent_asks(int before, Liveness l) {
  return l == Liveness::Alive ? 0 : l == Liveness::Gone ? kLostAfterAsks : before + 1;
}

// Asks every rank of a communicator where it stands, never blocking on one that does not answer.
// Made collectively (Comm::make_prober); each rank's prober answers the others in the background,
// from `mine`, until it is destroyed.
class Prober {
 public:
  virtual ~Prober() = default;
  // Every rank's position, this rank's included; a rank without an answer within wait_ms has
  // iteration -1.
  virtual std::vector<Position> ask(int64_t wait_ms) = 0;
};

// This rank's progress, written by the context and the reducer's tasks (worker threads) and read by
// the prober's thread whenever another rank asks: atomics, no lock.
struct Progress {
  std::atomic<int64_t> iteration{0};
  std::atomic<int32_t> call{0};  // Call
  std::atomic<int32_t> launched{0}, done{0}, buckets{0};
  std::atomic<int64_t> calls{0};
};

}  // namespace ddp
