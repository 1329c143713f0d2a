"""The low layers are generated from include/ddp.h by tools/gen_bindings.py, and `make bindings-check`
(CI) fails while a checked-in file differs. These tests run that check on this tree and on copies
whose header changed, the generated Python layer against a C compiler's layouts, and the library
against the generated declarations."""
import ctypes
import importlib.util
import os
import re
import shutil
import subprocess

import pytest

from conftest import ROOT, PYTHON
from libddp import _lib as L
from libddp import _ddp_h as H

SCRIPT = os.path.join(ROOT, "tools", "gen_bindings.py")
HEADER = open(os.path.join(ROOT, "include", "ddp.h")).read()
GENERATED = ("bindings/python/libddp/_ddp_h.py", "bindings/rust/libddp-sys/src/generated.rs",
             "bindings/julia/src/ddp_h.jl")
VERSIONED = ("bindings/rust/libddp-sys/Cargo.toml", "bindings/rust/libddp/Cargo.toml", "bindings/rust/Cargo.lock",
             "bindings/julia/Project.toml")
JULIA_DIR = os.path.join(ROOT, "bindings", "julia")


def gen(*args, root=ROOT):
    p = subprocess.run([PYTHON, SCRIPT, "--root", str(root)] + list(args), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT)
    return p.returncode, p.stdout.decode()


def tree(tmp_path, header):
    """A copy of the header (as given) and of every file the script writes."""
    for rel in GENERATED + VERSIONED:
        os.makedirs(os.path.dirname(str(tmp_path / rel)), exist_ok=True)
        shutil.copy(os.path.join(ROOT, rel), str(tmp_path / rel))
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "ddp.h").write_text(header)
    return tmp_path


def changed(old, new):
    assert HEADER.count(old) == 1, old
    return HEADER.replace(old, new)


def stale_files(out):
    return re.findall(r"^bindings-check: (\S+) is stale", out, re.M)


def test_checked_in_files_match_the_header():
    rc, out = gen("--check")
    assert rc == 0 and "files match include/ddp.h" in out, out


def test_check_fails_on_a_declaration_removed_from_the_header(tmp_path):
    root = tree(tmp_path, changed("DDP_API ddp_status_t ddp_set_grad_ptr(ddp_t ddp, int index, void* grad);\n", ""))
    rc, out = gen("--check", root=root)
    assert rc == 1, out
    assert stale_files(out) == list(GENERATED), out
    assert '-    "ddp_set_grad_ptr": (ddp_status_t' in out and "-    pub fn ddp_set_grad_ptr(" in out, out


def test_check_fails_on_a_field_added_then_passes_once_regenerated(tmp_path):
    root = tree(tmp_path, changed("  uint64_t layout_epoch; ", "  uint64_t layout_epoch;\n  int64_t added_field; "))
    rc, out = gen("--check", root=root)
    assert rc == 1 and stale_files(out) == list(GENERATED), out
    assert '+        ("added_field", ctypes.c_int64),' in out and "+    pub added_field: i64," in out, out
    assert "+    added_field::Int64" in out, out
    rc, out = gen(root=root)
    assert rc == 0 and out.count("gen_bindings: wrote") == len(GENERATED), out
    rc, out = gen("--check", root=root)
    assert rc == 0, out


def test_check_names_every_file_that_carries_the_version(tmp_path):
    root = tree(tmp_path, changed("#define DDP_VERSION_MINOR 2\n", "#define DDP_VERSION_MINOR 7\n"))
    rc, out = gen("--check", root=root)
    assert rc == 1 and sorted(stale_files(out)) == sorted(GENERATED + VERSIONED), out
    assert gen(root=root)[0] == 0
    for rel in VERSIONED:
        assert re.search(r'^version = "0\.7\.0"$', (root / rel).read_text(), re.M), rel
    # Cargo.lock: only the workspace's own crates take the version
    assert (root / "bindings/rust/Cargo.lock").read_text().count('version = "0.7.0"') == 2


def test_a_declaration_the_script_cannot_read_is_an_error(tmp_path):
    root = tree(tmp_path, changed("DDP_API ddp_status_t ddp_barrier(ddp_t ddp);",
                                  "DDP_API ddp_status_t ddp_barrier(ddp_t ddp);\nDDP_API int ddp_odd(long double x);"))
    rc, out = gen("--check", root=root)
    assert rc == 2 and "ddp_odd: type 'long double' has no mapping" in out, out


def test_a_new_function_gets_every_width_in_every_layer(tmp_path):
    decl = ("DDP_API ddp_status_t ddp_new_thing(ddp_t ddp, size_t n, const int64_t* xs, unsigned flags, "
            "void* const* bufs, ddp_log_fn fn, const char* name, double* out);")
    anchor = "DDP_API ddp_status_t ddp_set_log_callback(ddp_log_fn fn, void* user);"
    root = tree(tmp_path, changed(anchor, anchor + "\n" + decl))
    assert gen(root=root)[0] == 0
    spec = importlib.util.spec_from_file_location("gen_copy", str(root / GENERATED[0]))
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    P = ctypes.POINTER
    assert m.FUNCTIONS["ddp_new_thing"] == (ctypes.c_int, [
        ctypes.c_void_p, ctypes.c_size_t, P(ctypes.c_int64), ctypes.c_uint, P(ctypes.c_void_p), m.ddp_log_fn,
        ctypes.c_char_p, P(ctypes.c_double)])
    assert "ddp_new_thing" in m.RETURNS_STATUS
    rs = re.sub(r"\s+", " ", (root / GENERATED[1]).read_text())
    assert ("pub fn ddp_new_thing(ddp: ddp_t, n: usize, xs: *const i64, flags: c_uint, bufs: *const *mut c_void, "
            "r#fn: ddp_log_fn, name: *const c_char, out: *mut f64) -> ddp_status_t;") in rs
    assert ":ddp_new_thing" in (root / GENERATED[2]).read_text()


def test_generated_layouts_match_the_c_compiler(tmp_path):
    """Every struct of the generated layer against sizeof/offsetof of a C program over ddp.h."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        pytest.skip("no C compiler")
    structs = [getattr(H, n) for n in H.__all__ if isinstance(getattr(H, n), type)
               and issubclass(getattr(H, n), ctypes.Structure)]
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "ddp.h"', "int main(void) {",
             '  printf("V1 %zu\\n", (size_t)DDP_CONFIG_V1_SIZE);']
    want = ["V1 %d" % H.DDP_CONFIG_V1_SIZE]
    for s in structs:
        lines.append('  printf("%%s %%zu\\n", "%s", sizeof(%s));' % (s.__name__, s.__name__))
        want.append("%s %d" % (s.__name__, ctypes.sizeof(s)))
        for f, _ in s._fields_:
            lines.append('  printf("%%s %%zu\\n", "%s.%s", offsetof(%s, %s));' % (s.__name__, f, s.__name__, f))
            want.append("%s.%s %d" % (s.__name__, f, getattr(s, f).offset))
    (tmp_path / "layout.c").write_text("\n".join(lines + ["  return 0;", "}"]) + "\n")
    subprocess.run([cc, "-std=c99", "-I", os.path.join(ROOT, "include"), str(tmp_path / "layout.c"), "-o",
                    str(tmp_path / "layout")], check=True)
    got = subprocess.run([str(tmp_path / "layout")], stdout=subprocess.PIPE, check=True).stdout.decode().split("\n")
    assert len(structs) >= 6 and got[:-1] == want


def test_every_declared_function_resolves_in_the_library():
    for name, (restype, argtypes) in H.FUNCTIONS.items():
        f = getattr(L.lib, name)
        assert f.argtypes == argtypes and f.restype is restype, name
        assert (f.errcheck is not None) == (name in H.RETURNS_STATUS), name


def test_julia_package_layout():
    """bindings/julia is a package Pkg.develop can use: Project.toml, src/LibDDP.jl (including the
    generated src/ddp_h.jl), test/runtests.jl."""
    toml = open(os.path.join(JULIA_DIR, "Project.toml")).read()
    fields = dict(re.findall(r'^(\w+) = "([^"]*)"', toml, re.M))
    assert fields.get("name") == "LibDDP", toml
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", fields.get("uuid", "")), toml
    assert 'Libdl = "8f399da3-3557-5675-b5ff-fb832c97cbdb"' in toml  # the stdlib the module uses
    src = open(os.path.join(JULIA_DIR, "src", "LibDDP.jl")).read()
    assert re.search(r"^module LibDDP$", src, re.M) and src.rstrip().endswith("end # module"), "src/LibDDP.jl"
    assert re.search(r'^include\("ddp_h\.jl"\)$', src, re.M), "src/LibDDP.jl includes the generated layer"
    for used in re.findall(r"^using (\w+)$", src, re.M):
        assert used + " = " in toml, "src/LibDDP.jl uses %s, Project.toml lacks it" % used
    for t in ("runtests.jl", "mpi.jl"):
        text = open(os.path.join(JULIA_DIR, "test", t)).read()
        assert 'include(joinpath(@__DIR__, "..", "src", "LibDDP.jl"))' in text, t
    assert not os.path.exists(os.path.join(JULIA_DIR, "LibDDP.jl")), "the old single file is back"
