#!/usr/bin/env python3
"""Merges libddp's per-rank timelines into one Chrome trace (python3, standard library only).

    DDP_TIMELINE=/tmp/t.json mpirun -np 4 ./trainer      # writes /tmp/t.rank0.json ... /tmp/t.rank3.json
    tools/merge_timeline.py -o /tmp/t.merged.json /tmp/t.rank*.json
    tools/merge_timeline.py -o /tmp/t.merged.json /tmp/t.json   # the same: the DDP_TIMELINE path finds its ranks

Open the output in https://ui.perfetto.dev (Open trace file) or chrome://tracing (Load): one process per
rank ("rank N"), a "trainer" track with the grad-ready marks and the iterations, one "stream N" track per
bucket stream. Every rank's timestamps count microseconds since the Unix epoch, so the ranks line up.

A rank with several live contexts in one process (a GAN's two models) writes t.ctx1.rank0.json, ...
for its second, third ... context: given the DDP_TIMELINE path, every context's files are merged, each
context's ranks as processes of their own ("rank 0, context 1").

Inputs may be cut short (a process killed, or a disk that filled up): every complete event before the
cut is kept, the partial one is dropped, and a note goes to stderr. A file that is broken anywhere else
(text after the cut, or after the closing bracket: two writers in one file) is refused with the line
where it breaks, and nothing is written: no event is ever dropped without a word. The older object form
({"traceEvents": [...]}) is read too. The output is the array form, one event per line, complete JSON.
"""
import argparse
import glob
import json
import os
import re
import sys

# A context's files: "t.ctx<K>.rank<N>.json" (K absent for a rank's first context).
NAME = re.compile(r"\.(?:ctx(\d+)\.)?rank(\d+)$")
# The processes of context K (>= 1) are numbered from K * CONTEXT_PIDS up, so that they stay apart.
CONTEXT_PIDS = 100000


class BrokenTrace(ValueError):
    """A trace that is damaged before its end."""


def context_rank(path):
    """(context, rank) of a per-rank file's name, or None: "t.ctx1.rank2.json" -> (1, 2)."""
    m = NAME.search(os.path.splitext(path)[0])
    return (int(m.group(1) or 0), int(m.group(2))) if m else None


def rank_files(path):
    """The per-rank files of a DDP_TIMELINE path, every context's: "t.json" -> t.rank0.json, t.rank1.json,
    ..., t.ctx1.rank0.json, ... by context, then rank."""
    root, ext = os.path.splitext(path)
    found = glob.glob(glob.escape(root) + ".rank*" + ext) + glob.glob(glob.escape(root) + ".ctx*.rank*" + ext)
    named = [(context_rank(p), p) for p in found if context_rank(p) and NAME.search(os.path.splitext(p)[0]).start()
             == len(root)]
    return [p for _, p in sorted(named)]


def line_of(s, pos):
    return s.count("\n", 0, pos) + 1


def check_cut(s, pos, what):
    """The text from `pos` on could not be read: a cut (only the one partial line left) is accepted; text
    on a later line means the file is broken before its end."""
    rest = s.find("\n", pos)
    if rest >= 0 and s[rest:].strip():
        raise BrokenTrace("line %d: %s, and more text follows (two writers in one file, or a damaged file)"
                          % (line_of(s, pos), what))


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
        raise BrokenTrace("not a Chrome trace (neither '[' nor '{' first)")
    events, pos, n = [], 1, len(s)
    while True:
        while pos < n and s[pos] in " \t\r\n,":
            pos += 1
        if pos >= n:
            return events, False  # no closing bracket: cut short (or still being written)
        if s[pos] == "]":
            if s[pos + 1:].strip():
                raise BrokenTrace("line %d: text after the closing bracket (two writers in one file)"
                                  % line_of(s, pos))
            return events, True
        try:
            ev, pos = dec.raw_decode(s, pos)
        except ValueError:
            check_cut(s, pos, "an event that does not parse")
            return events, False  # a partial event at the cut
        if not isinstance(ev, dict):
            raise BrokenTrace("line %d: not an event object" % line_of(s, pos))
        events.append(ev)


def apart(events, context):
    """The events of a rank's context-th (>= 1) context, as processes of their own."""
    for ev in events:
        if "pid" in ev:
            rank = ev["pid"]
            ev["pid"] = context * CONTEXT_PIDS + rank
            if ev.get("name") == "process_name":
                ev.setdefault("args", {})["name"] = "rank %s, context %d" % (rank, context)
    return events


def merge(paths, out, quiet=False):
    """Reads every path, writes one array-form trace to `out` (metadata first, then events by time);
    returns the number of events written. Raises BrokenTrace (naming the file) for a damaged input,
    before anything is written."""
    meta, timed = [], []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            try:
                events, complete = read_events(f.read())
            except BrokenTrace as e:
                raise BrokenTrace("%s: %s" % (path, e)) from None
        named = context_rank(path)
        if named and named[0] > 0:
            events = apart(events, named[0])
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
    try:
        n = merge(paths, args.output, args.quiet)
    except BrokenTrace as e:
        print("merge_timeline: %s; nothing merged" % e, file=sys.stderr)
        return 1
    if not args.quiet:
        print("%s: %d events from %d files" % (args.output, n, len(paths)), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
