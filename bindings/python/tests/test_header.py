"""The low layer must match include/ddp.h: every function with its exact types, structs, constants."""
import os
import re
import shutil
import subprocess
import sys

import pytest

import header_check
from conftest import PKG, ROOT, PYTHON
from libddp import _lib as L

HEADER = open(os.path.join(ROOT, "include", "ddp.h")).read()


def test_header_matches_python_layer():
    assert header_check.check(HEADER) == []


def test_every_declared_function_resolves_in_the_library():
    for name in header_check.parse_functions(HEADER):
        assert getattr(L.lib, name).argtypes is not None, name


def test_detects_a_removed_function():
    table = dict(L.FUNCTIONS)
    del table["ddp_grad_ready_ptr"]
    problems = header_check.check(HEADER, functions=table)
    assert any("ddp_grad_ready_ptr" in p and "missing" in p for p in problems), problems


def test_detects_a_mistyped_parameter_and_return():
    import ctypes
    table = dict(L.FUNCTIONS)
    res, args = table["ddp_register_grad"]
    table["ddp_register_grad"] = (res, args[:2] + [ctypes.c_uint] + args[3:])  # size_t numel -> unsigned
    table["ddp_version"] = (ctypes.c_long, [])
    problems = header_check.check(HEADER, functions=table)
    assert any("ddp_register_grad: parameter 2" in p for p in problems), problems
    assert any(p.startswith("ddp_version: returns") for p in problems), problems


def test_detects_a_new_header_function_and_a_changed_struct():
    extra = HEADER.replace("DDP_API ddp_status_t ddp_destroy(ddp_t ddp);",
                           "DDP_API ddp_status_t ddp_destroy(ddp_t ddp);\nDDP_API int ddp_new_thing(size_t n);")
    assert any("ddp_new_thing" in p for p in header_check.check(extra))
    changed = HEADER.replace("  int check_finite;", "  int check_finite;\n  int added_field;")
    assert any("ddp_config_t" in p for p in header_check.check(changed))


def _source_env():
    """A child that tests a copy of the sources (not the installed package), with this library."""
    env = {k: v for k, v in os.environ.items() if k != "LIBDDP_TEST_INSTALLED"}
    env["LIBDDP_PATH"] = L.path
    return env


def test_drift_test_fails_on_a_copy_with_a_declaration_removed(tmp_path):
    """Simulates deleting one declaration from the package: this very test file must then fail."""
    pkg = tmp_path / "python"
    shutil.copytree(os.path.join(PKG, "libddp"), pkg / "libddp")
    shutil.copytree(os.path.dirname(__file__), pkg / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    src = (pkg / "libddp" / "_lib.py").read_text()
    line = '    "ddp_set_grad_ptr": (ddp_status_t, [ddp_t, _int, _vp]),\n'
    assert line in src
    (pkg / "libddp" / "_lib.py").write_text(src.replace(line, ""))
    # the copied conftest computes ROOT from its own location: give it the real header at that place
    (tmp_path / "include").mkdir()
    shutil.copy(os.path.join(ROOT, "include", "ddp.h"), tmp_path / "include" / "ddp.h")
    (tmp_path / "bindings").mkdir()
    shutil.move(str(pkg), str(tmp_path / "bindings" / "python"))
    test = tmp_path / "bindings" / "python" / "tests" / "test_header.py"
    p = subprocess.run([PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test), "-k",
                        "matches_python_layer"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       cwd=str(tmp_path), env=_source_env())
    out = p.stdout.decode()
    assert p.returncode != 0, out
    assert "ddp_set_grad_ptr: declared in ddp.h, missing from the Python layer" in out, out


def _struct_fields_in(text, pattern):
    m = re.search(pattern, text, re.S)
    assert m, pattern
    return re.findall(r"^\s*(?:pub )?(\w+)\s*(?::|::)", m.group(1), re.M)


RUST = os.path.join(ROOT, "bindings", "rust", "libddp-sys", "src", "lib.rs")
JULIA_DIR = os.path.join(ROOT, "bindings", "julia")
JULIA = os.path.join(JULIA_DIR, "src", "LibDDP.jl")
MIRRORS = (("ddp_config_t", "ddp_config_t", "Config"), ("ddp_stats_t", "ddp_stats_t", "Stats"),
           ("ddp_bucket_info_t", "ddp_bucket_info_t", "BucketInfo"), ("ddp_shard_info_t", "ddp_shard_info_t", "ShardInfo"))


def other_layer_problems(header, rs, jl):
    """The Rust and Julia layers against the header, by name: every function, every struct field in
    order. Returns one line per difference, naming the layer."""
    problems = []
    decl = set(header_check.parse_functions(header))
    structs = header_check.parse_structs(header)
    rs_funcs = set(re.findall(r"pub fn (ddp_\w+)\(", rs))
    m = re.search(r"const FUNCTIONS = \((.*?)\)\n", jl, re.S)
    jl_funcs = set(re.findall(r":(ddp_\w+)", m.group(1))) if m else set()
    for layer, funcs in (("Rust", rs_funcs), ("Julia", jl_funcs)):
        for f in sorted(decl - funcs):
            problems.append("%s: %s declared in ddp.h, missing" % (layer, f))
        for f in sorted(funcs - decl):
            problems.append("%s: %s not in ddp.h" % (layer, f))
    for cname, rname, jname in MIRRORS:
        want = [f for f, _, _ in structs[cname]]
        for layer, text, pattern in (("Rust", rs, r"pub struct %s \{(.*?)\n\}" % rname),
                                     ("Julia", jl, r"struct %s\n(.*?)\nend" % jname)):
            got = _struct_fields_in(text, pattern)
            if got != want:
                problems.append("%s: %s has fields %s, ddp.h %s" % (layer, cname, got, want))
    return problems


def _layers():
    return open(RUST).read(), open(JULIA).read()


def test_rust_and_julia_layers_declare_every_function_and_field():
    assert other_layer_problems(HEADER, *_layers()) == []


def test_rust_and_julia_checks_fail_on_a_field_added_to_the_header_only():
    for struct, anchor in (("ddp_config_t", "  size_t host_piece_bytes;\n"),
                           ("ddp_stats_t", "  int rank;\n")):
        assert HEADER.count(anchor) == 1, anchor
        changed = HEADER.replace(anchor, anchor + "  int added_field;\n")
        problems = other_layer_problems(changed, *_layers())
        for layer in ("Rust", "Julia"):
            assert any(p.startswith(layer + ": " + struct) and "added_field" in p for p in problems), problems


def test_rust_and_julia_checks_fail_on_a_function_added_to_the_header_only():
    extra = HEADER.replace("DDP_API ddp_status_t ddp_destroy(ddp_t ddp);",
                           "DDP_API ddp_status_t ddp_destroy(ddp_t ddp);\nDDP_API int ddp_new_thing(size_t n);")
    problems = other_layer_problems(extra, *_layers())
    assert "Rust: ddp_new_thing declared in ddp.h, missing" in problems, problems
    assert "Julia: ddp_new_thing declared in ddp.h, missing" in problems, problems


def test_rust_and_julia_checks_fail_on_a_declaration_removed_from_one_layer():
    rs, jl = _layers()
    assert "pub fn ddp_synchronize(" in rs and ":ddp_synchronize," in jl
    assert "Rust: ddp_synchronize declared in ddp.h, missing" in other_layer_problems(
        HEADER, rs.replace("pub fn ddp_synchronize(", "pub fn gone_synchronize("), jl)
    assert "Julia: ddp_synchronize declared in ddp.h, missing" in other_layer_problems(
        HEADER, rs, jl.replace(":ddp_synchronize,", ""))


def _library_version():
    v = {k: re.search(r"#define DDP_VERSION_%s (\d+)" % k, HEADER).group(1) for k in ("MAJOR", "MINOR", "PATCH")}
    return "%s.%s.%s" % (v["MAJOR"], v["MINOR"], v["PATCH"])


def test_julia_package_layout():
    """bindings/julia is a package Pkg.develop can use: Project.toml, src/LibDDP.jl, test/runtests.jl."""
    toml = open(os.path.join(JULIA_DIR, "Project.toml")).read()
    fields = dict(re.findall(r'^(\w+) = "([^"]*)"', toml, re.M))
    assert fields.get("name") == "LibDDP", toml
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", fields.get("uuid", "")), toml
    assert fields.get("version") == _library_version(), (fields.get("version"), _library_version())
    assert 'Libdl = "8f399da3-3557-5675-b5ff-fb832c97cbdb"' in toml  # the stdlib the module uses
    src = open(JULIA).read()
    assert re.search(r"^module LibDDP$", src, re.M) and src.rstrip().endswith("end # module"), "src/LibDDP.jl"
    for used in re.findall(r"^using (\w+)$", src, re.M):
        assert used + " = " in toml, "src/LibDDP.jl uses %s, Project.toml lacks it" % used
    for t in ("runtests.jl", "mpi.jl"):
        text = open(os.path.join(JULIA_DIR, "test", t)).read()
        assert 'include(joinpath(@__DIR__, "..", "src", "LibDDP.jl"))' in text, t
    assert not os.path.exists(os.path.join(JULIA_DIR, "LibDDP.jl")), "the old single file is back"
