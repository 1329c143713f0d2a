#!/usr/bin/env python3
"""Writes the seed corpus of the API fuzzer (tests/fuzz/corpus): well-formed programs in the input
format of fuzz_api.cpp, so that the fuzzer starts from inputs that reach every call. Deterministic."""
import os
import random

OPS = ["register", "commit", "begin", "ready", "ready_rest", "ready_ptr", "set_ptr", "finish",
       "set_sync", "reduce_all", "plan", "stats", "grad_ptr", "nonfinite", "synchronize", "broadcast",
       "iteration"]
OP = {n: i for i, n in enumerate(OPS)}


def call(name, a=0, b=0, c=0, d=0):
    return bytes([OP[name], a & 255, b & 255, c & 255, d & 255])


def program(rng, world2, layout, plan, extra_mode=0, bad=0):
    mode = (1 if world2 else 0) | extra_mode
    m = (layout << 2) | (plan << 3) | (rng.getrandbits(8) & 0xf3)
    q = rng.getrandbits(8) & 0x3f
    head = bytes([mode, rng.getrandbits(8), m]) + rng.getrandbits(16).to_bytes(2, "little") + bytes([q, bad])
    body = b""
    for _ in range(rng.randint(1, 8)):
        body += call("register", rng.getrandbits(8), rng.getrandbits(8) & 1, rng.randint(0, 3), rng.getrandbits(1))
    for _ in range(rng.randint(1, 4)):
        body += call("iteration")
        body += call("begin")
        for _ in range(rng.randint(0, 6)):
            body += call(rng.choice(["ready", "ready", "ready_ptr", "set_ptr"]), rng.getrandbits(8), 0, rng.getrandbits(8))
        body += call("ready_rest", rng.getrandbits(8), rng.getrandbits(8), rng.getrandbits(8))
        body += call("finish")
        body += call(rng.choice(["plan", "stats", "reduce_all", "set_sync", "nonfinite", "broadcast", "synchronize"]),
                     rng.getrandbits(8))
    return head + body


def main():
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
    os.makedirs(out, exist_ok=True)
    rng = random.Random(20261202)
    n = 0
    for world2 in (0, 1):
        for layout in (0, 1):
            for plan in (0, 1):
                for k in range(4):
                    data = program(rng, world2, layout, plan, extra_mode=2 if k == 3 else 0)
                    with open(os.path.join(out, "seed-%03d" % n), "wb") as f:
                        f.write(data)
                    n += 1
    for bad in range(0xf0, 0x100):
        with open(os.path.join(out, "seed-%03d" % n), "wb") as f:
            f.write(program(rng, bad & 1, 0, 0, bad=bad))
        n += 1
    # Registrations that must be refused in the copy layout: a pointer off its dtype's alignment
    # (d = 0x84), the last grad's memory again (0x85) or its last element (0x86); then iterations.
    for world2 in (0, 1):
        for bad_reg in (0x84, 0x85, 0x86):
            body = call("register", 40, 0, 2, 0) + call("register", 7, 0, rng.randint(0, 3), bad_reg)
            body += call("register", 9, 0, 3, 0) + call("iteration") + call("iteration")
            head = bytes([1 if world2 else 0, 0, 0, 0, 0, 0, 0])
            with open(os.path.join(out, "seed-reg-%d-%x" % (world2, bad_reg)), "wb") as f:
                f.write(head + body)
            n += 1
    print("wrote %d seeds to %s" % (n, out))


if __name__ == "__main__":
    main()
