// Elastic membership (config.elastic; docs/design.md, "Elastic membership"): what a rank holds of its
// membership between changes, and the steps of a change that need nothing of the context but what
// they are given (elastic.cpp). A change reads as one path in the context: agree on the members (the
// store), make the next generation over them, confirm every member made it, swap, settle the report
// (Context::recover in recovery.cpp; joiners: admission.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/backend.hpp"
#include "core/config.hpp"
#include "core/generation.hpp"
#include "core/plan.hpp"

namespace ddp {

// What an elastic rank holds of its membership from one change to the next.
struct MembershipBook {
  uint64_t epoch = 0;         // membership changes so far
  uint64_t attempts = 0;      // tries for the next membership, each agreed under a name of its own
  int64_t admitted_upto = 0;  // join slots settled (admitted, refused or passed over)
  int64_t pending_upto = 0;   // agreed: joiners wait up to this slot; the next iteration answers RANK_JOINING
  // The membership this rank last held (the last that ddp_create or a ddp_recover that succeeded gave
  // it; -1 and 0 on a joiner), which ddp_recover reports against: a failed attempt may have left the
  // context over another. held_numbers: each rank of the current generation's number in it (-1: a
  // joiner of a failed admission; empty: the same numbers).
  int held_rank = 0, held_world = 1;
  std::vector<int> held_numbers;
  std::shared_ptr<JoinDesk> held_desk;  // where the members of that membership say they left

  // The joiners the ranks agreed on in an exchange (the highest slot any rank's watch saw).
  void note_joins(int64_t upto) {
    if (upto > admitted_upto) pending_upto = pending_upto > upto ? pending_upto : upto;
  }
  bool joiners_waiting() const { return pending_upto > admitted_upto; }
  // The name of the next attempt at membership epoch + 1, alike on every rank that makes it.
  std::string next_attempt() { return std::to_string(epoch + 1) + "." + std::to_string(attempts++); }
  // Each rank of a membership of `size` ranks, made over the current generation's (`members`: each new
  // rank's number in it; none: the same numbers, joiners after them), numbered in the membership held.
  std::vector<int> held_numbers_of(size_t size, int current_world, const std::vector<int>* members) const;
};

// What a membership change may take: twice timeout_ms (the live but late are waited for up to
// timeout_ms, then the agreement and the rebuild have as much again).
Deadline membership_deadline(int64_t timeout_ms);

// Checks in with the others through the store (over `gen`'s agreement communicator) as attempt
// `name`, with `committed` iterations; whether a rank that has not checked in still lives is asked
// through `gen`'s prober (a dead process refuses at once). DDP_ERR_RANK_LOST: this rank was left out.
Regrouped agree_members(const Generation& gen, const std::string& name, int64_t committed, Deadline window,
                        Deadline dl);

// Every member of the membership just agreed on made its communicator: one exchange over it. A member
// lost while the communicators were being made fails it on every rank, so that all of them try again
// from the membership they had, never some from the old one and some from the new.
void confirm_members(Comm& made, Deadline dl);

// The plan every member goes on with (the new rank 0's `mine`; none: every rank commits again), and
// the join slots settled (rank 0's admitted_upto, into *admitted_upto). A failed first iteration may
// have left some ranks with the learned plan and others without, and a loss in ddp_commit some ranks
// committed and others not; each would then run different collectives.
std::unique_ptr<Plan> agreed_plan(Comm& ctrl, const Plan* mine, const std::vector<GradSpec>& specs, const Settings& cfg,
                                  int64_t* admitted_upto, Deadline dl);

}  // namespace ddp
