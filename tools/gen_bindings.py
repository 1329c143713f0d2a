#!/usr/bin/env python3
"""Generates the bindings' low layers from include/ddp.h (python3, standard library only).

    tools/gen_bindings.py            rewrites them (make bindings)
    tools/gen_bindings.py --check    writes nothing; fails naming each file that differs (make bindings-check, CI)

Written from the header, checked in:
  bindings/python/libddp/_ddp_h.py          ctypes: types, constants, struct layouts, FUNCTIONS and declare()
  bindings/rust/libddp-sys/src/generated.rs types, constants, #[repr(C)] structs, the extern "C" block
  bindings/julia/src/ddp_h.jl               types, constants (DDP_ dropped), struct layouts, FUNCTIONS
and the version DDP_VERSION_MAJOR.MINOR.PATCH in the Cargo.toml of both crates, their Cargo.lock
entries and the Julia Project.toml (the Python package reads it from _ddp_h.py). --header and --root
generate from another header or check another tree (the tests do both).

The header's discipline, which this parser relies on: enums are typedefs whose values are explicit
(or the previous one plus one), possibly written through an X-macro (#define MAP(X) X(NAME, value,
...) ...); structs are typedefs with one field per declaration; handles are `typedef struct tag*
name_t;`; callbacks are `typedef ret (*name)(params);`; functions are `DDP_API ret name(params);`;
constants are object-like #defines of integer expressions (offsetof and sizeof allowed) outside
platform conditionals. Anything else is an error naming the declaration, never a silent skip.
"""
import argparse
import difflib
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON_OUT = "bindings/python/libddp/_ddp_h.py"
RUST_OUT = "bindings/rust/libddp-sys/src/generated.rs"
JULIA_OUT = "bindings/julia/src/ddp_h.jl"
CARGO_TOMLS = ("bindings/rust/libddp-sys/Cargo.toml", "bindings/rust/libddp/Cargo.toml")
CARGO_LOCK = "bindings/rust/Cargo.lock"
JULIA_PROJECT = "bindings/julia/Project.toml"

# The header's convention: every call returns a ddp_status_t; the Python layer raises on it.
STATUS_TYPE = "ddp_status_t"
# Julia structs whose fields the caller sets one by one (setfield!): mutable, made empty by T().
JULIA_MUTABLE = {"ddp_config_t"}

# C scalar -> (ctypes, Rust, Julia).
SCALARS = {
    "int": ("ctypes.c_int", "c_int", "Cint"),
    "unsigned": ("ctypes.c_uint", "c_uint", "Cuint"),
    "unsigned int": ("ctypes.c_uint", "c_uint", "Cuint"),
    "int32_t": ("ctypes.c_int32", "i32", "Int32"),
    "uint32_t": ("ctypes.c_uint32", "u32", "UInt32"),
    "int64_t": ("ctypes.c_int64", "i64", "Int64"),
    "uint64_t": ("ctypes.c_uint64", "u64", "UInt64"),
    "size_t": ("ctypes.c_size_t", "usize", "Csize_t"),
    "double": ("ctypes.c_double", "f64", "Cdouble"),
    "float": ("ctypes.c_float", "f32", "Cfloat"),
    "char": ("ctypes.c_char", "c_char", "UInt8"),
    "void": (None, None, "Cvoid"),
}
RUST_RAW = ("c_char", "c_int", "c_uint", "c_void")
RUST_KEYWORDS = set("""as async await box break const continue crate do dyn else enum extern false final fn for
    gen if impl in let loop macro match mod move mut override priv pub ref return self static struct super
    trait true try type typeof unsafe unsized use virtual where while yield abstract become""".split())
JULIA_KEYWORDS = set("""baremodule begin break catch const continue do else elseif end export false finally for
    function global if import let local macro module mutable primitive quote return struct true try using
    where while""".split())
WIDTH = 120


class HeaderError(Exception):
    pass


# ---- the header's model ---------------------------------------------------------------------------


class CType:
    """A C type: a named base (`name`, const or not) or a pointer to another CType (`to`)."""

    def __init__(self, name=None, to=None, const=False):
        self.name, self.to, self.const = name, to, const


class Const:
    def __init__(self, name, expr, ctype, value=None):
        # ctype: the enum's typedef, "int", "unsigned" or "size_t" (offsetof/sizeof); value: None
        # when only a compiler knows it (offsetof/sizeof)
        self.name, self.expr, self.ctype, self.value = name, expr, ctype, value


class Header:
    def __init__(self):
        self.items = []  # in the header's order: ("enum", name, [Const]), ("const", Const),
        #                  ("handle", name, tag), ("struct", name, [(field, CType, length)]),
        #                  ("callback", name, CType ret, [(param, CType)]), ("function", name, ret, params)
        self.kinds = {}  # typedef name -> "enum" | "handle" | "struct" | "callback"
        self.values = {}  # constant -> its integer value where known without a compiler
        self.consts = {}  # constant -> Const

    def of(self, kind):
        return [i for i in self.items if i[0] == kind]

    def version(self):
        try:
            return "%d.%d.%d" % tuple(self.values["DDP_VERSION_" + k] for k in ("MAJOR", "MINOR", "PATCH"))
        except KeyError:
            raise HeaderError("ddp.h defines no DDP_VERSION_MAJOR, _MINOR and _PATCH")


def _strip(text):
    text = re.sub(r"\\\n", " ", text)  # continuation lines: one logical line
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group().count("\n") or " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _xmap(params, body):
    """The X(...) calls of an X-macro `#define MAP(X) X(a, 1, "t") X(b, 2, "u")` as argument lists."""
    if len(params) != 1:
        return None
    calls = re.findall(r"\b%s\s*\(([^()]*)\)" % re.escape(params[0]), body)
    rest = re.sub(r"\b%s\s*\(([^()]*)\)" % re.escape(params[0]), "", body).strip()
    return [[a.strip() for a in c.split(",")] for c in calls] if calls and not rest else None


def parse(text):
    """The Header of a ddp.h text."""
    h = Header()
    code, xmaps, defines, depth = [], {}, [], 0
    for line in _strip(text).split("\n"):
        m = re.match(r"\s*#\s*(\w+)\s*(.*)$", line)
        if not m:
            # code inside platform conditionals (extern "C") is no part of the C API
            code.append(line if depth <= 1 else "")
            continue
        directive, rest = m.group(1), m.group(2).strip()
        code.append("")
        if directive in ("if", "ifdef", "ifndef"):
            depth += 1
        elif directive == "endif":
            depth -= 1
        elif directive == "define" and depth <= 1:
            fm = re.match(r"(\w+)\(([^)]*)\)\s*(.*)$", rest)
            if fm:  # function-like: X-macros are kept, the others are C conveniences
                calls = _xmap([p.strip() for p in fm.group(2).split(",")], fm.group(3))
                if calls is not None:
                    xmaps[fm.group(1)] = calls
                continue
            om = re.match(r"(\w+)\s*(.*)$", rest)
            name, value = om.group(1), om.group(2).strip()
            if value and not value.startswith("{"):  # not the include guard, not an initializer
                defines.append((len(code), name, value))
    text = "\n".join(code)
    stmts = _statements(text)
    # #defines take their place among the declarations by position
    pos = [(p, "define", (n, v)) for p, n, v in defines]
    offsets = [(text.count("\n", 0, start), "stmt", s) for start, s in stmts]
    for _, kind, what in sorted(pos + offsets, key=lambda x: x[0]):
        if kind == "define":
            _define(h, *what)
        else:
            _declaration(h, what, xmaps)
    if not h.of("function"):
        raise HeaderError("no DDP_API function found")
    return h


def _statements(text):
    """(offset, text) of each top-level declaration (ended by ';' outside braces)."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == ";" and depth == 0:
            s = text[start:i].strip()
            if s:
                out.append((start + len(text[start:i]) - len(text[start:i].lstrip()), " ".join(s.split())))
            start = i + 1
    if text[start:].strip():
        raise HeaderError("unterminated declaration: %s" % " ".join(text[start:].split())[:80])
    return out


TOKEN = re.compile(r"\s*(0[xX][0-9a-fA-F]+[uU]?|\d+[uU]?|[A-Za-z_]\w*|<<|>>|[-+*|&~()^,])")


def _tokens(expr, what):
    out, pos = [], 0
    expr = expr.strip()
    while pos < len(expr):
        m = TOKEN.match(expr, pos)
        if not m:
            raise HeaderError("%s: cannot read %r as an integer expression" % (what, expr))
        out.append(m.group(1))
        pos = m.end()
    # the outer parentheses of a whole expression say nothing
    while out and out[0] == "(" and out[-1] == ")" and _closes(out) == len(out) - 1:
        out = out[1:-1]
    return out


def _closes(toks):
    depth = 0
    for i, t in enumerate(toks):
        depth += t == "("
        depth -= t == ")"
        if depth == 0:
            return i
    return -1


def _literal(tok):
    m = re.fullmatch(r"(0[xX][0-9a-fA-F]+|\d+)([uU]?)", tok)
    if not m:
        return None
    value = int(m.group(1), 0)
    return value, bool(m.group(2)) or value > 0x7FFFFFFF


def _expr(h, name, expr):
    """A Const for `#define name expr` or an enum value: its tokens, its C type and, without
    offsetof/sizeof, its value."""
    toks = _tokens(expr, name)
    ctype, layout, i = "int", False, 0
    while i < len(toks):
        t = toks[i]
        lit = _literal(t)
        if lit:
            ctype = "unsigned" if lit[1] and ctype == "int" else ctype
        elif t in ("offsetof", "sizeof"):
            j = i + 1 + _closes(toks[i + 1:])
            args = [a for a in toks[i + 2:j] if a != ","]
            if toks[i + 1] != "(" or len(args) != (2 if t == "offsetof" else 1):
                raise HeaderError("%s: %s( ... ) not understood in %r" % (name, t, expr))
            layout, i = True, j
        elif re.fullmatch(r"[A-Za-z_]\w*", t):
            if t not in h.consts:
                raise HeaderError("%s: %s is not a constant defined before it" % (name, t))
            if h.consts[t].ctype == "unsigned" and ctype == "int":
                ctype = "unsigned"
        i += 1
    if layout:
        return Const(name, toks, "size_t")
    value = eval(" ".join(_py_tokens(toks, lambda n: "V[%r]" % n)), {"V": h.values})  # only ints and operators
    return Const(name, toks, ctype, value=value)


def _py_tokens(toks, ident):
    out = []
    for t in toks:
        lit = _literal(t)
        out.append(str(lit[0]) if lit else ident(t) if re.fullmatch(r"[A-Za-z_]\w*", t) else t)
    return out


def _add_const(h, c):
    h.consts[c.name] = c
    if c.value is not None:
        h.values[c.name] = c.value


def _define(h, name, value):
    c = _expr(h, name, value)
    _add_const(h, c)
    h.items.append(("const", c))


def parse_type(text, what):
    t, base, const, seen_ptr = None, [], False, False
    for tok in re.findall(r"\w+|\*", text):
        if tok == "*":
            if t is None:
                t = CType(name=" ".join(base), const=const)
            t, seen_ptr = CType(to=t), True
        elif tok == "const":
            if seen_ptr:
                t.const = True  # the pointer itself: what a pointer to it points at is const
            else:
                const = True
        elif seen_ptr:
            raise HeaderError("%s: type %r not understood" % (what, text))
        else:
            base.append(tok)
    return t if t is not None else CType(name=" ".join(base), const=const)


def _declarator(text, what):
    m = re.fullmatch(r"(.*?[\s*])(\w+)\s*(?:\[\s*(\d+)\s*\])?", text.strip())
    if not m:
        raise HeaderError("%s: cannot read the declaration %r" % (what, text))
    return m.group(2), parse_type(m.group(1), what), int(m.group(3)) if m.group(3) else None


def _params(text, what):
    text = text.strip()
    if text in ("", "void"):
        return []
    out = []
    for p in text.split(","):
        name, t, n = _declarator(p, what)
        if n:
            raise HeaderError("%s: array parameter %r" % (what, p))
        out.append((name, t))
    return out


def _check_type(h, t, what):
    while t.to is not None:
        t = t.to
    if t.name not in SCALARS and t.name not in h.kinds:
        raise HeaderError("%s: type %r has no mapping (add it to SCALARS in tools/gen_bindings.py)" % (what, t.name))


def _declaration(h, s, xmaps):
    m = re.fullmatch(r"typedef enum (\w+ )?\{(.*)\} (\w+)", s)
    if m:
        return _enum(h, m.group(3), m.group(2), xmaps)
    m = re.fullmatch(r"typedef struct (\w+ )?\{(.*)\} (\w+)", s)
    if m:
        name, fields = m.group(3), []
        for decl in m.group(2).split(";"):
            if decl.strip():
                f, t, n = _declarator(decl, name)
                _check_type(h, t, "%s.%s" % (name, f))
                fields.append((f, t, n))
        h.kinds[name] = "struct"
        h.items.append(("struct", name, fields))
        return
    m = re.fullmatch(r"typedef struct (\w+) ?\* ?(\w+)", s)
    if m:
        h.kinds[m.group(2)] = "handle"
        h.items.append(("handle", m.group(2), m.group(1)))
        return
    for kind, pattern in (("callback", r"typedef (.+?)\( ?\* ?(\w+) ?\) ?\((.*)\)"),
                          ("function", r"DDP_API (.+?[\s*])(\w+) ?\((.*)\)")):
        m = re.fullmatch(pattern, s)
        if m:
            name = m.group(2)
            ret, params = parse_type(m.group(1), name), _params(m.group(3), name)
            for t in [ret] + [t for _, t in params]:
                _check_type(h, t, name)
            if kind == "callback":
                h.kinds[name] = kind
            h.items.append((kind, name, ret, params))
            return
    raise HeaderError("declaration not understood (see the discipline in tools/gen_bindings.py): %s" % s[:100])


def _enum(h, name, body, xmaps):
    def expand(m):
        calls = xmaps.get(m.group(1))
        if calls is None:
            return m.group(0)
        return "".join("%s = %s," % (c[0], c[1]) for c in calls)

    body = re.sub(r"\b(\w+)\s*\(\s*\w+\s*\)", expand, body)
    consts, nxt = [], 0
    for entry in body.split(","):
        entry = entry.strip()
        if not entry:
            continue
        m = re.fullmatch(r"(\w+)\s*(?:=\s*(.+))?", entry)
        if not m:
            raise HeaderError("%s: enumerator %r not understood" % (name, entry))
        c = _expr(h, m.group(1), m.group(2)) if m.group(2) else Const(m.group(1), [str(nxt)], "int", value=nxt)
        if c.value is None:
            raise HeaderError("%s: %s is not a constant integer" % (name, c.name))
        c = Const(c.name, [str(c.value)], name, value=c.value)
        _add_const(h, c)
        consts.append(c)
        nxt = c.value + 1
    h.kinds[name] = "enum"
    h.items.append(("enum", name, consts))


def render_expr(toks, offsetof, sizeof, literal, ident=lambda t: t):
    """An expression's tokens in another language: offsetof(struct, field), sizeof(type), the literals
    (value text without its suffix, whether unsigned) and the identifiers each by the language's own."""
    out, i = [], 0
    while i < len(toks):
        t, lit = toks[i], _literal(toks[i])
        if t == "offsetof":
            out.append(offsetof(toks[i + 2], toks[i + 4]))
            i += 6
        elif t == "sizeof":
            out.append(sizeof(CType(name=toks[i + 2])))
            i += 4
        else:
            out.append(literal(t.rstrip("uU"), lit[1]) if lit else ident(t))
            i += 1
    s = " ".join(out)
    return re.sub(r"\( ", "(", re.sub(r" \)", ")", s)).replace(" , ", ", ")


# ---- output helpers -------------------------------------------------------------------------------


def wrap(head, items, tail, indent=None):
    """`head` + items joined by ", " + `tail`, broken after commas within WIDTH columns; continuation
    lines start under the first item (or at `indent` when given)."""
    line = head + ", ".join(items) + tail
    if len(line) <= WIDTH or not items:
        return line
    pad = " " * (len(head.split("\n")[-1]) if indent is None else indent)
    lines, cur, fresh = [], head, True
    for k, it in enumerate(items):
        piece = it + (", " if k < len(items) - 1 else tail)
        if not fresh and len(cur) + len(piece.rstrip()) > WIDTH:
            lines.append(cur.rstrip())
            cur = pad
        cur, fresh = cur + piece, False
    lines.append(cur)
    return "\n".join(lines)


BANNER = ("Generated by tools/gen_bindings.py from include/ddp.h: do not edit. `make bindings` rewrites it;",
          "`make bindings-check` (CI) fails while it differs from what the header generates.")


# ---- Python (ctypes) ------------------------------------------------------------------------------


def py_type(h, t):
    if t.to is not None:
        if t.to.to is None and t.to.name == "char":
            return "ctypes.c_char_p"
        if t.to.to is None and t.to.name == "void":
            return "ctypes.c_void_p"
        return "ctypes.POINTER(%s)" % py_type(h, t.to)
    if t.name in h.kinds:
        return t.name
    return SCALARS[t.name][0]


def gen_python(h):
    blocks, late, names = [], [], []
    for item in h.items:
        kind = item[0]
        if kind == "enum":
            lines = ["# enum %s" % item[1], "%s = ctypes.c_int" % item[1]]
            blocks.append((kind, lines + ["%s = %d" % (c.name, c.value) for c in item[2]]))
            names += [item[1]] + [c.name for c in item[2]]
        elif kind == "const":
            c = item[1]
            line = "%s = %s" % (c.name, render_expr(c.expr, "{}.{}.offset".format,
                                                     lambda t: "ctypes.sizeof(%s)" % py_type(h, t), lambda v, u: v))
            late.append(line) if c.value is None else blocks.append((kind, [line]))
            names.append(c.name)
        elif kind == "handle":
            blocks.append((kind, ["%s = ctypes.c_void_p  # struct %s*" % (item[1], item[2])]))
            names.append(item[1])
        elif kind == "struct":
            lines = ["class %s(ctypes.Structure):" % item[1], "    _fields_ = ["]
            for f, t, n in item[2]:
                lines.append('        ("%s", %s),' % (f, py_type(h, t) + (" * %d" % n if n else "")))
            blocks.append(("class", lines + ["    ]"]))
            names.append(item[1])
        elif kind == "callback":
            ret = "None" if _is_void(item[2]) else py_type(h, item[2])
            args = [ret] + [py_type(h, t) for _, t in item[3]]
            blocks.append((kind, [wrap("%s = ctypes.CFUNCTYPE(" % item[1], args, ")")]))
            names.append(item[1])
    if late:
        blocks.append(("const", ["# Layouts, once the structs are defined."] + late))
    funcs = h.of("function")
    lines = ["# name: (restype, argtypes), in the header's order.", "FUNCTIONS = {"]
    for _, name, ret, params in funcs:
        res = "None" if _is_void(ret) else py_type(h, ret)
        lines.append(wrap('    "%s": (%s, [' % (name, res), [py_type(h, t) for _, t in params], "]),"))
    lines += ["}", "# The functions that return a %s: declare() gives them the errcheck." % STATUS_TYPE]
    lines.append(wrap("RETURNS_STATUS = frozenset([", ['"%s"' % f[1] for f in funcs if _is_status(f[2])], "])",
                      indent=4))
    blocks.append(("functions", lines))
    blocks.append(("class", [
        "def declare(lib, errcheck=None):",
        '    """Sets restype and argtypes of every function of ddp.h on `lib` (a ctypes.CDLL), and `errcheck` on',
        '    those of RETURNS_STATUS (it gets the status as an int). Returns `lib`."""',
        "    for name, (restype, argtypes) in FUNCTIONS.items():",
        "        f = getattr(lib, name)",
        "        f.restype, f.argtypes = restype, argtypes",
        "        if errcheck is not None and name in RETURNS_STATUS:",
        "            f.errcheck = errcheck",
        "    return lib"]))
    names += ["FUNCTIONS", "RETURNS_STATUS", "declare"]
    blocks.append(("all", [wrap("__all__ = [", ['"%s"' % n for n in names], "]", indent=11)]))
    head = ['"""include/ddp.h for ctypes: its types, constants and struct layouts; FUNCTIONS and declare() for its',
            "functions.", "", BANNER[0], BANNER[1], '"""', "import ctypes"]
    return join_blocks(head, blocks, lambda a, b: 2 if "class" in (a, b) else 1 if a != b or a == "enum" else 0)


def _is_void(t):
    return t.to is None and t.name == "void"


def _is_status(t):
    return t.to is None and t.name == STATUS_TYPE


def join_blocks(head, blocks, blank):
    """The head, then the blocks ((kind, lines)) with blank(previous kind, kind) blank lines between them."""
    out, prev = list(head), None
    for kind, lines in blocks:
        out += [""] * (1 if prev is None else blank(prev, kind)) + lines
        prev = kind
    return "\n".join(out) + "\n"


def _assign(line, sep=" = "):
    """A long assignment with its value on the next line (Rust and Julia allow it)."""
    return line.replace(sep, sep.rstrip() + "\n    ", 1) if len(line) > WIDTH else line


def _spaced(a, b):
    return 0 if a == b and a in ("const", "callback") else 1


# ---- Rust -----------------------------------------------------------------------------------------


def rs_type(h, t):
    if t.to is not None:
        return ("*const " if t.to.const else "*mut ") + rs_type(h, t.to)
    if t.name in h.kinds:
        return t.name
    return SCALARS[t.name][1] or "c_void"


def rs_ident(name):
    if name in ("self", "Self", "super", "crate"):
        raise HeaderError("%s cannot be a Rust identifier" % name)
    return "r#" + name if name in RUST_KEYWORDS else name


def rs_params(h, params):
    return ["%s: %s" % (rs_ident(n), rs_type(h, t)) for n, t in params]


def _rs_const_type(c):
    return {"int": "c_int", "unsigned": "c_uint", "size_t": "usize"}.get(c.ctype, c.ctype)


def _rs_plain(h, t):
    """Whether a field's type is a number (so the struct can derive Default)."""
    return t.to is None and (t.name in SCALARS or h.kinds.get(t.name) == "enum")


def gen_rust(h):
    blocks, late = [], []
    for item in h.items:
        kind = item[0]
        if kind == "enum":
            lines = ["// enum %s" % item[1], "pub type %s = c_int;" % item[1]]
            blocks.append((kind, lines + ["pub const %s: %s = %d;" % (c.name, item[1], c.value) for c in item[2]]))
        elif kind == "const":
            c = item[1]
            value = render_expr(c.expr, "std::mem::offset_of!({}, {})".format,
                                lambda t: "std::mem::size_of::<%s>()" % rs_type(h, t), lambda v, u: v)
            line = _assign("pub const %s: %s = %s;" % (c.name, _rs_const_type(c), value))
            late.append(line) if c.value is None else blocks.append((kind, [line]))
        elif kind == "handle":
            blocks.append((kind, ["#[repr(C)]", "pub struct %s {" % item[2], "    _private: [u8; 0],", "}",
                                  "pub type %s = *mut %s;" % (item[1], item[2])]))
        elif kind == "struct":
            plain = all(_rs_plain(h, t) and not n for _, t, n in item[2])
            lines = ["#[repr(C)]", "#[derive(Clone, Copy, Debug%s)]" % (", Default" if plain else ""),
                     "pub struct %s {" % item[1]]
            for f, t, n in item[2]:
                ty = rs_type(h, t)
                lines.append("    pub %s: %s," % (rs_ident(f), "[%s; %d]" % (ty, n) if n else ty))
            blocks.append((kind, lines + ["}"]))
        elif kind == "callback":
            ret = "" if _is_void(item[2]) else " -> " + rs_type(h, item[2])
            blocks.append((kind, [wrap("pub type %s = Option<unsafe extern \"C\" fn(" % item[1], rs_params(h, item[3]),
                                       ")%s>;" % ret, indent=4)]))
    if late:
        blocks.append(("const", late))
    lines = ['extern "C" {']
    for _, name, ret, params in h.of("function"):
        r = "" if _is_void(ret) else " -> " + rs_type(h, ret)
        lines.append(wrap("    pub fn %s(" % name, rs_params(h, params), ")%s;" % r))
    blocks.append(("functions", lines + ["}"]))
    head = ["// include/ddp.h for Rust: its types, constants, #[repr(C)] structs and functions.",
            "// " + BANNER[0], "// " + BANNER[1], "@USE"]
    text = join_blocks(head, blocks, _spaced)
    used = [n for n in RUST_RAW if re.search(r"\b%s\b" % n, text.replace("@USE", ""))]
    return text.replace("@USE", "use std::os::raw::{%s};" % ", ".join(used))


# ---- Julia ----------------------------------------------------------------------------------------


def jl_name(name):
    """Constants drop DDP_: the module is the namespace (LibDDP.F32, LibDDP.ERR_TIMEOUT)."""
    return name[4:] if name.startswith("DDP_") else name


def jl_type(h, t):
    if t.to is not None:
        return "Ptr{%s}" % jl_type(h, t.to)
    if t.name in h.kinds:
        return t.name
    return SCALARS[t.name][2]


def jl_ident(name):
    if name in JULIA_KEYWORDS:
        raise HeaderError("%s is a Julia keyword: no field of that name can be mirrored" % name)
    return name


JL_OFFSETOF = "Int(fieldoffset({0}, findfirst(==(:{1}), fieldnames({0}))))"


def gen_julia(h):
    blocks, late = [], []
    for item in h.items:
        kind = item[0]
        if kind == "enum":
            lines = ["# enum %s" % item[1], "const %s = Cint" % item[1]]
            blocks.append((kind, lines + ["const %s = Cint(%d)" % (jl_name(c.name), c.value) for c in item[2]]))
        elif kind == "const":
            c = item[1]
            value = render_expr(c.expr, JL_OFFSETOF.format, lambda t: "sizeof(%s)" % jl_type(h, t),
                                lambda v, u: "Cuint(%s)" % v if u else v, jl_name)
            line = _assign("const %s = %s" % (jl_name(c.name), value))
            late.append(line) if c.value is None else blocks.append((kind, [line]))
        elif kind == "handle":
            blocks.append((kind, ["const %s = Ptr{Cvoid}  # struct %s*" % (item[1], item[2])]))
        elif kind == "struct":
            mutable = item[1] in JULIA_MUTABLE
            lines = ["%sstruct %s" % ("mutable " if mutable else "", item[1])]
            for f, t, n in item[2]:
                ty = jl_type(h, t)
                lines.append("    %s::%s" % (jl_ident(f), "NTuple{%d,%s}" % (n, ty) if n else ty))
            if mutable:
                lines.append("    %s() = new()" % item[1])
            blocks.append((kind, lines + ["end"]))
        elif kind == "callback":
            blocks.append((kind, ["const %s = Ptr{Cvoid}  # a C function pointer" % item[1]]))
    if late:
        blocks.append(("const", late))
    blocks.append(("functions", ["# Every function of ddp.h, in its order.",
                                 wrap("const FUNCTIONS = (", [":" + f[1] for f in h.of("function")], ")")]))
    head = ["# include/ddp.h for Julia: its types, constants (DDP_ dropped: the module is the namespace), struct",
            "# layouts and FUNCTIONS, every function's symbol.", "# " + BANNER[0], "# " + BANNER[1]]
    return join_blocks(head, blocks, lambda a, b: 0 if a == b and a in ("const", "callback", "handle") else 1)


# ---- versions -------------------------------------------------------------------------------------


def _set_line(text, pattern, value, what):
    new, n = re.subn(pattern, lambda m: m.group(1) + value + m.group(2), text, count=1, flags=re.M)
    if n != 1:
        raise HeaderError("%s: no version line to write" % what)
    return new


def cargo_toml(text, version, what):
    m = re.search(r"^\[package\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    if not m:
        raise HeaderError("%s: no [package] section" % what)
    section = _set_line(m.group(1), r'^(version = ")[^"]*(")', version, what)
    return text[:m.start(1)] + section + text[m.end(1):]


def crate_name(text):
    m = re.search(r'^\[package\]\n(?:.*\n)*?name = "([^"]+)"', text, re.M)
    return m.group(1) if m else None


def cargo_lock(text, version, crates, what):
    def one(m):
        block = m.group(0)
        name = re.search(r'^name = "([^"]+)"', block, re.M)
        if name and name.group(1) in crates:
            block = _set_line(block, r'^(version = ")[^"]*(")', version, what)
        return block
    return re.sub(r"^\[\[package\]\]\n(?:(?!\[\[).*\n?)*", one, text, flags=re.M)


def julia_project(text, version, what):
    head, sep, rest = text.partition("\n[")
    return _set_line(head, r'^(version = ")[^"]*(")', version, what) + sep + rest


# ---- main -----------------------------------------------------------------------------------------


def outputs(header_text, root):
    """{path relative to root: the text it must hold}."""
    h = parse(header_text)
    version = h.version()
    out = {PYTHON_OUT: gen_python(h), RUST_OUT: gen_rust(h), JULIA_OUT: gen_julia(h)}
    crates = []
    for rel in CARGO_TOMLS:
        text = _read(root, rel)
        crates.append(crate_name(text))
        out[rel] = cargo_toml(text, version, rel)
    out[CARGO_LOCK] = cargo_lock(_read(root, CARGO_LOCK), version, crates, CARGO_LOCK)
    out[JULIA_PROJECT] = julia_project(_read(root, JULIA_PROJECT), version, JULIA_PROJECT)
    return out


def _read(root, rel):
    path = os.path.join(root, rel)
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        return f.read()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each file that differs")
    ap.add_argument("--header", help="the header (default: ROOT/include/ddp.h)")
    ap.add_argument("--root", default=ROOT, help="the tree whose bindings are written or checked (default: this one)")
    args = ap.parse_args(argv)
    header = args.header or os.path.join(args.root, "include", "ddp.h")
    try:
        with open(header) as f:
            wanted = outputs(f.read(), args.root)
    except (HeaderError, OSError) as e:
        print("gen_bindings: %s: %s" % (header, e), file=sys.stderr)
        return 2
    stale = []
    for rel, text in wanted.items():
        have = _read(args.root, rel)
        if have == text:
            continue
        stale.append(rel)
        if args.check:
            print("bindings-check: %s is stale: it differs from what %s generates (make bindings)" % (
                rel, os.path.relpath(header, args.root)))
            diff = list(difflib.unified_diff(have.splitlines(), text.splitlines(), "checked in", "generated",
                                             lineterm="", n=1))
            print("\n".join("    " + d for d in diff[:24] + (["..."] if len(diff) > 24 else [])))
        else:
            with open(os.path.join(args.root, rel), "w") as f:
                f.write(text)
            print("gen_bindings: wrote %s" % rel)
    if args.check:
        if stale:
            print("bindings-check: %d of %d files stale" % (len(stale), len(wanted)))
            return 1
        print("bindings-check: %d files match %s" % (len(wanted), os.path.relpath(header, args.root)))
    elif not stale:
        print("gen_bindings: %d files up to date" % len(wanted))
    return 0


if __name__ == "__main__":
    sys.exit(main())
