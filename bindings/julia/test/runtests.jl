# LibDDP tests on one rank (Comm(:self)); test/mpi.jl runs the multi-rank part under mpirun.
# Ends with "julia: N passed, N failed, 0 skipped".
include(joinpath(@__DIR__, "..", "src", "LibDDP.jl"))
using .LibDDP

const PASSED = Ref(0)
const FAILED = Ref(0)
function t(f, name)
    try
        f()
        PASSED[] += 1
        println("ok   ", name)
    catch e
        FAILED[] += 1
        println("FAIL ", name, ": ", sprint(showerror, e))
    end
end
function throws_status(f, status)
    try
        f()
    catch e
        e isa DDPError || rethrow()
        e.status == status || error("status $(e.status), expected $status: $(e.message)")
        isempty(e.message) && error("empty message")
        return e
    end
    error("no DDPError thrown")
end

t("version") do
    @assert LibDDP.version() == LibDDP.VERSION_CODE
    @assert LibDDP.status_string(3) == "ranks disagree"
end

t("self comm lifecycle, copy layout") do
    c = Comm(:self)
    @assert rank(c) == 0 && nranks(c) == 1
    a = Float32.(1:10)
    b = collect(range(0.0, 1.0; length=7))
    d = DDP(c; message_size=8, gradient_predivide_factor=2.0)
    i = register!(d, a)
    j = register!(d, b)
    @assert (i, j) == (0, 1)
    backward(d) do
        grad_ready(d, j)
        grad_ready(d, i)
    end
    @assert a == Float32.(1:10) && b ≈ collect(range(0.0, 1.0; length=7))
    s = stats(d)
    @assert s.iterations == 1 && s.world_size == 1
    @assert sort(vcat([g for (_, g) in plan(d)]...)) == [0, 1]
    close(d)
    close(c)
end

t("arena layout") do
    c = Comm(:self)
    d = DDP(c; layout=:arena, plan_order=:registration)
    i = register!(d, 5, Float64)
    g = grad_array(d, i)
    @assert length(g) == 5 && all(g .== 0)
    g .= 3.0
    backward(() -> grad_ready(d, i), d)
    @assert all(grad_array(d, i) .== 3.0)
    @assert stats(d).arena_bytes > 0
    close(d)
    close(c)
end

t("wait_grad: a grad's reduced value before finish_backward") do
    c = Comm(:self)
    d = DDP(c; layout=:arena, plan_order=:registration, message_size=4)
    i = register!(d, 5, Float32)
    j = register!(d, 5, Float32)
    grad_array(d, i) .= 2.0f0
    grad_array(d, j) .= 3.0f0
    begin_backward(d)
    grad_ready(d, j)
    @assert wait_grad(d, j)
    @assert all(grad_array(d, j) .== 3.0f0)
    grad_ready(d, i)
    @assert wait_grad(d, i)
    finish_backward(d)
    e = throws_status(() -> wait_grad(d, i), LibDDP.ERR_INVALID_STATE)
    @assert occursin("no backward pass", e.message)
    close(d)
    close(c)
end

t("misuse throws DDPError with the status") do
    c = Comm(:self)
    d = DDP(c)
    i = register!(d, zeros(Float32, 4))
    e = throws_status(() -> grad_ready(d, i), LibDDP.ERR_INVALID_STATE)
    @assert occursin("no backward pass", e.message)
    begin_backward(d)
    throws_status(() -> begin_backward(d), LibDDP.ERR_INVALID_STATE)
    throws_status(() -> grad_ready(d, 42), LibDDP.ERR_INVALID_ARGUMENT)
    grad_ready(d, i)
    finish_backward(d)
    throws_status(() -> DDP(c; gradient_predivide_factor=0.0), LibDDP.ERR_INVALID_ARGUMENT)
    close(d)
    close(c)
end

t("no_sync accumulates locally") do
    c = Comm(:self)
    d = DDP(c)
    i = register!(d, zeros(4))
    no_sync(d) do
        backward(() -> grad_ready(d, i), d)
    end
    backward(() -> grad_ready(d, i), d)
    @assert stats(d).iterations == 1
    close(d)
    close(c)
end

t("use after close throws, never crashes") do
    c = Comm(:self)
    d = DDP(c)
    close(d)
    close(d)
    throws_status(() -> begin_backward(d), LibDDP.ERR_INVALID_STATE)
    throws_status(() -> stats(d), LibDDP.ERR_INVALID_STATE)
    close(c)
    throws_status(() -> rank(c), LibDDP.ERR_INVALID_STATE)
    throws_status(() -> DDP(c), LibDDP.ERR_INVALID_STATE)
end

t("finalizers release handles") do
    for _ in 1:50
        c = Comm(:self)
        d = DDP(c)
        register!(d, zeros(Float32, 16))
    end
    GC.gc()
end

println("julia: $(PASSED[]) passed, $(FAILED[]) failed, 0 skipped")
exit(FAILED[] == 0 ? 0 : 1)
