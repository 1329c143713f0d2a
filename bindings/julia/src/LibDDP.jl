"""
    LibDDP

Julia bindings for libddp (include/ddp.h) over `ccall`. Handles (`Comm`, `DDP`) carry finalizers and
can be closed early with `close`; every failing call throws `DDPError(status, message)` with the
library's message. Grad indices are the library's (0-based). The library is `ENV["LIBDDP_PATH"]`
(a file or a directory), else the one `make` built in the repository holding this package, else
`libddp.so.0` on the system search path.
"""
module LibDDP

using Libdl

export Comm, DDP, DDPError, recover, register!, begin_backward, grad_ready, wait_grad, finish_backward, backward, set_sync,
       no_sync, reduce_all, synchronize, stats, plan, grad_array, rank, nranks

# The header's types, constants (F32, ERR_TIMEOUT, VERSION_CODE, ...), struct layouts and FUNCTIONS,
# generated from include/ddp.h by tools/gen_bindings.py (make bindings-check fails while they differ).
include("ddp_h.jl")

dtype_of(::Type{Float16}) = F16
dtype_of(::Type{Float32}) = F32
dtype_of(::Type{Float64}) = F64

const LIB = Ref{Ptr{Cvoid}}(C_NULL)
const SYMS = Dict{Symbol,Ptr{Cvoid}}()

# LIBDDP_PATH (a file or a directory) first; then the library `make` built in the repository this
# package lives in (Pkg.develop(path="bindings/julia")); then the system's search path.
function libpath()
    p = get(ENV, "LIBDDP_PATH", "")
    isempty(p) || return isdir(p) ? joinpath(p, "libddp.so.0") : p
    built = normpath(joinpath(@__DIR__, "..", "..", "..", "build", "lib", "libddp.so.0"))
    return isfile(built) ? built : "libddp.so.0"
end

# Every function of ddp.h is resolved once at load, so that finalizers only read the table.
function __init__()
    # RTLD_GLOBAL: Open MPI's plugins resolve libmpi symbols globally.
    LIB[] = Libdl.dlopen(libpath(), Libdl.RTLD_NOW | Libdl.RTLD_GLOBAL)
    for f in FUNCTIONS
        SYMS[f] = Libdl.dlsym(LIB[], f)
    end
end

sym(name::Symbol) = SYMS[name]

"""A failed libddp call: `status` (a ddp_status_t) and the library's `message`."""
struct DDPError <: Exception
    status::Int
    message::String
end
Base.showerror(io::IO, e::DDPError) = print(io, "DDPError(", e.status, ", ", status_string(e.status), "): ", e.message)

status_string(s::Integer) = unsafe_string(ccall(sym(:ddp_status_string), Cstring, (Cint,), s))
last_error() = unsafe_string(ccall(sym(:ddp_last_error), Cstring, ()))
version() = Int(ccall(sym(:ddp_version), Cint, ()))

"""
    launcher_ranks() -> (rank, size, local_rank)

This process's place as its launcher set it (torchrun, Slurm's srun, Open MPI's mpirun, MPICH's
mpiexec), read as the init method "auto" reads it, without making a communicator: e.g. to pick the
CUDA device (`local_rank % device count`) before `nccl_store("auto")`. `local_rank` is -1 when no
variable gives it and the job may span hosts. Throws DDPError when no launcher's variables give a rank
and a size, or two launchers' disagree.
"""
function launcher_ranks()
    rank, size, local_rank = Ref{Cint}(0), Ref{Cint}(0), Ref{Cint}(0)
    check(ccall(sym(:ddp_launcher_ranks), Cint, (Ref{Cint}, Ref{Cint}, Ref{Cint}), rank, size, local_rank))
    return (Int(rank[]), Int(size[]), Int(local_rank[]))
end

check(st::Cint) = st == 0 ? nothing : throw(DDPError(Int(st), last_error()))

# ---- the structs under the names this module has always given them ---------------------------------
const Config = ddp_config_t
const Stats = ddp_stats_t
const ShardInfo = ddp_shard_info_t
const BucketInfo = ddp_bucket_info_t

# A versioned struct the library fills: `size` set, every other field zero.
sized(::Type{T}) where {T} = T(sizeof(T), map(zero, fieldtypes(T)[2:end])...)

const ENUMS = Dict(:layout => Dict(:copy => LAYOUT_COPY, :arena => LAYOUT_ARENA),
                   :plan_order => Dict(:learned => PLAN_LEARNED, :registration => PLAN_REGISTRATION),
                   :unused_policy => Dict(:error => UNUSED_ERROR, :zero => UNUSED_ZERO),
                   :compression => Dict(:none => COMPRESS_NONE, :bf16 => COMPRESS_BF16, :fp16 => COMPRESS_FP16,
                                        :int8 => COMPRESS_INT8),
                   :uneven_inputs => Dict(:off => UNEVEN_OFF, :by_contributors => UNEVEN_BY_CONTRIBUTORS,
                                          :by_world => UNEVEN_BY_WORLD))

# ---- communicators -----------------------------------------------------------------------------
mutable struct Comm
    handle::Ptr{Cvoid}
    function Comm(h::Ptr{Cvoid})
        c = new(h)
        finalizer(close, c)
        return c
    end
end

"""`Comm(:mpi)` (MPI_COMM_WORLD, host memory) or `Comm(:self)` (one rank, no MPI)."""
function Comm(kind::Symbol)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    if kind === :mpi
        check(ccall(sym(:ddp_comm_init_mpi), Cint, (Ptr{Cvoid}, Ref{Ptr{Cvoid}}), C_NULL, out))
    elseif kind === :self
        check(ccall(sym(:ddp_comm_init_self), Cint, (Ref{Ptr{Cvoid}},), out))
    else
        throw(ArgumentError("Comm(kind): kind is :mpi or :self (Gloo: gloo(init_method); NCCL: nccl_mpi(device), nccl_store(init_method))"))
    end
    return Comm(out[])
end

"""An NCCL communicator on CUDA device `device`, its id made on MPI rank 0. Collective."""
function nccl_mpi(device::Integer)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    check(ccall(sym(:ddp_comm_init_nccl_mpi), Cint, (Ptr{Cvoid}, Cint, Ref{Ptr{Cvoid}}), C_NULL, device, out))
    return Comm(out[])
end

"""
    gloo(init_method="env://"; rank=-1, size=-1, timeout_ms=nothing) -> Comm

Host memory over Gloo (TCP), needing no MPI: processes started by any launcher meet through
`init_method`: "env://" (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE as torchrun sets them; without
RANK or WORLD_SIZE, as "auto"), "auto" (rank, size and rendezvous from whichever launcher started the
process: torchrun, srun, mpirun, mpiexec), "tcp://HOST:PORT" or "file:///DIR". `rank` and `size` of
-1 are read from RANK and WORLD_SIZE (with "auto", from the launcher).
Collective; bounded by `timeout_ms` (default DDP_INIT_TIMEOUT_MS, else 300000; 0 waits forever).
"""
function gloo(init_method::AbstractString="env://"; rank::Integer=-1, size::Integer=-1,
              timeout_ms::Union{Nothing,Integer}=nothing)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    if timeout_ms === nothing
        check(ccall(sym(:ddp_comm_init_gloo), Cint, (Cstring, Cint, Cint, Ref{Ptr{Cvoid}}),
                    String(init_method), rank, size, out))
    else
        check(ccall(sym(:ddp_comm_init_gloo_timeout), Cint, (Cstring, Cint, Cint, Int64, Ref{Ptr{Cvoid}}),
                    String(init_method), rank, size, timeout_ms, out))
    end
    return Comm(out[])
end

"""
    join_gloo(init_method="env://"; timeout_ms=300000) -> Comm

A joiner's comm (ddp_comm_join_gloo): joins a running elastic job over `init_method`'s store. No rank
until admitted: make an elastic DDP over it, register the job's grads, then `recover` waits for the job
to admit it (up to `timeout_ms`, 0: forever) and returns the membership; take `source`'s state.
"""
function join_gloo(init_method::AbstractString="env://"; timeout_ms::Integer=300000)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    check(ccall(sym(:ddp_comm_join_gloo), Cint, (Cstring, Int64, Ref{Ptr{Cvoid}}), String(init_method), timeout_ms,
                out))
    return Comm(out[])
end

"""
    nccl_store(init_method="env://"; rank=-1, size=-1, device=0) -> Comm

Device memory over NCCL needing no MPI: the ranks meet as in `gloo` and rank 0's NCCL id travels
over a Gloo communicator. Collective; bounded by DDP_INIT_TIMEOUT_MS.
"""
function nccl_store(init_method::AbstractString="env://"; rank::Integer=-1, size::Integer=-1, device::Integer=0)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    check(ccall(sym(:ddp_comm_init_nccl_store), Cint, (Cstring, Cint, Cint, Cint, Ref{Ptr{Cvoid}}),
                String(init_method), rank, size, device, out))
    return Comm(out[])
end

"""
    join_nccl(init_method="env://"; device=0, timeout_ms=300000) -> Comm

A joiner's comm for an elastic job whose ranks use `nccl_store` (ddp_comm_join_nccl): admitted as in
`join_gloo`, then it makes an NCCL communicator on CUDA device `device` with the job's ranks.
"""
function join_nccl(init_method::AbstractString="env://"; device::Integer=0, timeout_ms::Integer=300000)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    check(ccall(sym(:ddp_comm_join_nccl), Cint, (Cstring, Cint, Int64, Ref{Ptr{Cvoid}}), String(init_method), device,
                timeout_ms, out))
    return Comm(out[])
end

handle(c::Comm) = c.handle == C_NULL ? throw(DDPError(ERR_INVALID_STATE, "LibDDP: this Comm is closed")) : c.handle

function rank(c::Comm)
    r = Ref{Cint}(0)
    check(ccall(sym(:ddp_comm_rank), Cint, (Ptr{Cvoid}, Ref{Cint}), handle(c), r))
    return Int(r[])
end

function nranks(c::Comm)
    r = Ref{Cint}(0)
    check(ccall(sym(:ddp_comm_size), Cint, (Ptr{Cvoid}, Ref{Cint}), handle(c), r))
    return Int(r[])
end

function Base.close(c::Comm)
    h = c.handle
    c.handle = C_NULL
    h == C_NULL || ccall(sym(:ddp_comm_destroy), Cint, (Ptr{Cvoid},), h)
    return nothing
end

# ---- the context ---------------------------------------------------------------------------------
mutable struct DDP
    handle::Ptr{Cvoid}
    grads::Dict{Int,Any}          # arrays the library points into (copy layout): kept alive
    shapes::Vector{Tuple{Int,DataType}}
    function DDP(h::Ptr{Cvoid})
        d = new(h, Dict{Int,Any}(), Tuple{Int,DataType}[])
        finalizer(close, d)
        return d
    end
end

"""
    DDP(comm; message_size=..., layout=:copy|:arena, plan_order=:learned|:registration,
        gradient_average=true, gradient_predivide_factor=1.0, unused_policy=:error|:zero, ...)

A context over `comm`; keywords are ddp_config_t fields. Collective.
"""
function DDP(comm::Comm; timeline_path::Union{Nothing,AbstractString}=nothing, kw...)
    cfg = Config()
    # the sized call with our own struct size: the unsized symbol writes version 1 only
    check(ccall(sym(:ddp_config_init_sized), Cint, (Ref{Config}, Csize_t), cfg, sizeof(Config)))
    for (k, v) in kw
        k in fieldnames(Config)[4:end] || throw(ArgumentError("LibDDP.DDP: unknown config key $k"))
        if haskey(ENUMS, k) && v isa Symbol
            haskey(ENUMS[k], v) || throw(ArgumentError("LibDDP.DDP: $k must be one of $(keys(ENUMS[k]))"))
            v = ENUMS[k][v]
        end
        setfield!(cfg, k, convert(fieldtype(Config, k), v))
    end
    path = timeline_path === nothing ? nothing : String(timeline_path)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    GC.@preserve path begin
        cfg.timeline_path = path === nothing ? Ptr{UInt8}(C_NULL) : pointer(path)
        check(ccall(sym(:ddp_create), Cint, (Ptr{Cvoid}, Ref{Config}, Ref{Ptr{Cvoid}}), handle(comm), cfg, out))
    end
    return DDP(out[])
end

handle(d::DDP) = d.handle == C_NULL ? throw(DDPError(ERR_INVALID_STATE, "LibDDP: this DDP is closed")) : d.handle

function _register(d::DDP, ptr::Ptr{Cvoid}, n::Integer, ::Type{T}, trigger::Bool) where {T}
    idx = Ref{Cint}(0)
    check(ccall(sym(:ddp_register_grad), Cint, (Ptr{Cvoid}, Ptr{Cvoid}, Csize_t, Cint, Cuint, Ref{Cint}),
                handle(d), ptr, n, dtype_of(T), trigger ? GRAD_TRIGGER : Cuint(0), idx))
    push!(d.shapes, (Int(n), T))
    return Int(idx[])
end

"""`register!(d, grad::Array{Float32/Float64/Float16})` (copy layout) or `register!(d, numel, T)`
(arena layout: the library owns the storage, see `grad_array`). Returns the grad's index."""
function register!(d::DDP, a::Array{T}; trigger::Bool=false) where {T<:Union{Float16,Float32,Float64}}
    i = _register(d, Ptr{Cvoid}(pointer(a)), length(a), T, trigger)
    d.grads[i] = a
    return i
end
register!(d::DDP, n::Integer, ::Type{T}; trigger::Bool=false) where {T} = _register(d, Ptr{Cvoid}(C_NULL), n, T, trigger)

commit(d::DDP) = check(ccall(sym(:ddp_commit), Cint, (Ptr{Cvoid},), handle(d)))

function grad_ptr(d::DDP, i::Integer)
    p = Ref{Ptr{Cvoid}}(C_NULL)
    check(ccall(sym(:ddp_grad_ptr), Cint, (Ptr{Cvoid}, Cint, Ref{Ptr{Cvoid}}), handle(d), i, p))
    return p[]
end

"""The storage of grad `i` as an Array (a view of the library's memory in the arena layout)."""
function grad_array(d::DDP, i::Integer)
    n, T = d.shapes[i+1]
    return unsafe_wrap(Array, Ptr{T}(grad_ptr(d, i)), n; own=false)
end

begin_backward(d::DDP) = check(ccall(sym(:ddp_begin_backward), Cint, (Ptr{Cvoid}, Ptr{Cvoid}), handle(d), C_NULL))
grad_ready(d::DDP, i::Integer) = check(ccall(sym(:ddp_grad_ready), Cint, (Ptr{Cvoid}, Cint), handle(d), i))
function grad_ready(d::DDP, i::Integer, a::Array)
    h = handle(d)
    d.grads[i] = a
    check(ccall(sym(:ddp_grad_ready_ptr), Cint, (Ptr{Cvoid}, Cint, Ptr{Cvoid}), h, i, pointer(a)))
end
"""Inside a backward pass, after grad `i` was marked ready: `true` once its reduced value can be read
(its bucket is reduced; later buckets may still travel), so a trainer can update that layer before
`finish_backward`; `false` when nothing is launched for it yet (its bucket or an earlier one waits for
grads, the first iteration of a learned plan, delay_allreduce, sync off, a sharded context)."""
function wait_grad(d::DDP, i::Integer)
    reduced = Ref{Cint}(0)
    check(ccall(sym(:ddp_wait_grad), Cint, (Ptr{Cvoid}, Cint, Ptr{Cvoid}, Ref{Cint}), handle(d), i, C_NULL, reduced))
    return reduced[] != 0
end
finish_backward(d::DDP) = check(ccall(sym(:ddp_finish_backward), Cint, (Ptr{Cvoid}, Ptr{Cvoid}), handle(d), C_NULL))
set_sync(d::DDP, on::Bool) = check(ccall(sym(:ddp_set_sync), Cint, (Ptr{Cvoid}, Cint), handle(d), on))
reduce_all(d::DDP) = check(ccall(sym(:ddp_reduce_all), Cint, (Ptr{Cvoid}, Ptr{Cvoid}), handle(d), C_NULL))
synchronize(d::DDP) = check(ccall(sym(:ddp_synchronize), Cint, (Ptr{Cvoid},), handle(d)))

"""`join_uneven(d)` (ddp_join; not Base.join): uneven inputs (`uneven_inputs = :by_contributors` or `:by_world`): this rank is out of
data and shadows the others' iterations until every rank has joined; returns the synced iterations
done by then. Collective."""
function join_uneven(d::DDP)
    at = Ref{Int64}(0)
    check(ccall(sym(:ddp_join), Cint, (Ptr{Cvoid}, Ref{Int64}), handle(d), at))
    return Int(at[])
end

"""`recover(d, old_world)` (ddp_recover): elastic contexts (`elastic = 1`), after a call failed with
DDP_ERR_RANK_LOST: agrees with the other live ranks on the new membership and rebuilds the context over
it; after DDP_ERR_RANK_JOINING: admits the processes that wait to join; on a joiner's context
(`join_gloo`): asks to be admitted and waits. Returns `(membership, members)`: the ddp_membership_t and,
for each new rank, its number in the old world (-1: a joiner). Every rank should then take the state of
`membership.source` (`bcast!`). Collective."""
function recover(d::DDP, old_world::Integer)
    m = Ref{ddp_membership_t}()
    members = fill(Cint(-1), max(4096, 2 * old_world))
    check(ccall(sym(:ddp_recover), Cint, (Ptr{Cvoid}, Ref{ddp_membership_t}, Ptr{Cint}, Csize_t), handle(d), m,
                members, length(members)))
    return m[], Int.(members[1:m[].world])
end

const HOST_DTYPES = Dict(Float16 => F16, Float32 => F32, Float64 => F64, Int32 => I32, Int64 => I64)
const OPS = Dict(:sum => OP_SUM, :avg => OP_AVG, :max => OP_MAX, :min => OP_MIN)

"""`allreduce_host!(d, a, op=:sum)`: reduces the array `a` (Float16/32/64, Int32/64: the loss,
metrics, token counts) across the ranks in place; `op` is :sum, :avg, :max or :min. Collective."""
function allreduce_host!(d::DDP, a::Array{T}, op::Symbol=:sum) where {T}
    haskey(HOST_DTYPES, T) || throw(ArgumentError("allreduce_host!: element type $T is not Float16/32/64, Int32/64"))
    haskey(OPS, op) || throw(ArgumentError("allreduce_host!: op is :sum, :avg, :max or :min, not :$op"))
    GC.@preserve a check(ccall(sym(:ddp_allreduce_host), Cint, (Ptr{Cvoid}, Ptr{Cvoid}, Csize_t, Cint, Cint),
                               handle(d), pointer(a), length(a), HOST_DTYPES[T], OPS[op]))
    return a
end

"""`bcast!(d, arrays...; root=0)` (ddp_broadcast): every array (Float16/32/64, Int32/64: parameters,
optimizer state, a step count) from rank `root` to every rank, in place. Collective."""
function bcast!(d::DDP, arrays::Array...; root::Integer=0)
    for a in arrays
        haskey(HOST_DTYPES, eltype(a)) || throw(ArgumentError("bcast!: element type $(eltype(a)) is not Float16/32/64, Int32/64"))
    end
    ptrs = Ptr{Cvoid}[pointer(a) for a in arrays]
    counts = Csize_t[length(a) for a in arrays]
    dtypes = Cint[HOST_DTYPES[eltype(a)] for a in arrays]
    GC.@preserve arrays check(ccall(sym(:ddp_broadcast), Cint,
                                    (Ptr{Cvoid}, Ptr{Ptr{Cvoid}}, Ptr{Csize_t}, Ptr{Cint}, Cint, Cint, Ptr{Cvoid}),
                                    handle(d), ptrs, counts, dtypes, length(arrays), root, C_NULL))
    return arrays
end

"""`barrier(d)`: returns when every rank has called it. Collective."""
barrier(d::DDP) = check(ccall(sym(:ddp_barrier), Cint, (Ptr{Cvoid},), handle(d)))

"""`backward(d) do ... end`: begin_backward, the block (which calls grad_ready), finish_backward."""
function backward(f, d::DDP)
    begin_backward(d)
    f()
    finish_backward(d)
end

"""`no_sync(d) do ... end`: backward passes inside only accumulate locally."""
function no_sync(f, d::DDP)
    set_sync(d, false)
    try
        f()
    finally
        d.handle == C_NULL || set_sync(d, true)
    end
end

function stats(d::DDP)
    r = Ref(sized(Stats))
    check(ccall(sym(:ddp_get_stats), Cint, (Ptr{Cvoid}, Ref{Stats}), handle(d), r))
    return r[]
end

"""The current plan: a vector of (info::BucketInfo, grads::Vector{Int})."""
function plan(d::DDP)
    h = handle(d)
    n, learned = Ref{Cint}(0), Ref{Cint}(0)
    check(ccall(sym(:ddp_get_plan), Cint, (Ptr{Cvoid}, Ref{Cint}, Ref{Cint}), h, n, learned))
    out = Tuple{BucketInfo,Vector{Int}}[]
    for b in 0:n[]-1
        info = Ref(sized(BucketInfo))
        grads = zeros(Cint, max(length(d.shapes), 1))
        check(ccall(sym(:ddp_get_bucket), Cint, (Ptr{Cvoid}, Cint, Ref{BucketInfo}, Ptr{Cint}, Csize_t),
                    h, b, info, grads, length(grads)))
        push!(out, (info[], Int.(grads[1:info[].num_grads])))
    end
    return out
end

function Base.close(d::DDP)
    h = d.handle
    d.handle = C_NULL
    h == C_NULL || ccall(sym(:ddp_destroy), Cint, (Ptr{Cvoid},), h)
    empty!(d.grads)
    return nothing
end

end # module
