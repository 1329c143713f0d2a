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
                       cwd=str(tmp_path), env=dict(os.environ))
    out = p.stdout.decode()
    assert p.returncode != 0, out
    assert "ddp_set_grad_ptr: declared in ddp.h, missing from the Python layer" in out, out


def _struct_fields_in(text, pattern):
    m = re.search(pattern, text, re.S)
    assert m, pattern
    return re.findall(r"^\s*(?:pub )?(\w+)\s*(?::|::)", m.group(1), re.M)


def test_rust_and_julia_layers_declare_every_function_and_field():
    """The other bindings, checked by name: every function of ddp.h and every struct field, in order."""
    decl = set(header_check.parse_functions(HEADER))
    structs = header_check.parse_structs(HEADER)
    rs = open(os.path.join(ROOT, "bindings", "rust", "libddp-sys", "src", "lib.rs")).read()
    jl = open(os.path.join(ROOT, "bindings", "julia", "LibDDP.jl")).read()
    assert set(re.findall(r"pub fn (ddp_\w+)\(", rs)) == decl
    jl_funcs = re.search(r"const FUNCTIONS = \((.*?)\)\n", jl, re.S).group(1)
    assert set(re.findall(r":(ddp_\w+)", jl_funcs)) == decl
    for cname, rname, jname in (("ddp_config_t", "ddp_config_t", "Config"), ("ddp_stats_t", "ddp_stats_t", "Stats"),
                                ("ddp_bucket_info_t", "ddp_bucket_info_t", "BucketInfo")):
        want = [f for f, _, _ in structs[cname]]
        assert _struct_fields_in(rs, r"pub struct %s \{(.*?)\n\}" % rname) == want, rname
        assert _struct_fields_in(jl, r"struct %s\n(.*?)\nend" % jname) == want, jname
