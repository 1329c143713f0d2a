// The rendezvous: the init methods that name a store ("env://", "tcp://HOST:PORT", "file:///DIR")
// and the ranks' arrival through it (host/rendezvous.hpp).
#include "host/rendezvous.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>

#include "core/knobs.hpp"
#include "core/log.hpp"
#include "host/launcher_env.hpp"
#include "host/store_tcp.hpp"

namespace ddp {

namespace {

int parse_int(const char* text, const char* what, const char* hint) {
  if (!text || !*text) fail(DDP_ERR_INVALID_ARGUMENT, "%s is not set%s", what, hint);
  char* end = nullptr;
  const long v = std::strtol(text, &end, 10);
  if (*end || v < 0 || v > 1 << 30) fail(DDP_ERR_INVALID_ARGUMENT, "%s='%s' is not a non-negative integer", what, text);
  return static_cast<int>(v);
}

constexpr const char* kEnvHint =
    " (env:// reads MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE, as torchrun sets them; or pass "
    "tcp://HOST:PORT or file:///DIR with the rank and size)";

// Rank 0 serves the store unless a process of its own does (tools/ddp_store).
std::shared_ptr<Store> open_tcp(const std::string& host, int port, int rank, Deadline dl, std::string* local) {
  const bool serve = rank == 0 && !knobs::store_external();
  return open_tcp_store(host, port, serve, rank >= 0 ? "rank " + std::to_string(rank) : "a joining rank", dl, local);
}

void split_host_port(const std::string& hp, std::string* host, int* port) {
  const size_t colon = hp.rfind(':');
  if (colon == std::string::npos || colon == 0)
    fail(DDP_ERR_INVALID_ARGUMENT, "init method 'tcp://%s': expected tcp://HOST:PORT", hp.c_str());
  *host = hp.substr(0, colon);
  if (host->size() > 2 && host->front() == '[' && host->back() == ']') *host = host->substr(1, host->size() - 2);
  int64_t p = 0;
  if (!knobs::parse_integer(hp.c_str() + colon + 1, 1, 65535, &p))
    fail(DDP_ERR_INVALID_ARGUMENT,
         "init method 'tcp://%s': the port '%s' is not a port: expected an integer in 1..65535", hp.c_str(),
         hp.c_str() + colon + 1);
  *port = static_cast<int>(p);
}

// `joining`: a rank that joins a running job (rank -1; never serves a TCP store).
Rendezvous open_store(const char* init_method, int rank, int size, Deadline dl, bool joining = false);

}  // namespace

int env_store_port(int master_port) { return knobs::store_port(master_port); }

Rendezvous open_rendezvous(const char* init_method, int rank, int size, Deadline dl) {
  return open_rendezvous(init_method, rank, size, dl, knobs::job_id());
}

Rendezvous open_rendezvous(const char* init_method, int rank, int size, Deadline dl, const std::string& job) {
  Rendezvous rv = open_store(init_method, rank, size, dl);
  join_rendezvous(rv, job, dl);
  return rv;
}

Rendezvous open_joining_store(const char* init_method, Deadline dl) { return open_store(init_method, -1, 0, dl, true); }

namespace {

Rendezvous open_store(const char* init_method, int rank, int size, Deadline dl, bool joining) {
  std::string m = init_method && *init_method ? init_method : "env://";
  std::string launcher;  // "auto", or env:// without RANK and WORLD_SIZE: tcp:// from the launcher's variables
  m = resolve_launcher_method(m, &rank, &size, joining, &launcher);
  Rendezvous rv;
  if (joining) {
    rv.rank = -1, rv.size = 0;
  } else {
    rv.rank = rank >= 0 ? rank : parse_int(std::getenv("RANK"), "RANK", kEnvHint);
    rv.size = size >= 0 ? size : parse_int(std::getenv("WORLD_SIZE"), "WORLD_SIZE", kEnvHint);
    if (rv.size < 1 || rv.rank >= rv.size)
      fail(DDP_ERR_INVALID_ARGUMENT, "rank %d of a world of %d: the rank must lie in 0..size-1", rv.rank, rv.size);
  }
  if (m == "env://") {
    const char* addr = std::getenv("MASTER_ADDR");
    if (!addr || !*addr) fail(DDP_ERR_INVALID_ARGUMENT, "MASTER_ADDR is not set%s", kEnvHint);
    const char* master_port = std::getenv("MASTER_PORT");
    if (!master_port || !*master_port) fail(DDP_ERR_INVALID_ARGUMENT, "MASTER_PORT is not set%s", kEnvHint);
    const int port = env_store_port(knobs::port("MASTER_PORT", master_port));
    rv.store = open_tcp(addr, port, rv.rank, dl, &rv.host);
    rv.describe = "env:// (" + std::string(addr) + ":" + std::to_string(port) + ")";
  } else if (m.compare(0, 6, "tcp://") == 0) {
    std::string host;
    int port = 0;
    split_host_port(m.substr(6), &host, &port);
    rv.store = open_tcp(host, port, rv.rank, dl, &rv.host);
    rv.describe = m;
  } else if (m.compare(0, 7, "file://") == 0 && m.size() > 7) {
    const std::string dir = m.substr(7);
    struct stat st;
    if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
      fail(DDP_ERR_INVALID_ARGUMENT,
           "init method '%s': %s is not a directory (make it first, empty, on a file system "
           "every rank sees)",
           m.c_str(), dir.c_str());
    rv.store = open_file_store(dir);
    rv.describe = m;
  } else {
    fail(DDP_ERR_INVALID_ARGUMENT, "unknown init method '%s': expected env://, auto, tcp://HOST:PORT or file:///DIR",
         m.c_str());
  }
  if (!launcher.empty()) rv.describe = launcher;
  return rv;
}

// --- The arrival (join_rendezvous) ---
// rank 0 claims kJobKey with its arrival (the job's id and WORLD_SIZE); every other rank reads it,
// checks its own against it and claims its rank's key; rank 0 watches those keys, and the refusals and
// strays, until every rank arrived, then sets the verdict every rank waits for: 'K' (go on), or 'M'
// (refused) or 'T' (timed out) and the message.
constexpr const char* kJobKey = "ddp/job";
constexpr const char* kVerdictKey = "ddp/verdict";
constexpr const char* kRefusedKey = "ddp/refused";  // the first refusal a rank met, for rank 0
constexpr int kStraySlots = 16;                     // ranks of other jobs, for rank 0's warning

std::string arrive_key(int r) { return "ddp/arrive/" + std::to_string(r); }
std::string stray_key(int i) { return "ddp/stray/" + std::to_string(i); }
std::vector<char> bytes(const std::string& s) { return std::vector<char>(s.begin(), s.end()); }

struct Arrival {
  int rank = -1, world = 0;
  long pid = 0;
  std::string host, job;
};

std::vector<char> encode(const Arrival& a) {
  return bytes(format("%d\n%d\n%ld\n%s\n", a.rank, a.world, a.pid, a.host.c_str()) + a.job);
}

Arrival decode(const std::vector<char>& v) {
  const std::string s(v.begin(), v.end());
  size_t at = 0;
  auto field = [&] {
    const size_t nl = std::min(s.find('\n', at), s.size());
    std::string f = s.substr(at, nl - at);
    at = std::min(nl + 1, s.size());
    return f;
  };
  Arrival a;
  a.rank = std::atoi(field().c_str());
  a.world = std::atoi(field().c_str());
  a.pid = std::atol(field().c_str());
  a.host = field();
  a.job = s.substr(at);
  return a;
}

std::string job_name(const std::string& job) { return job.empty() ? "no job id" : "job '" + job + "'"; }

// "rank 2 (job 'x', WORLD_SIZE=4, host h, pid 12)"
std::string who(const Arrival& a) {
  return format("rank %d (%s, WORLD_SIZE=%d, host %s, pid %ld)", a.rank, job_name(a.job).c_str(), a.world,
                a.host.c_str(), a.pid);
}

Arrival this_rank(const Rendezvous& rv, const std::string& job) {
  Arrival a;
  a.rank = rv.rank;
  a.world = rv.size;
  a.pid = static_cast<long>(::getpid());
  char h[256] = "";
  ::gethostname(h, sizeof h - 1);
  a.host = h;
  a.job = job;
  return a;
}

// "rank 2", "ranks 1-3, 7"
std::string rank_list(const std::vector<int>& rs) {
  std::string out;
  for (size_t i = 0; i < rs.size();) {
    size_t j = i;
    while (j + 1 < rs.size() && rs[j + 1] == rs[j] + 1) ++j;
    out += (out.empty() ? "" : ", ") + std::to_string(rs[i]) + (j > i ? "-" + std::to_string(rs[j]) : "");
    i = j + 1;
  }
  return (rs.size() == 1 ? "rank " : "ranks ") + out;
}

// A refusal met by a rank other than 0: told to rank 0 (which refuses the whole rendezvous), then thrown.
[[noreturn]] void refuse(Store& st, const std::string& why, Deadline dl) {
  std::vector<char> held;
  try {
    st.claim(kRefusedKey, bytes(why), &held, dl);
  } catch (const Error&) {
  }
  fail(DDP_ERR_MISMATCH, "%s", why.c_str());
}

// A rank of another job: refused, and named to rank 0, which warns and goes on waiting for its own.
[[noreturn]] void refuse_stray(Store& st, const Rendezvous& rv, const Arrival& mine, const Arrival& owner,
                               Deadline dl) {
  const std::string why = format(
      "%s reached the rendezvous at %s, which belongs to %s (rank 0 is %s): refused; two jobs meet at one "
      "address (give each job its own MASTER_PORT or init method)",
      who(mine).c_str(), rv.describe.c_str(), job_name(owner.job).c_str(), who(owner).c_str());
  std::vector<char> held;
  try {
    for (int i = 0; i < kStraySlots && !st.claim(stray_key(i), bytes(why), &held, dl); ++i) {
    }
  } catch (const Error&) {
  }
  fail(DDP_ERR_MISMATCH, "%s", why.c_str());
}

[[noreturn]] void fail_verdict(const std::string& verdict, int rank) {
  fail(verdict[0] == 'T' ? DDP_ERR_TIMEOUT : DDP_ERR_MISMATCH, "rank %d: %s", rank, verdict.c_str() + 1);
}

void join_as_member(const Rendezvous& rv, const Arrival& mine, Deadline dl) {
  Store& st = *rv.store;
  const Arrival owner = decode(st.get(kJobKey, dl, "rank 0"));
  if (owner.job != mine.job) refuse_stray(st, rv, mine, owner, dl);
  if (owner.world != mine.world)
    refuse(st,
           format("the rendezvous at %s: WORLD_SIZE differs between ranks: rank 0 has WORLD_SIZE=%d (%s), rank %d has "
                  "WORLD_SIZE=%d (%s)%s; start every rank with the same WORLD_SIZE",
                  rv.describe.c_str(), owner.world, who(owner).c_str(), mine.rank, mine.world, who(mine).c_str(),
                  mine.rank >= owner.world ? format(", a rank beyond rank 0's world of %d", owner.world).c_str() : ""),
           dl);
  std::vector<char> held;
  if (!st.claim(arrive_key(mine.rank), encode(mine), &held, dl))
    refuse(st,
           format("the rendezvous at %s: rank %d is claimed twice: by %s, which arrived first, and by %s; every "
                  "process needs a rank of its own",
                  rv.describe.c_str(), mine.rank, who(decode(held)).c_str(), who(mine).c_str()),
           dl);
  const std::vector<char> v = st.get(kVerdictKey, dl, "one of the other ranks (rank 0's message names which)");
  const std::string verdict(v.begin(), v.end());
  if (verdict.empty() || verdict[0] != 'K') fail_verdict(verdict.empty() ? "M(empty verdict)" : verdict, mine.rank);
}

// Rank 0's view of the arrival.
struct Waiting {
  std::vector<bool> arrived;
  int count = 1, strays = 0;
  Deadline::Clock::time_point t0 = Deadline::Clock::now();
  int64_t next_progress_ms = 0;
  std::vector<int> missing() const {
    std::vector<int> m;
    for (size_t r = 0; r < arrived.size(); ++r)
      if (!arrived[r]) m.push_back(static_cast<int>(r));
    return m;
  }
  int64_t waited_ms() const {
    return std::chrono::duration_cast<std::chrono::milliseconds>(Deadline::Clock::now() - t0).count();
  }
};

// Waits until one of the keys rank 0 follows changes (a rank's arrival, a stray, a refusal) or until
// the next progress line is due, and takes in what came; a refusal's text in *refused. The store answers
// when a key is set (a file store is looked at every 10 ms).
void await_arrivals(Store& st, const Rendezvous& rv, Waiting& w, Deadline dl, std::string* refused) {
  std::vector<std::string> keys{kRefusedKey};
  std::vector<int> ranks{-1};  // of each key: a rank's arrival, -1 the refusal, -2 the next stray
  for (int r = 1; r < rv.size; ++r)
    if (!w.arrived[static_cast<size_t>(r)]) keys.push_back(arrive_key(r)), ranks.push_back(r);
  if (w.strays < kStraySlots) keys.push_back(stray_key(w.strays)), ranks.push_back(-2);
  const int64_t every = knobs::init_progress_ms();
  const Deadline until =
      every > 0
          ? Deadline::earlier(dl, Deadline::after_ms(std::max<int64_t>(1, w.next_progress_ms + every - w.waited_ms())))
          : dl;
  std::vector<Store::Seen> seen(keys.size());
  if (!st.watch(keys, &seen, until)) return;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!seen[i].set) continue;
    const std::string v(seen[i].value.begin(), seen[i].value.end());
    if (ranks[i] == -1) *refused = v;
    if (ranks[i] == -2) ++w.strays, log(DDP_LOG_WARN, "a rank of another job was turned away: %s", v.c_str());
    if (ranks[i] >= 0) w.arrived[static_cast<size_t>(ranks[i])] = true, ++w.count;
  }
}

std::string seconds(int64_t ms) {
  return ms < 10000 ? format("%.1f s", static_cast<double>(ms) / 1000) : format("%lld s", (long long)(ms + 500) / 1000);
}

// Every DDP_INIT_PROGRESS_MS: who is still missing, through the log (a warning: seen by default).
void report_progress(const Rendezvous& rv, Waiting& w, Deadline dl) {
  const int64_t every = knobs::init_progress_ms(), waited = w.waited_ms();
  if (every <= 0 || waited < w.next_progress_ms + every) return;
  w.next_progress_ms = waited - waited % every;
  const std::string bound =
      dl.infinite() ? "no bound"
                    : "of " + seconds(std::chrono::duration_cast<std::chrono::milliseconds>(dl.at() - w.t0).count());
  log(DDP_LOG_WARN, "waiting for ranks at %s: %d of %d arrived; missing %s (waited %s %s)", rv.describe.c_str(),
      w.count, rv.size, rank_list(w.missing()).c_str(), seconds(waited).c_str(), bound.c_str());
}

[[noreturn]] void give_verdict(Store& st, char kind, const std::string& why, Deadline dl) {
  try {
    st.set(kVerdictKey, bytes(std::string(1, kind) + why), dl);
  } catch (const Error&) {
  }
  fail(kind == 'T' ? DDP_ERR_TIMEOUT : DDP_ERR_MISMATCH, "rank 0: %s", why.c_str());
}

void join_as_owner(const Rendezvous& rv, const Arrival& mine, Deadline dl) {
  Store& st = *rv.store;
  std::vector<char> held;
  if (!st.claim(kJobKey, encode(mine), &held, dl))
    fail(DDP_ERR_MISMATCH,
         "the rendezvous at %s: rank 0 is claimed twice: by %s, which arrived first, and by %s (a rendezvous "
         "directory must be empty when a job starts)",
         rv.describe.c_str(), who(decode(held)).c_str(), who(mine).c_str());
  Waiting w;
  w.arrived.assign(static_cast<size_t>(rv.size), false);
  w.arrived[0] = true;
  for (;;) {
    std::string refused;
    await_arrivals(st, rv, w, dl, &refused);
    if (!refused.empty()) give_verdict(st, 'M', refused + " (the rendezvous is refused on every rank)", dl);
    if (w.count == rv.size) break;
    if (dl.passed())
      give_verdict(st, 'T',
                   format("the rendezvous at %s did not complete before the timeout: %s never arrived (%d of %d "
                          "arrived)",
                          rv.describe.c_str(), rank_list(w.missing()).c_str(), w.count, rv.size),
                   dl);
    report_progress(rv, w, dl);
  }
  st.set(kVerdictKey, bytes("K"), dl);
}

}  // namespace

void join_rendezvous(const Rendezvous& rv, const std::string& job, Deadline dl) {
  const Arrival mine = this_rank(rv, job);
  if (rv.rank == 0)
    join_as_owner(rv, mine, dl);
  else
    join_as_member(rv, mine, dl);
}

void settle_rendezvous(const Rendezvous& rv) {
  if (rv.rank != 0) return;
  Store& st = *rv.store;
  for (const std::string& k : {std::string(kJobKey), std::string(kVerdictKey), std::string(kRefusedKey)}) st.erase(k);
  for (int r = 1; r < rv.size; ++r) st.erase(arrive_key(r));
  for (int i = 0; i < kStraySlots; ++i) st.erase(stray_key(i));
}

}  // namespace ddp
