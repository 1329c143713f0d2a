"""Compares the Python low layer (libddp._lib) with include/ddp.h: functions, structs and constants."""
import ctypes
import re

from libddp import _lib as L
from libddp import errors

P = ctypes.POINTER
# C type (spaces normalised) -> the ctypes type the low layer must use, for parameters and fields.
C_TYPES = {
    "int": ctypes.c_int, "unsigned": ctypes.c_uint, "unsigned int": ctypes.c_uint, "double": ctypes.c_double,
    "size_t": ctypes.c_size_t, "int64_t": ctypes.c_int64, "uint32_t": ctypes.c_uint32, "uint64_t": ctypes.c_uint64,
    "const char*": ctypes.c_char_p,
    "void*": ctypes.c_void_p, "const void*": ctypes.c_void_p, "void**": P(ctypes.c_void_p),
    "void* const*": P(ctypes.c_void_p),
    "int*": P(ctypes.c_int), "const size_t*": P(ctypes.c_size_t), "size_t*": P(ctypes.c_size_t),
    "double*": P(ctypes.c_double), "uint64_t*": P(ctypes.c_uint64),
    "ddp_status_t": ctypes.c_int, "ddp_dtype_t": ctypes.c_int, "const ddp_dtype_t*": P(ctypes.c_int),
    "ddp_comm_t": L.ddp_comm_t, "ddp_comm_t*": P(L.ddp_comm_t), "const ddp_comm_t*": P(L.ddp_comm_t),
    "ddp_local_group_t": L.ddp_local_group_t, "ddp_local_group_t*": P(L.ddp_local_group_t),
    "ddp_t": L.ddp_t, "ddp_t*": P(L.ddp_t),
    "ddp_log_fn": L.ddp_log_fn,
    "ddp_op_t": ctypes.c_int, "int64_t*": P(ctypes.c_int64),
    "ddp_comm_hook_fn": L.ddp_comm_hook_fn,
}
for _name, _cls in L.STRUCTS.items():
    C_TYPES[_name + "*"] = P(_cls)
    C_TYPES["const " + _name + "*"] = P(_cls)
RETURN_TYPES = dict(C_TYPES, ddp_status_t=L.ddp_status_t)


def _norm(t):
    t = re.sub(r"\s+", " ", t.strip())
    return re.sub(r"\s*\*", "*", t).replace("*const", "* const")


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def parse_functions(header):
    """{name: (return C type, [param C types])} for every DDP_API declaration."""
    body = strip_comments(header)
    out = {}
    for m in re.finditer(r"DDP_API\s+([^;(]*?)\b(ddp_\w+)\s*\(([^)]*)\)\s*;", body):
        ret, name, params = _norm(m.group(1)), m.group(2), m.group(3).strip()
        types = []
        if params and params != "void":
            for p in params.split(","):
                p = _norm(p)
                pm = re.match(r"^(.*?)(\w+)$", p)
                types.append(_norm(pm.group(1)))
        out[name] = (ret, types)
    return out


def parse_structs(header):
    """{typedef name: [(field, C type, array length or None)]}."""
    body = strip_comments(header)
    out = {}
    for m in re.finditer(r"typedef\s+struct\s+\w+\s*\{([^}]*)\}\s*(\w+)\s*;", body):
        fields = []
        for decl in m.group(1).split(";"):
            decl = _norm(decl)
            if not decl:
                continue
            fm = re.match(r"^(.*?)(\w+)(?:\[(\d+)\])?$", decl)
            fields.append((fm.group(2), _norm(fm.group(1)), int(fm.group(3)) if fm.group(3) else None))
        out[m.group(2)] = fields
    return out


def parse_constants(header):
    """{name: int} for the status map, the enums with explicit values and the numeric #defines."""
    body = strip_comments(header)
    out = {}
    for m in re.finditer(r"X\((DDP_\w+),\s*(\d+),", body):
        out[m.group(1)] = int(m.group(2))
    for m in re.finditer(r"\b(DDP_\w+)\s*=\s*(\d+)\s*(?=[,}])", body):
        out[m.group(1)] = int(m.group(2))
    for m in re.finditer(r"#define\s+(DDP_\w+)\s+(0x[0-9A-Fa-f]+|\d+)u?\b", body):
        out[m.group(1)] = int(m.group(2), 0)
    return out


def check(header, functions=None, structs=None, module=L):
    """A list of problems (empty when the low layer matches the header)."""
    functions = L.FUNCTIONS if functions is None else functions
    structs = L.STRUCTS if structs is None else structs
    problems = []
    decl = parse_functions(header)
    if len(decl) < 30:
        problems.append("header parse found only %d functions" % len(decl))
    for name, (ret, params) in decl.items():
        if name not in functions:
            problems.append("%s: declared in ddp.h, missing from the Python layer" % name)
            continue
        res, args = functions[name]
        want_res = RETURN_TYPES.get(ret)
        if want_res is None:
            problems.append("%s: return type %r has no known ctypes mapping" % (name, ret))
        elif res is not want_res:
            problems.append("%s: returns %s in ddp.h, the Python layer says %s" % (name, ret, res))
        if len(args) != len(params):
            problems.append("%s: %d parameters in ddp.h, %d in the Python layer" % (name, len(params), len(args)))
            continue
        for k, (ctype, py) in enumerate(zip(params, args)):
            want = C_TYPES.get(ctype)
            if want is None:
                problems.append("%s: parameter %d type %r has no known ctypes mapping" % (name, k, ctype))
            elif py is not want:
                problems.append("%s: parameter %d is %s in ddp.h, %s in the Python layer" % (name, k, ctype, py))
    for name in functions:
        if name not in decl:
            problems.append("%s: in the Python layer, not declared in ddp.h" % name)
    for sname, fields in parse_structs(header).items():
        cls = structs.get(sname)
        if cls is None:
            problems.append("struct %s: missing from the Python layer" % sname)
            continue
        py = list(cls._fields_)
        if [f for f, _, _ in fields] != [f for f, _ in py]:
            problems.append("struct %s: fields %s in ddp.h, %s in the Python layer" % (
                sname, [f for f, _, _ in fields], [f for f, _ in py]))
            continue
        for (f, ctype, n), (_, pytype) in zip(fields, py):
            if ctype == "char" and n:
                ok = issubclass(pytype, ctypes.Array) and pytype._type_ is ctypes.c_char and pytype._length_ == n
            else:
                want = C_TYPES.get(ctype)
                ok = want is not None and pytype is want
            if not ok:
                problems.append("struct %s.%s: %s%s in ddp.h, %s in the Python layer" % (
                    sname, f, ctype, "[%d]" % n if n else "", pytype))
    consts = parse_constants(header)
    for name, value in consts.items():
        if name.startswith("DDP_ERR_") or name == "DDP_SUCCESS":
            short = name[len("DDP_ERR_"):] if name.startswith("DDP_ERR_") else "SUCCESS"
            if getattr(errors, short, None) != value:
                problems.append("%s = %d in ddp.h, libddp.errors.%s = %r" % (name, value, short, getattr(errors, short, None)))
            elif value and errors.BY_STATUS.get(value) is None:
                problems.append("%s has no exception class" % name)
        elif hasattr(module, name) and getattr(module, name) != value:
            problems.append("%s = %d in ddp.h, %r in the Python layer" % (name, value, getattr(module, name)))
        elif not hasattr(module, name) and not name.startswith(("DDP_VERSION", "DDP_DTYPE_COUNT", "DDP_STATUS")):
            problems.append("%s: constant missing from the Python layer" % name)
    return problems
