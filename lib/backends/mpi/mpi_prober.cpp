// The stall inspector's exchange over MPI: a responder thread per prober answers the other ranks'
// queries, and an ask waits a bounded time for their answers, so that a dead rank is "no answer".
#include "backends/mpi/mpi_prober.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "backends/mpi/mpi_runtime.hpp"
#include "host/host_device.hpp"

namespace ddp {
namespace mpi {

namespace {

// The stall inspector's exchange (see Prober): a communicator of its own; a thread that answers
// queries, polling MPI_Iprobe every 2 ms (no blocking MPI wait can be stopped); and asks that post
// nonblocking sends and receives and wait at most wait_ms, so that a dead rank is simply "no
// answer". Messages that may never complete are left posted, their buffers kept until exit.
class MpiProber final : public Prober {
 public:
  MpiProber(MPI_Comm c, std::function<Position()> mine) : comm_(c), mine_(std::move(mine)) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    if (size_ < 2) return;
    Responders& r = responders();
    std::lock_guard<std::mutex> lock(r.mu);
    responder_ = std::thread([this] { serve(); });
    r.stops.push_back(&stop_and_join_);
  }
  ~MpiProber() override {
    {
      Responders& r = responders();
      std::lock_guard<std::mutex> lock(r.mu);
      r.stops.erase(std::remove(r.stops.begin(), r.stops.end(), &stop_and_join_), r.stops.end());
      stop_and_join_();
    }
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && !left_posted_) MPI_Comm_free(&comm_);
  }

  std::vector<Position> ask(int64_t wait_ms) override {
    std::vector<Position> out(static_cast<size_t>(size_));
    out[static_cast<size_t>(rank_)] = mine_();
    if (size_ == 1) return out;
    const uint64_t seq = ++seq_;
    auto query = std::make_shared<uint64_t>(seq);
    auto answers = std::make_shared<std::vector<Answer>>(static_cast<size_t>(size_));
    std::vector<MPI_Request> sends(static_cast<size_t>(size_), MPI_REQUEST_NULL);
    std::vector<MPI_Request> recvs(static_cast<size_t>(size_), MPI_REQUEST_NULL);
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      MPI_Irecv(&(*answers)[static_cast<size_t>(r)], sizeof(Answer), MPI_BYTE, r, kAnswer, comm_,
                &recvs[static_cast<size_t>(r)]);
      MPI_Isend(query.get(), 1, MPI_UINT64_T, r, kQuery, comm_, &sends[static_cast<size_t>(r)]);
    }
    const Deadline dl = Deadline::after_ms(std::max<int64_t>(1, wait_ms));
    for (int open = size_ - 1; open > 0 && !dl.passed();) {
      open = 0;
      for (int r = 0; r < size_; ++r) {
        MPI_Request& q = recvs[static_cast<size_t>(r)];
        if (q == MPI_REQUEST_NULL) continue;
        int done = 0;
        if (MPI_Test(&q, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
          q = MPI_REQUEST_NULL;  // an error: no answer from this rank
          continue;
        }
        Answer& a = (*answers)[static_cast<size_t>(r)];
        if (done && a.seq == seq) {
          out[static_cast<size_t>(r)] = a.pos;
        } else if (done) {  // a late answer to an earlier ask: wait for this one's
          MPI_Irecv(&a, sizeof(Answer), MPI_BYTE, r, kAnswer, comm_, &q);
          ++open;
        } else {
          ++open;
        }
      }
      if (open) std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
    bool posted = false;
    for (MPI_Request& q : recvs)
      if (q != MPI_REQUEST_NULL) {
        MPI_Cancel(&q);
        MPI_Request_free(&q);
        posted = true;
      }
    for (MPI_Request& q : sends) {
      int done = 0;
      if (q != MPI_REQUEST_NULL && (MPI_Test(&q, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || !done)) {
        MPI_Request_free(&q);
        posted = true;
      }
    }
    if (posted) {
      left_posted_ = true;
      host::keep_until_exit(query);
      host::keep_until_exit(answers);
    }
    return out;
  }

 private:
  struct Answer {
    uint64_t seq;
    Position pos;
  };
  static constexpr int kQuery = 1, kAnswer = 2;

  void serve() {
    name_this_thread("ddp-inspector");
    while (!stop_) {
      int flag = 0;
      MPI_Status st;
      if (MPI_Iprobe(MPI_ANY_SOURCE, kQuery, comm_, &flag, &st) != MPI_SUCCESS) return;
      if (!flag) {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        continue;
      }
      uint64_t seq = 0;
      if (MPI_Recv(&seq, 1, MPI_UINT64_T, st.MPI_SOURCE, kQuery, comm_, MPI_STATUS_IGNORE) != MPI_SUCCESS) return;
      auto a = std::make_shared<Answer>(Answer{seq, mine_()});
      MPI_Request req;
      if (MPI_Isend(a.get(), sizeof(Answer), MPI_BYTE, st.MPI_SOURCE, kAnswer, comm_, &req) != MPI_SUCCESS) continue;
      int done = 0;
      for (int i = 0; i < 100 && !done && !stop_; ++i) {
        MPI_Test(&req, &done, MPI_STATUS_IGNORE);
        if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (!done) {  // the asker is gone: leave the answer posted
        MPI_Request_free(&req);
        left_posted_ = true;
        host::keep_until_exit(a);
      }
    }
  }

  MPI_Comm comm_;
  std::function<Position()> mine_;
  int rank_ = 0, size_ = 1;
  uint64_t seq_ = 0;
  std::atomic<bool> stop_{false}, left_posted_{false};
  std::thread responder_;
  // Called under responders().mu, by the destructor or by MPI_Finalize (on_finalize).
  std::function<void()> stop_and_join_ = [this] {
    stop_ = true;
    if (responder_.joinable()) responder_.join();
  };
};

}  // namespace

std::unique_ptr<Prober> make_prober(MPI_Comm c, std::function<Position()> mine) {
  return std::unique_ptr<Prober>(new MpiProber(c, std::move(mine)));
}

}  // namespace mpi
}  // namespace ddp
