#include "core/join_protocol.hpp"

#include <unistd.h>

#include <chrono>
#include <cinttypes>
#include <cstdio>

#include "core/common.hpp"

namespace ddp {

namespace {
// "ddp-join 1 CONFIG REGISTRATIONS NUM_GRADS HOOK PID HOST GIVE_UP_UNIX_MS"
constexpr const char* kHead = "ddp-join 1";
constexpr size_t kHeadLen = 10;

int64_t unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}
}  // namespace

JoinRequest JoinRequest::of_this_process(const JoinTerms& terms, int64_t wait_ms) {
  JoinRequest r;
  r.terms = terms;
  r.pid = static_cast<int64_t>(::getpid());
  char host[256] = "";
  ::gethostname(host, sizeof host - 1);
  r.host = host[0] ? host : "?";
  r.give_up_unix_ms = wait_ms > 0 && wait_ms < INT64_MAX / 4 ? unix_ms() + wait_ms : 0;
  return r;
}

std::string encode(const JoinRequest& r) {
  return format("%s %016" PRIx64 " %016" PRIx64 " %" PRId64 " %d %" PRId64 " %s %" PRId64, kHead, r.terms.config,
                r.terms.registrations, r.terms.num_grads, r.terms.hook, r.pid, r.host.c_str(), r.give_up_unix_ms);
}

bool decode(const std::string& bytes, JoinRequest* r) {
  char host[256] = "";
  if (bytes.compare(0, kHeadLen, kHead) != 0 ||
      std::sscanf(bytes.c_str() + kHeadLen, " %" SCNx64 " %" SCNx64 " %" SCNd64 " %d %" SCNd64 " %255s %" SCNd64,
                  &r->terms.config, &r->terms.registrations, &r->terms.num_grads, &r->terms.hook, &r->pid, host,
                  &r->give_up_unix_ms) != 7)
    return false;
  r->host = host;
  return true;
}

JoinAnswer JoinAnswer::admitted(const std::string& meet, int rank, int world, const std::string& note) {
  return JoinAnswer{Kind::Admitted, meet, rank, world, note, ""};
}

JoinAnswer JoinAnswer::refused(const std::string& why) { return JoinAnswer{Kind::Refused, "", -1, 0, "", why}; }

// One letter for the kind, then its fields: "A<meet> <rank> <world> <note>", "R<why>", "S", "E".
std::string encode(const JoinAnswer& a) {
  const char k = static_cast<char>(a.kind);
  switch (a.kind) {
    case JoinAnswer::Kind::Admitted: return format("%c%s %d %d %s", k, a.meet.c_str(), a.rank, a.world, a.note.c_str());
    case JoinAnswer::Kind::Refused: return std::string(1, k) + a.why;
    default: return std::string(1, k);
  }
}

bool decode(const std::string& bytes, JoinAnswer* a) {
  if (bytes.empty()) return false;
  *a = JoinAnswer();
  switch (bytes[0]) {
    case 'A': {
      char meet[512] = "";
      int used = 0;
      if (std::sscanf(bytes.c_str() + 1, "%511s %d %d %n", meet, &a->rank, &a->world, &used) != 3 || a->rank < 0 ||
          a->rank >= a->world)
        return false;
      a->kind = JoinAnswer::Kind::Admitted;
      a->meet = meet;
      a->note = bytes.substr(1 + static_cast<size_t>(used));
      return true;
    }
    case 'R':
      a->kind = JoinAnswer::Kind::Refused;
      a->why = bytes.substr(1);
      return true;
    case 'S': a->kind = JoinAnswer::Kind::PassedOver; return bytes.size() == 1;
    case 'E': a->kind = JoinAnswer::Kind::JobEnded; return bytes.size() == 1;
  }
  return false;
}

std::string refuse_join(const std::string& request, const JoinTerms& job, bool* expired) {
  *expired = false;
  JoinRequest r;
  if (!decode(request, &r))
    return "its request is not one this version of libddp understands: '" + request.substr(0, 80) + "'";
  const JoinTerms& t = r.terms;
  const std::string who = format("the joiner (pid %lld on %s)", static_cast<long long>(r.pid), r.host.c_str());
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
  // Its own bound, read on this host's clock with a second to spare for the admission itself.
  *expired = r.give_up_unix_ms > 0 && r.give_up_unix_ms < unix_ms() + 1000;
  return "";
}

}  // namespace ddp
