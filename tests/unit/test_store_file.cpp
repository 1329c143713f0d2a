// The file store (host/store_file.cpp) behind the Store interface: the same answers as the TCP store,
// get_many and watch by looking again, and a timeout that names the file it waited for.
#include <doctest.h>

#include <stdlib.h>

#include <cstdlib>
#include <thread>

#include "store_helpers.hpp"

using namespace store_test;

TEST_CASE("file store: set, get, claim, try_get, get_many and watch; a timeout names the missing file") {
  char d[] = "/tmp/ddp_store_XXXXXX";
  REQUIRE(mkdtemp(d));
  const std::string dir = d;
  auto st = ddp::open_file_store(dir);
  const ddp::Deadline dl = ddp::Deadline::after_ms(5000);
  std::vector<char> v, held;
  CHECK(!st->try_get("a/b", &v, dl));
  st->set("a/b", bytes("one"), dl);
  CHECK(text(st->get("a/b", dl, "rank 0")) == "one");
  CHECK(st->claim("c", bytes("first"), &held, dl));
  CHECK(!st->claim("c", bytes("second"), &held, dl));
  CHECK(text(held) == "first");
  const std::vector<std::vector<char>> all = st->get_many({"a/b", "c"}, dl, "rank 1");
  REQUIRE(all.size() == 2);
  CHECK(text(all[0]) == "one");
  CHECK(text(all[1]) == "first");

  ddp::Store::Seen seen;
  seen.set = true, seen.value = bytes("one");
  std::thread t([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ddp::open_file_store(dir)->set("a/b", bytes("two"), ddp::Deadline::after_ms(5000));
  });
  CHECK(st->wait_change("a/b", &seen, ddp::Deadline::after_ms(5000)));
  t.join();
  CHECK(text(seen.value) == "two");
  CHECK(!st->wait_change("a/b", &seen, ddp::Deadline::after_ms(100)));

  try {
    st->get("never", ddp::Deadline::after_ms(100), "rank 5");
    CHECK(false);
  } catch (const ddp::Error& e) {
    CHECK(e.status() == DDP_ERR_TIMEOUT);
    CHECK(std::string(e.what()).find("rank 5 never arrived (no file " + dir + "/never)") != std::string::npos);
  }
  for (const char* k : {"a/b", "c"}) st->erase(k);
  CHECK(!st->try_get("c", &v, dl));
  std::system(("rm -rf " + dir).c_str());
}
