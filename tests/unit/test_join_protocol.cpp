// The join protocol (core/join_protocol.hpp): every request and answer survives its encoding, bytes
// that are no request or answer of this version are told apart, and the job's refusals name what
// differs.
#include <doctest.h>

#include <chrono>
#include <string>

#include "core/join_protocol.hpp"

using namespace ddp;

TEST_CASE("join protocol: a request and every kind of answer survive their encoding") {
  JoinTerms t;
  t.config = 0x0123456789abcdefull;
  t.registrations = 0xfedcba9876543210ull;
  t.num_grads = 4711;
  t.hook = 1;
  const JoinRequest r = JoinRequest::of_this_process(t, 20000);
  JoinRequest back;
  REQUIRE(decode(encode(r), &back));
  CHECK(back.terms.config == t.config);
  CHECK(back.terms.registrations == t.registrations);
  CHECK(back.terms.num_grads == t.num_grads);
  CHECK(back.terms.hook == t.hook);
  CHECK(back.pid == r.pid);
  CHECK(back.host == r.host);
  CHECK(back.give_up_unix_ms == r.give_up_unix_ms);
  CHECK(JoinRequest::of_this_process(t, 0).give_up_unix_ms == 0);  // waits forever

  const JoinAnswer answers[] = {JoinAnswer::admitted("c0.e3.j2.1", 4, 6, "3"), JoinAnswer::refused("why not"),
                                JoinAnswer::passed_over(), JoinAnswer::job_ended()};
  for (const JoinAnswer& a : answers) {
    JoinAnswer b;
    REQUIRE(decode(encode(a), &b));
    CHECK(b.kind == a.kind);
    CHECK(b.meet == a.meet);
    CHECK(b.rank == a.rank);
    CHECK(b.world == a.world);
    CHECK(b.note == a.note);
    CHECK(b.why == a.why);
  }
}

TEST_CASE("join protocol: bytes that are no request or answer of this version are told apart") {
  JoinRequest r;
  CHECK_FALSE(decode(std::string("ddp-join 2 0 0 0 0 1 h 0"), &r));
  CHECK_FALSE(decode(std::string("ddp-join 1 00 11"), &r));
  CHECK_FALSE(decode(std::string(""), &r));
  JoinAnswer a;
  CHECK_FALSE(decode(std::string(""), &a));
  CHECK_FALSE(decode(std::string("X"), &a));
  CHECK_FALSE(decode(std::string("Akey 3 3 note"), &a));  // rank out of its world
  CHECK_FALSE(decode(std::string("Akey three 4"), &a));
  CHECK_FALSE(decode(std::string("Sextra"), &a));
  bool expired = true;
  CHECK(refuse_join("hello", JoinTerms(), &expired).find("not one this version of libddp understands") !=
        std::string::npos);
  CHECK_FALSE(expired);
}

TEST_CASE("join protocol: the job refuses a joiner whose terms differ, naming what, and sees one that gave up") {
  JoinTerms job;
  job.config = 1, job.registrations = 2, job.num_grads = 3, job.hook = 0;
  auto refusal = [&](JoinTerms t, int64_t wait_ms, bool* expired) {
    return refuse_join(encode(JoinRequest::of_this_process(t, wait_ms)), job, expired);
  };
  bool expired = false;
  CHECK(refusal(job, 60000, &expired).empty());
  CHECK_FALSE(expired);
  JoinTerms t = job;
  t.config = 9;
  CHECK(refusal(t, 0, &expired).find("differs from the job in its config") != std::string::npos);
  t = job;
  t.num_grads = 5;
  CHECK(refusal(t, 0, &expired).find("registered 5 grads, the job 3") != std::string::npos);
  t = job;
  t.registrations = 7;
  CHECK(refusal(t, 0, &expired).find("registered grads that differ") != std::string::npos);
  t = job;
  t.hook = 1;
  CHECK(refusal(t, 0, &expired).find("set a comm hook and the job has none") != std::string::npos);
  // A joiner whose own bound ends within the second the admission needs has stopped waiting.
  CHECK(refusal(job, 500, &expired).empty());
  CHECK(expired);
}
