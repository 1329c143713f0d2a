# Under mpirun, or with LIBDDP_TEST_GLOO=METHOD under any launcher (LibDDP.gloo, no MPI): every rank
# reduces Float32 and Float64 arrays and checks them; a mismatch throws on every rank.
include(joinpath(@__DIR__, "..", "src", "LibDDP.jl"))
using .LibDDP

comm = haskey(ENV, "LIBDDP_TEST_GLOO") ? LibDDP.gloo(ENV["LIBDDP_TEST_GLOO"]) : Comm(:mpi)
r, w = rank(comm), nranks(comm)
val(rk, i) = sin(0.37 * (rk + 1) + 0.011 * i)
a = Float32[val(r, i) for i in 1:500]
b = Float64[val(r, i) for i in 1:33]
d = DDP(comm; message_size=200)
ia = register!(d, a)
ib = register!(d, b)
backward(d) do
    r % 2 == 0 ? (grad_ready(d, ia); grad_ready(d, ib)) : (grad_ready(d, ib); grad_ready(d, ia))
end
want(i, T) = sum(Float64(T(val(k, i))) for k in 0:w-1) / w
@assert all(abs(a[i] - want(i, Float32)) <= 1e-6 * max(1, abs(want(i, Float32))) for i in 1:500)
@assert all(abs(b[i] - want(i, Float64)) <= 1e-12 for i in 1:33)
close(d)
if w > 1
    d = DDP(comm)
    register!(d, zeros(Float32, 10 + (r == w - 1)))
    try
        LibDDP.commit(d)
        error("no mismatch")
    catch e
        (e isa DDPError && e.status == LibDDP.ERR_MISMATCH) || rethrow()
    end
    close(d)
end
close(comm)
d = DDP(comm)
loss = [Float64(r), 1.0]
LibDDP.allreduce_host!(d, loss, :avg)
@assert loss == [(w - 1) / 2, 1.0]
step, state = Int64[r == w - 1 ? 4711 : -1], Float32[r, r]
LibDDP.bcast!(d, step, state; root=w - 1)
@assert step == [4711] && state == Float32[w - 1, w - 1]
LibDDP.barrier(d)
close(d)
println("rank $r of $w: julia mpi ok")
