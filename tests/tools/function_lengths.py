#!/usr/bin/env python3
"""Lists the longest functions of C/C++ sources, and fails when one is longer than a limit.

Usage: function_lengths.py [--max N] [--top K] FILE...
A function is a top-level-or-class-scope brace block opened after a ')' (with optional qualifiers such
as const, override, noexcept, or a constructor's initializer list). Lambdas and control blocks nested
inside a function count toward that function. Lines are counted from the signature's line to the
closing brace. Prints "functions: N passed, N failed" last.
"""
import re
import sys


def strip(text):
    """Removes comments, strings and char literals, keeping newlines, so braces can be counted."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * text.count("\n", i, j))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(c + c)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


HEAD = re.compile(r"\)\s*(const|override|final|noexcept|mutable|\s|->\s*[\w:<>,\s*&]+)*$")
NAME = re.compile(r"([~\w:]+)\s*\([^;{}]*$", re.S)


def functions(path):
    text = strip(open(path, encoding="utf-8", errors="replace").read())
    depth, found, stack = 0, [], []  # stack: (depth, is_function, name, start line)
    line = 1
    last_stmt = 0  # index just after the last ';', '{' or '}' at any depth
    for i, c in enumerate(text):
        if c == "\n":
            line += 1
        elif c == "{":
            head = text[last_stmt:i]
            inside_fn = any(s[1] for s in stack)
            is_fn = False
            name = ""
            if not inside_fn:
                flat = re.sub(r"\s+", " ", head)
                # constructor initializer lists: "X::X(a) : b_(a), c_{} {"
                flat_no_init = re.sub(r"\)\s*:\s*[^(){}]*(\([^()]*\)[^(){}]*)*$", ")", flat)
                if HEAD.search(flat_no_init) or HEAD.search(flat):
                    m = NAME.search(flat)
                    if m and m.group(1) not in ("if", "for", "while", "switch", "catch", "sizeof"):
                        is_fn, name = True, m.group(1)
            start = line - head.count("\n") + (len(head) - len(head.lstrip("\n")) and 0)
            start = line - head.strip("\n").count("\n") if head.strip() else line
            stack.append((depth, is_fn, name, start))
            depth += 1
            last_stmt = i + 1
        elif c == "}":
            depth -= 1
            if stack:
                d, is_fn, name, start = stack.pop()
                if is_fn:
                    found.append((line - start + 1, name, path, start))
            last_stmt = i + 1
        elif c == ";":
            last_stmt = i + 1
    return found


def main(argv):
    limit, top, files = 60, 5, []
    it = iter(argv)
    for a in it:
        if a == "--max":
            limit = int(next(it))
        elif a == "--top":
            top = int(next(it))
        else:
            files.append(a)
    all_fns = sorted((f for p in files for f in functions(p)), reverse=True)
    for n, name, path, start in all_fns[:top]:
        print(f"  {n:4d} lines  {name}  ({path}:{start})")
    long = [f for f in all_fns if f[0] > limit]
    for n, name, path, start in long:
        print(f"functions: {name} at {path}:{start} is {n} lines, over {limit}")
    print(f"functions: {len(all_fns) - len(long)} passed, {len(long)} failed")
    return 1 if long else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
