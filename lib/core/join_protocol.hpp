// The join protocol of elastic jobs (docs/design.md, "Elastic membership"): what a joiner asks for
// and what the job answers, each a struct with one encoding and one decoding (the job's store
// carries them as bytes under the join slots, backends/gloo), and the bound both sides keep while an
// admitted joiner arrives. Nothing else reads or writes these bytes.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace ddp {

// An admitted joiner comes at once (it waits for its answer): the ranks of the job wait this long for
// every joiner of an admission to arrive, then go on without them (a joiner that died on its way
// in); an admitted joiner gives the job as long, plus the store's round trips, before it asks again.
constexpr int64_t kJoinArriveMs = 10000;
constexpr int64_t kJoinArriveSlackMs = 5000;

// What a rank that joins a running elastic job must share with it (checked before it is admitted):
// a digest of what the config agreement compares, and what the registration agreement compares
// (core/agreement.hpp, join_terms).
struct JoinTerms {
  uint64_t config = 0, registrations = 0;
  int64_t num_grads = 0;
  int32_t hook = 0;
};

// A joiner's request, filed in a join slot.
struct JoinRequest {
  JoinTerms terms;
  int64_t pid = 0;
  std::string host;             // the joiner's host name (for messages)
  int64_t give_up_unix_ms = 0;  // when it stops waiting, on its host's clock (0: never)
  // This process's request with `terms` and the bound `wait_ms` from now (0: never).
  static JoinRequest of_this_process(const JoinTerms& terms, int64_t wait_ms);
};
std::string encode(const JoinRequest& r);
// False when `bytes` is not a request this version of libddp understands.
bool decode(const std::string& bytes, JoinRequest* r);

// The job's answer in a join slot.
struct JoinAnswer {
  enum class Kind : char {
    Admitted = 'A',    // meet the job at `meet` as rank `rank` of `world`; `note` is the job's
    Refused = 'R',     // `why`: the job cannot take this joiner (its terms differ)
    PassedOver = 'S',  // its heartbeat stood still when the job admitted: ask again
    JobEnded = 'E',    // the job ended before admitting it (settled so by the joiner itself)
  };
  Kind kind = Kind::Refused;
  std::string meet;  // Admitted: the key the new membership's communicator meets under
  int rank = -1, world = 0;
  std::string note;  // Admitted: what the admitting rank adds (the membership's epoch)
  std::string why;   // Refused
  static JoinAnswer admitted(const std::string& meet, int rank, int world, const std::string& note);
  static JoinAnswer refused(const std::string& why);
  static JoinAnswer passed_over() { return JoinAnswer{Kind::PassedOver, "", -1, 0, "", ""}; }
  static JoinAnswer job_ended() { return JoinAnswer{Kind::JobEnded, "", -1, 0, "", ""}; }
};
std::string encode(const JoinAnswer& a);
// False when `bytes` is no answer this version understands.
bool decode(const std::string& bytes, JoinAnswer* a);

// "" when the joiner of `request` may be admitted into a job of these terms; else why not, in words
// that the joiner shows as the job's refusal. *expired: the joiner has stopped waiting (not refused).
std::string refuse_join(const std::string& request, const JoinTerms& job, bool* expired);

}  // namespace ddp
