// The steps of a membership change that need nothing of the context but what they are given
// (elastic.hpp); the context's own path through them is recovery.cpp (a loss) and admission.cpp (joins).
#include "core/elastic.hpp"

#include <algorithm>

namespace ddp {

std::vector<int> MembershipBook::held_numbers_of(size_t size, int current_world,
                                                 const std::vector<int>* members) const {
  std::vector<int> held(size, -1);
  for (size_t i = 0; i < held.size(); ++i) {
    const int was = members ? (*members)[i] : static_cast<int>(i) < current_world ? static_cast<int>(i) : -1;
    if (was >= 0) held[i] = held_numbers.empty() ? was : held_numbers[static_cast<size_t>(was)];
  }
  return held;
}

Deadline membership_deadline(int64_t t) { return Deadline::after_ms(t > 0 && t < INT64_MAX / 2 ? 2 * t : t); }

Regrouped agree_members(const Generation& gen, const std::string& name, int64_t committed, Deadline window,
                        Deadline dl) {
  // (after a generation that failed to stand up, the agreed membership's communicator is all there
  // is; the prober kept from before asks its members by their old numbers)
  Comm& at = gen.agreement_comm();
  Prober* prober = gen.prober();
  const int n = at.size();
  const std::vector<int> numbers = gen.probe_numbers();
  auto answering = [prober, n, numbers] {
    std::vector<Liveness> alive(static_cast<size_t>(n), Liveness::Alive);
    if (!prober) return alive;
    // A live rank answers from its inspector thread within milliseconds; a cut-off one never does,
    // and each ask for it costs the whole wait.
    const std::vector<Position> pos = prober->ask(150);
    for (size_t r = 0; r < alive.size(); ++r) {
      const size_t p = numbers.empty() ? r : static_cast<size_t>(numbers[r]);
      if (p < pos.size()) alive[r] = liveness_of(pos[p]);
    }
    return alive;
  };
  return at.regroup(name, committed, answering, window, dl);
}

void confirm_members(Comm& made, Deadline dl) {
  const int32_t one = 1;
  std::vector<int32_t> all(static_cast<size_t>(made.size()), 0);
  made.allgather_host(&one, all.data(), sizeof one, dl);
}

// The join slots settled travel with the plan (a loss in the middle of an admission leaves ranks
// apart), and the agreed joiners still waiting are forgotten: the watches see them again and the
// next exchange agrees on them anew.
std::unique_ptr<Plan> agreed_plan(Comm& ctrl, const Plan* mine, const std::vector<GradSpec>& specs, const Settings& cfg,
                                  int64_t* admitted_upto, Deadline dl) {
  std::vector<int64_t> wire(3 + 2 * specs.size(), 0);
  if (ctrl.rank() == 0) {
    wire.back() = *admitted_upto;
    if (mine) {
      wire[0] = mine->learned ? 2 : 1;
      if (mine->learned) {
        const std::vector<int64_t> s = mine->serialize();
        std::copy(s.begin(), s.end(), wire.begin() + 1);
      }
    }
  }
  ctrl.broadcast_host(wire.data(), wire.size() * sizeof(int64_t), 0, dl);
  *admitted_upto = wire.back();
  wire.pop_back();
  if (wire[0] == 0) return nullptr;
  if (wire[0] == 1)
    return std::unique_ptr<Plan>(new Plan(registration_plan(specs, cfg.c.message_size, cfg.c.num_streams)));
  return std::unique_ptr<Plan>(new Plan(Plan::deserialize(wire.data() + 1, wire.size() - 1, specs, cfg.c.num_streams)));
}

}  // namespace ddp
