"""Every rank reduces numpy grads through libddp and checks them against a float64 reference computed
from every rank's data. Prints one line per scenario; exits 1 on any failure. Run under mpirun (Comm.mpi)
or, with LIBDDP_TEST_GLOO=METHOD (env://, tcp://..., file:///...), under any launcher (Comm.gloo)."""
import os
import sys

import numpy as np

import libddp
from libddp import DDP, Comm

gloo = os.environ.get("LIBDDP_TEST_GLOO")
comm = Comm.gloo(gloo) if gloo else Comm.mpi()
rank, world = comm.rank, comm.size
failures = []


def data(seed, r, n, dtype):
    return np.random.default_rng([seed, r, n]).standard_normal(n).astype(dtype)


def reference(seed, n, dtype, scale):
    return sum(data(seed, r, n, dtype).astype(np.float64) for r in range(world)) * scale


def close(got, want, dtype):
    tol = 1e-6 if dtype == np.float32 else 1e-12
    return np.allclose(got.astype(np.float64), want, rtol=tol, atol=tol * np.abs(want).max())


def scenario(fn):
    try:
        fn()
        print("rank %d: %s ok" % (rank, fn.__name__), flush=True)
    except Exception as e:  # report and continue: every rank runs the same collectives
        failures.append(fn.__name__)
        print("rank %d: %s FAILED: %r" % (rank, fn.__name__, e), flush=True)


SIZES = [1, 7, 300, 1000, 33]
DTYPES = [np.float32, np.float64, np.float32, np.float64, np.float32]


def copy_layout():
    for cfg, scale in (({}, 1.0 / world), ({"gradient_predivide_factor": 2.0}, 1.0 / world),
                       ({"gradient_average": False}, 1.0), ({"plan_order": "registration"}, 1.0 / world)):
        with DDP(comm, message_size=500, **cfg) as ddp:
            for it in range(3):
                seed = 100 + it
                grads = [data(seed, rank, n, dt) for n, dt in zip(SIZES, DTYPES)]
                if it == 0:
                    for g in grads:
                        ddp.register(g)
                order = np.random.default_rng([seed, rank, 7]).permutation(len(grads))
                with ddp.backward():
                    for i in order:
                        ddp.grad_ready(int(i), grads[i])  # new storage every iteration (set_to_none)
                for g, n, dt in zip(grads, SIZES, DTYPES):
                    assert close(g, reference(seed, n, dt, scale), dt), (cfg, it, n)
            s = ddp.stats
            assert s.iterations == 3 and s.world_size == world and s.rank == rank, s
            assert len(ddp.plan.buckets) >= 2, ddp.plan


def arena_layout():
    with DDP(comm, layout="arena", plan_order="registration", message_size=400) as ddp:
        idx = [ddp.register(numel=n, dtype=dt) for n, dt in zip(SIZES, DTYPES)]
        for it in range(2):
            seed = 200 + it
            with ddp.backward():
                for i in reversed(idx):
                    ddp.grad_array(i)[:] = data(seed, rank, SIZES[i], DTYPES[i])
                    ddp.grad_ready(i)
            for i in idx:
                assert close(ddp.grad_array(i), reference(seed, SIZES[i], DTYPES[i], 1.0 / world), DTYPES[i])
        assert ddp.stats.arena_bytes > 0


def arena_arrays_across_the_learned_plan():
    """Arrays taken once before the loop stay the grads when the learned plan moves the arena (after the
    first synced backward), through a no_sync accumulation too."""
    with DDP(comm, layout="arena", message_size=400) as ddp:
        idx = [ddp.register(numel=n, dtype=dt) for n, dt in zip(SIZES, DTYPES)]
        arrays = [ddp.grad_array(i) for i in idx]
        for it in range(3):
            seed = 300 + it
            with ddp.backward():
                for i in reversed(idx):
                    arrays[i][:] = data(seed, rank, SIZES[i], DTYPES[i])
                    ddp.grad_ready(i)
            for i in idx:
                assert close(arrays[i], reference(seed, SIZES[i], DTYPES[i], 1.0 / world), DTYPES[i]), (it, i)
        assert ddp.stats.layout_epoch == 1
        with ddp.no_sync(), ddp.backward():
            for i in reversed(idx):
                arrays[i][:] = data(310, rank, SIZES[i], DTYPES[i])
                ddp.grad_ready(i)
        with ddp.backward():
            for i in reversed(idx):
                arrays[i][:] += data(311, rank, SIZES[i], DTYPES[i])
                ddp.grad_ready(i)
        for i in idx:
            want = (reference(310, SIZES[i], DTYPES[i], 1.0) + reference(311, SIZES[i], DTYPES[i], 1.0)) / world
            assert close(arrays[i], want, DTYPES[i]), i


def no_sync_accumulates():
    g = np.zeros(50, np.float64)
    with DDP(comm) as ddp:
        i = ddp.register(g)
        with ddp.no_sync():
            with ddp.backward():
                g += data(1, rank, 50, np.float64)
                ddp.grad_ready(i)
        assert np.array_equal(g, data(1, rank, 50, np.float64))  # local only
        with ddp.backward():
            g += data(2, rank, 50, np.float64)
            ddp.grad_ready(i)
        want = (reference(1, 50, np.float64, 1.0) + reference(2, 50, np.float64, 1.0)) / world
        assert close(g, want, np.float64)


def broadcast_from_root():
    a = data(3, rank, 64, np.float32)
    b = data(4, rank, 9, np.float64)
    with DDP(comm) as ddp:
        ddp.broadcast([a, b], root=world - 1)
    assert np.array_equal(a, data(3, world - 1, 64, np.float32)) and np.array_equal(b, data(4, world - 1, 9, np.float64))


def mismatch_raises_everywhere():
    g = np.zeros(10 + (rank == world - 1), np.float32)
    with DDP(comm) as ddp:
        ddp.register(g)
        try:
            ddp.commit()
        except libddp.MismatchError as e:
            assert e.status == 3 and "ddp_" in e.message, e.message
        else:
            raise AssertionError("no MismatchError (world %d)" % world)


def unused_grad_error():
    g0, g1 = np.ones(5, np.float32), np.ones(6, np.float32)
    with DDP(comm, plan_order="registration") as ddp:
        ddp.register(g0)
        ddp.register(g1)
        ddp.begin_backward()
        ddp.grad_ready(0)
        try:
            ddp.finish_backward()
        except libddp.InvalidStateError as e:
            assert "1" in e.message
        else:
            raise AssertionError("unused grad not reported")
    g0[:] = 1
    g1[:] = 1
    with DDP(comm, unused_policy="zero") as ddp:
        ddp.register(g0)
        ddp.register(g1)
        with ddp.backward():
            ddp.grad_ready(1)
        assert np.all(g0 == 0) and np.allclose(g1, 1.0), (g0, g1)


def host_collectives_and_join():
    with DDP(comm) as ddp:
        loss = np.array([float(rank), 1.0])
        assert np.array_equal(ddp.allreduce_host(loss, "avg"), [(world - 1) / 2, 1.0]), loss
        tokens = np.array([rank + 5], np.int64)
        assert ddp.allreduce_host(tokens, "sum")[0] == sum(r + 5 for r in range(world))
        ddp.barrier()
    # Uneven inputs: rank r has r + 1 batches; the averages divide by the ranks that contributed.
    g = np.zeros(4, np.float64)
    with DDP(comm, uneven_inputs="by_contributors") as ddp:
        i = ddp.register(g)
        for it in range(rank + 1):
            g[:] = rank + 1
            with ddp.backward():
                ddp.grad_ready(i)
            active = [r for r in range(world) if r >= it]
            assert np.allclose(g, sum(r + 1 for r in active) / len(active)), (it, g)
        assert ddp.join() == world


def compressed_wire():
    g = data(9, rank, 5000, np.float32)
    with DDP(comm, compression="bf16") as ddp:
        i = ddp.register(g)
        with ddp.backward():
            ddp.grad_ready(i)
    want = reference(9, 5000, np.float32, 1.0 / world)
    assert np.allclose(g, want, rtol=0, atol=(world + 3) / 256 * 2.0), np.abs(g - want).max()
    # int8 blocks: in a first iteration each rank's rounding is at most its block's largest magnitude
    # / 254 (nothing is fed back yet); the average over the ranks is within the largest of them. From
    # 3 ranks the wire reduce-scatters and re-quantizes each shard's sum: one more such rounding.
    g = data(9, rank, 5000, np.float32)
    with DDP(comm, compression="int8") as ddp:
        i = ddp.register(g)
        with ddp.backward():
            ddp.grad_ready(i)
    amax = max(np.abs(data(9, r, 5000, np.float32)).max() for r in range(world))
    roundings = 2 if world >= 3 else 1
    assert np.allclose(g, want, rtol=0, atol=roundings * amax * 1.01 / 254), np.abs(g - want).max()


for f in (copy_layout, arena_layout, arena_arrays_across_the_learned_plan, no_sync_accumulates, broadcast_from_root, host_collectives_and_join,
          compressed_wire, mismatch_raises_everywhere,
          unused_grad_error):
    scenario(f)
comm.close()
print("rank %d of %d: %d failed" % (rank, world, len(failures)), flush=True)
sys.exit(1 if failures else 0)
