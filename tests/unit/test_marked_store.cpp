// The marked store (host/marked_store.hpp), over the TCP store and the file store: its waits answer
// as the inner store's do, end with DDP_ERR_ABORTED naming who set the mark as soon as it is set
// (never waiting out the deadline), and keep the inner store's timeout when nobody sets it.
#include <doctest.h>

#include <stdlib.h>

#include <thread>

#include "host/marked_store.hpp"
#include "store_helpers.hpp"

using namespace store_test;

namespace {

void check_marked(ddp::Store& inner) {
  ddp::MarkedStore st(inner, "m/abandoned");
  const ddp::Deadline dl = ddp::Deadline::after_ms(10000);
  inner.set("m/a", bytes("one"), dl);
  CHECK(text(st.get("m/a", dl, "rank 0")) == "one");
  // get_many waits for a key set later, and returns the values in order
  std::thread later([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    inner.set("m/b", bytes("two"), dl);
  });
  const std::vector<std::vector<char>> both = st.get_many({"m/a", "m/b"}, dl, "rank 1");
  later.join();
  REQUIRE(both.size() == 2);
  CHECK(text(both[0]) == "one");
  CHECK(text(both[1]) == "two");
  // nobody sets the key or the mark: the inner store's timeout, naming who
  Thrown t = thrown([&] { st.get("m/never", ddp::Deadline::after_ms(200), "rank 7"); });
  CHECK(t.status == DDP_ERR_TIMEOUT);
  CHECK(t.message.find("rank 7") != std::string::npos);
  // the mark set while a wait is under way: it ends at once, long before its deadline
  const auto t0 = std::chrono::steady_clock::now();
  std::thread giver([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ddp::MarkedStore::mark(inner, "m/abandoned", "rank 2 of the new membership");
  });
  t = thrown([&] {
    st.wait({"m/a", "m/never"}, ddp::Deadline::after_ms(20000), [](const std::string&) { return "x"; });
  });
  giver.join();
  CHECK(t.status == DDP_ERR_ABORTED);
  CHECK(t.message ==
        "rank 2 of the new membership gave up on this membership (a member was lost while it was being "
        "formed)");
  CHECK(seconds_since(t0) < 5.0);
  // and a wait that starts after it fails without waiting, even for a key that is there
  t = thrown([&] { st.get("m/a", ddp::Deadline::after_ms(20000), "rank 0"); });
  CHECK(t.status == DDP_ERR_ABORTED);
  // what is not a wait goes straight through
  std::vector<char> v;
  CHECK(st.try_get("m/a", &v, dl));
  CHECK(text(v) == "one");
  st.set("m/c", bytes("three"), dl);
  CHECK(inner.try_get("m/c", &v, dl));
  // an empty mark key marks nothing
  ddp::MarkedStore::mark(inner, "", "nobody");
}

}  // namespace

TEST_CASE("marked store over TCP: waits end when the mark is set, and only then early") {
  ddp::StoreServer server(0);
  auto inner = client(server.port());
  check_marked(*inner);
}

TEST_CASE("marked store over files: waits end when the mark is set, and only then early") {
  char d[] = "/tmp/ddp_marked_XXXXXX";
  REQUIRE(mkdtemp(d));
  auto inner = ddp::open_file_store(d);
  check_marked(*inner);
  std::system((std::string("rm -rf ") + d).c_str());
}
