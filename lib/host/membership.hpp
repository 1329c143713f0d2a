// Elastic contexts: how the ranks left after a loss agree on one membership through a store. Each
// checks in with the iterations it committed, waits for the others while their processes answer
// (`answering`: the stall inspector's ports, where a dead process refuses at once) or until `window`
// (the live but late are left out), then proposes the ranks it saw check in and still reaches; the
// store keeps the first proposal (claim), so every rank adopts the same membership whatever each one
// saw. A rank that reaches no more than half of the ranks not known to be gone (their ports refuse)
// proposes nothing: on a cut link, the larger side goes on and the smaller one is left out. Used by the communicators
// that can be rebuilt (Gloo over its rendezvous store, local groups over an in-memory one).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/inspector.hpp"
#include "host/store.hpp"

namespace ddp {

struct Agreed {
  std::vector<int> members;        // each new rank's number in the old communicator, in order
  std::vector<int64_t> committed;  // and the iterations it had committed
  int me = -1;                     // this rank's new number
};

// Rank `rank` of `size` agrees on membership `epoch` under the store prefix `base`. Throws
// DDP_ERR_RANK_LOST when the others agreed without this rank, DDP_ERR_TIMEOUT at `dl`.
Agreed agree_membership(Store& store, const std::string& base, const std::string& epoch, int rank, int size,
                        int64_t committed, const std::function<std::vector<Liveness>()>& answering, Deadline window,
                        Deadline dl);

}  // namespace ddp
