#!/usr/bin/env bash
# A fresh checkout's Rust build: libddp-sys must build the C library itself when none was built,
# `cargo doc` must build, and without the repository around it the build must stop with one line
# naming LIBDDP_DIR and make. Ends with "rust-fresh: N passed, N failed, N skipped".
root=$(cd "$(dirname "$0")/../.." && pwd)
if ! command -v cargo >/dev/null 2>&1; then
  echo "rust-fresh: skipped: cargo is not on PATH"; echo "rust-fresh: 0 passed, 0 failed, 1 skipped"; exit 0
fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
pass=0; fail=0
ok() { echo "ok: $1"; pass=$((pass + 1)); }
bad() { echo "FAILED: $1"; fail=$((fail + 1)); }

# The tracked tree, as a fresh clone has it (no build/, no target/).
mkdir "$tmp/repo"
if git -C "$root" rev-parse >/dev/null 2>&1; then
  (cd "$root" && git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$tmp/repo" 2>/dev/null)
else
  (cd "$root" && tar --exclude=./build --exclude='./bindings/rust/target' -cf - .) | tar -xf - -C "$tmp/repo"
fi
rm -rf "$tmp/repo/build"
unset LIBDDP_DIR
# The C library without CUDA, to keep this quick; the build script runs make with this environment.
export CUDA=0 CARGO_TARGET_DIR=$tmp/target
if (cd "$tmp/repo/bindings/rust" && timeout 600 cargo build --offline -q --examples) > "$tmp/build.log" 2>&1 \
   && [ -e "$tmp/repo/build/lib/libddp.so" ]; then
  ok "cargo build --examples in a fresh tree built build/lib/libddp.so and linked it"
else
  cat "$tmp/build.log"; bad "cargo build in a fresh tree"
fi
if (cd "$tmp/repo/bindings/rust" && timeout 300 cargo doc --offline -q --no-deps) > "$tmp/doc.log" 2>&1 \
   && [ -e "$tmp/target/doc/libddp/index.html" ]; then
  ok "cargo doc"
else
  cat "$tmp/doc.log"; bad "cargo doc"
fi

# The crates alone, with no repository and no library: one clear line.
mkdir "$tmp/alone"; cp -r "$tmp/repo/bindings/rust" "$tmp/alone/"
export CARGO_TARGET_DIR=$tmp/target-alone
if ls /usr/local/lib/libddp.so /usr/lib/libddp.so /usr/lib/x86_64-linux-gnu/libddp.so >/dev/null 2>&1; then
  echo "skipped: a system-wide libddp is installed, so the crates alone find it"
  skipped=1
else
  skipped=0
  out=$(cd "$tmp/alone/rust" && timeout 300 cargo build --offline -q 2>&1); rc=$?
  if [ "$rc" -ne 0 ] && grep -q "libddp-sys: no libddp found: set LIBDDP_DIR to the directory that holds libddp.so, or run \`make\` in the libddp repository" <<<"$out"; then
    ok "without a library the build names LIBDDP_DIR and make"
  else
    echo "$out" | tail -20; bad "the crates alone (exit $rc)"
  fi
fi
echo "rust-fresh: $pass passed, $fail failed, $skipped skipped"
[ "$fail" -eq 0 ]
