// Slurm's hostlists, as SLURM_JOB_NODELIST and SLURM_STEP_NODELIST give them: names separated by
// commas, each name made of literal text and bracketed lists of numbers and ranges, e.g.
// "node[01-04,07],gpu3" (node01 .. node04, node07, gpu3) or "rack[1-2]-n[08-10]" (every combination,
// the first bracket varying slowest: rack1-n08, rack1-n09, ... rack2-n10). A bound's digits give the
// width: "[01-04]" keeps the zero padding, "[8-10]" has none. A bracket inside a bracket, an empty
// name or bracket entry, a bound that is not a number or a range that runs backwards is refused with
// DDP_ERR_INVALID_ARGUMENT naming `what` (the variable), the list and the position.
#pragma once

#include <string>
#include <vector>

namespace ddp {

// Every name, in order; refused when the list holds more than kMaxHostlistNames.
constexpr size_t kMaxHostlistNames = 1000000;
std::vector<std::string> expand_hostlist(const std::string& list, const char* what);
// The first name alone (the whole list is checked; nothing is expanded).
std::string first_host(const std::string& list, const char* what);

}  // namespace ddp
