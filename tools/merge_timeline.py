#!/usr/bin/env python3
"""Merges libddp's per-rank timelines into one Chrome trace (python3, standard library only).

    DDP_TIMELINE=/tmp/t.json mpirun -np 4 ./trainer      # writes /tmp/t.rank0.json ... /tmp/t.rank3.json
    tools/merge_timeline.py -o /tmp/t.merged.json /tmp/t.rank*.json
    tools/merge_timeline.py -o /tmp/t.merged.json /tmp/t.json   # the same: the DDP_TIMELINE path finds its ranks

Open the output in https://ui.perfetto.dev (Open trace file) or chrome://tracing (Load): one process per
rank ("rank N"), a "trainer" track with the grad-ready marks and the iterations, one "stream N" track per
bucket stream. Every rank's timestamps count microseconds since the Unix epoch, so the ranks line up.

Inputs may be cut short (a process killed, or a disk that filled up): every complete event before the
cut is kept, the partial one is dropped, and a note goes to stderr. The older object form
({"traceEvents": [...]}) is read too. The output is the array form, one event per line, complete JSON.
"""
import argparse
import glob
import json
import os
import sys


def rank_files(path):
    """The per-rank files of a DDP_TIMELINE path: "t.json" -> t.rank0.json, t.rank1.json, ... by rank."""
    root, ext = os.path.splitext(path)
    found = glob.glob(glob.escape(root) + ".rank*" + ext)

    def rank(p):
        tag = p[len(root) + len(".rank"):len(p) - len(ext)]
        return int(tag) if tag.isdigit() else -1

    return sorted((p for p in found if rank(p) >= 0), key=rank)


def read_events(text):
    """(events, complete): the events of one trace file in the array or the object form, however cut short.
    `complete` is False when the text ended before the trace did (a partial event, or no closing bracket)."""
    dec = json.JSONDecoder()
    s = text.lstrip()
    if s.startswith("{"):
        try:
            doc = json.loads(s)
            return list(doc.get("traceEvents", [])), True
        except ValueError:
            key = s.find('"traceEvents"')
            start = s.find("[", key) if key >= 0 else -1
            if start < 0:
                return [], False
            s = s[start:]
    if not s.startswith("["):
        raise ValueError("not a Chrome trace (neither '[' nor '{' first)")
    events, pos, n = [], 1, len(s)
    while True:
        while pos < n and s[pos] in " \t\r\n,":
            pos += 1
        if pos >= n:
            return events, False  # no closing bracket: cut short (or still being written)
        if s[pos] == "]":
            return events, True
        try:
            ev, pos = dec.raw_decode(s, pos)
        except ValueError:
            return events, False  # a partial event at the cut
        if isinstance(ev, dict):
            events.append(ev)


def merge(paths, out, quiet=False):
    """Reads every path, writes one array-form trace to `out` (metadata first, then events by time);
    returns the number of events written."""
    meta, timed = [], []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            events, complete = read_events(f.read())
        if not quiet:
            note = "" if complete else " (cut short: the events before the cut are kept)"
            print("%s: %d events%s" % (path, len(events), note), file=sys.stderr)
        for ev in events:
            (meta if ev.get("ph") == "M" else timed).append(ev)
    timed.sort(key=lambda e: (e.get("ts", 0), e.get("pid", 0)))
    with open(out, "w", encoding="utf-8") as f:
        f.write("[\n")
        f.write(",\n".join(json.dumps(e, separators=(",", ":")) for e in meta + timed))
        f.write("\n]\n")
    return len(meta) + len(timed)


def main(argv=None):
    ap = argparse.ArgumentParser(description="Merge libddp's per-rank timelines into one Chrome trace.")
    ap.add_argument("inputs", nargs="+", help="per-rank files (t.rank0.json ...), or the DDP_TIMELINE path itself")
    ap.add_argument("-o", "--output", required=True, help="the merged trace to write")
    ap.add_argument("-q", "--quiet", action="store_true", help="no per-file notes on stderr")
    args = ap.parse_args(argv)
    paths = []
    for p in args.inputs:
        if os.path.exists(p):
            paths.append(p)
        else:
            ranks = rank_files(p)
            if not ranks:
                ap.error("%s: no such file, and no %s.rank<N>%s files" % ((p,) + os.path.splitext(p)))
            paths.extend(ranks)
    n = merge(paths, args.output, args.quiet)
    if not args.quiet:
        print("%s: %d events from %d files" % (args.output, n, len(paths)), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
