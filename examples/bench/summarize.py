#!/usr/bin/env python3
"""Turns the raw results of examples/bench/run.sh (points.tsv, ttft.tsv,
extra.env in OUT) into markdown tables: medians over the repetitions, added
latency over direct, ratios against direct and the peers, and the goals."""
import csv
import statistics
import sys
from collections import defaultdict

out = sys.argv[1]


def read_tsv(name):
    try:
        with open(f"{out}/{name}") as f:
            return list(csv.DictReader(f, delimiter="\t"))
    except FileNotFoundError:
        return []


def med(values):
    vals = [float(v) for v in values if v not in ("nan", "", None)]
    return statistics.median(vals) if vals else float("nan")


extra = {}
with open(f"{out}/extra.env") as f:
    for line in f:
        if "=" in line:
            k, v = line.rstrip("\n").split("=", 1)
            extra[k] = v.strip('"')

points = defaultdict(list)
for r in read_tsv("points.tsv"):
    points[(r["mode"], r["path"], int(r["conc"]))].append(r)
agg = {}
for key, rows in points.items():
    agg[key] = {
        "rps": med(r["rps"] for r in rows),
        "p50": med(r["p50_us"] for r in rows),
        "p99": med(r["p99_us"] for r in rows),
        "cpu": med(r["cpu_s_per_1000"] for r in rows),
        "bad": sum(int(r["bad"]) for r in rows),
        "ok": sum(int(r["ok"]) for r in rows),
        "n": len(rows),
    }

modes = [m for m in ("plain", "stream") if any(k[0] == m for k in agg)]
order = ["direct", "switchyard-1", "switchyard-3", "nginx", "litellm", "litellm-3",
         "neutral", "switchyard-neutral", "switchyard-neutral-messages",
         "switchyard-neutral-responses", "switchyard-neutral-responses-native",
         "switchyard-neutral-3", "switchyard-neutral-cached", "nginx-neutral",
         "nginx-neutral-messages", "nginx-neutral-responses",
         "floor-neutral-multi", "floor-neutral-percore"]
paths = [p for p in order if any(k[1] == p for k in agg)]
concs = sorted({k[2] for k in agg})
peer_of = {"switchyard-1": "litellm", "switchyard-3": "litellm-3"}
# The floor and the plain proxy hop each path is held against.
floor_of = {p: ("neutral" if "neutral" in p else "direct") for p in order}
hop_of = {p: ("nginx-neutral" if "neutral" in p else "nginx") for p in order}
# A pass-through is held against nginx relaying the same protocol's bytes.
hop_of["switchyard-neutral-messages"] = "nginx-neutral-messages"
hop_of["switchyard-neutral-responses-native"] = "nginx-neutral-responses"
floors = ("direct", "neutral")
hops = ("nginx", "nginx-neutral", "nginx-neutral-messages", "nginx-neutral-responses")


def fmt(x, nd=0):
    if x != x:  # nan
        return "-"
    return f"{x:,.{nd}f}"


def ratio(a, b):
    if a != a or b != b or b == 0:
        return "-"
    r = a / b
    return f"{r:.3f}x" if r < 0.1 else f"{r:.2f}x"


print(f"# switchyard overhead benchmark, {extra.get('date', '?')}\n")
print(
    f"Machine: {extra.get('nproc')} cores ({extra.get('cpu')}), {extra.get('mem')}; "
    f"load average at the end {extra.get('loadavg')}. {extra.get('oha')}, {extra.get('nginx')}, "
    f"LiteLLM {extra.get('litellm')}. Each point: {extra.get('repeat')} runs of "
    f"{extra.get('duration')} s, median shown. Streams: {extra.get('chunks')} content chunks, "
    f"{extra.get('chunk_delay')} apart. Latencies in µs; CPU = the gateway's (or for direct, "
    f"the fake's) user+system CPU seconds per 1,000 requests.\n"
)

for mode in modes:
    print(f"## {mode}: throughput and latency\n")
    print(
        "| path | conc | req/s | p50 µs | p99 µs | added p50 µs | added p99 µs | "
        "req/s vs direct | vs nginx | vs LiteLLM (same chain) | CPU s/1000 req | failed |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for p in paths:
        for c in concs:
            a = agg.get((mode, p, c))
            if not a:
                continue
            d = agg.get((mode, floor_of[p], c), {})
            n = agg.get((mode, hop_of[p], c), {})
            peer = agg.get((mode, peer_of.get(p, ""), c), {})
            added50 = a["p50"] - d.get("p50", float("nan")) if p not in floors else float("nan")
            added99 = a["p99"] - d.get("p99", float("nan")) if p not in floors else float("nan")
            print(
                f"| {p} | {c} | {fmt(a['rps'])} | {fmt(a['p50'])} | {fmt(a['p99'])} | "
                f"{fmt(added50)} | {fmt(added99)} | "
                f"{ratio(a['rps'], d.get('rps', float('nan'))) if p not in floors else '-'} | "
                f"{ratio(a['rps'], n.get('rps', float('nan'))) if p not in hops + floors else '-'} | "
                f"{ratio(a['rps'], peer.get('rps', float('nan'))) if p in peer_of else '-'} | "
                f"{fmt(a['cpu'], 3)} | {a['bad']} |"
            )
    print()

ttft = defaultdict(list)
for r in read_tsv("ttft.tsv"):
    ttft[(r["path"], int(r["conc"]))].append(r)
if ttft:
    print("## stream: time to first content byte (TTFT)\n")
    print("| path | conc | streams | TTFT p50 µs | TTFT p99 µs | added TTFT p50 µs | added TTFT p99 µs | stream total p50 µs | errors |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    tagg = {}
    for key, rows in ttft.items():
        tagg[key] = {
            "n": sum(int(r["requests"]) for r in rows),
            "err": sum(int(r["errors"]) for r in rows),
            "p50": med(r["ttft_p50_us"] for r in rows),
            "p99": med(r["ttft_p99_us"] for r in rows),
            "tot": med(r["total_p50_us"] for r in rows),
        }
    for p in paths:
        for c in concs:
            a = tagg.get((p, c))
            if not a:
                continue
            d = tagg.get(("direct", c), {})
            add50 = a["p50"] - d.get("p50", float("nan")) if p != "direct" else float("nan")
            add99 = a["p99"] - d.get("p99", float("nan")) if p != "direct" else float("nan")
            print(
                f"| {p} | {c} | {a['n']} | {fmt(a['p50'])} | {fmt(a['p99'])} | {fmt(add50)} | "
                f"{fmt(add99)} | {fmt(a['tot'])} | {a['err']} |"
            )
    print()


def mib(k):
    try:
        return f"{int(k) / 1024:.1f} MiB"
    except (TypeError, ValueError):
        return "-"


longs = defaultdict(list)
for r in read_tsv("long.tsv"):
    longs[r["path"]].append(r)
long_us = {p: med(r["cpu_us_per_chunk"] for r in rows) for p, rows in longs.items()}
if longs:
    print("## long stream: CPU per relayed chunk\n")
    print("| proxy | streams (all runs) | chunks per stream | CPU µs per chunk (median) |")
    print("|---|---:|---:|---:|")
    for p, rows in sorted(longs.items()):
        print(f"| {p} | {sum(int(r['streams']) for r in rows)} | {rows[0]['chunks_per_stream']} | {fmt(long_us[p], 3)} |")
    print()

print("## memory\n")
print("| process | measure | value |")
print("|---|---|---:|")
print(f"| switchyard | RSS idle (started, no request yet) | {mib(extra.get('sy_idle_rss_kib'))} |")
print(f"| switchyard | RSS after the warm-up | {mib(extra.get('sy_warm_rss_kib'))} |")
print(f"| switchyard | RSS before the open streams (after the load matrix) | {mib(extra.get('sy_before_open_streams_rss_kib'))} |")
print(
    f"| switchyard | RSS with {extra.get('sy_open_streams')} concurrent open streams "
    f"({extra.get('sy_open_streams_conns')} client connections seen) | {mib(extra.get('sy_open_streams_rss_kib'))} |"
)
print(f"| switchyard | RSS 2 s after those streams closed | {mib(extra.get('sy_after_open_streams_rss_kib'))} |")
held = float(extra.get("sy_cache_entries_held") or 0)
if held > 0:
    grown = int(extra.get("sy_after_cache_rss_kib", "0")) - int(extra.get("sy_before_cache_rss_kib", "0"))
    print(
        f"| switchyard | cache: {fmt(held)} answers held of {extra.get('sy_cache_entries_sent')} sent; "
        f"bytes by its count, per entry | {fmt(float(extra.get('sy_cache_bytes_held') or 0) / held)} B |"
    )
    print(f"| switchyard | cache: RSS grown while they were kept, per entry | {fmt(grown * 1024 / held)} B |")
print(f"| switchyard | peak RSS (VmHWM), whole run | {mib(extra.get('sy_hwm_kib'))} |")
print(f"| nginx (master + workers) | peak RSS, sum | {mib(extra.get('nginx_hwm_kib'))} |")
print(f"| LiteLLM | peak RSS | {mib(extra.get('litellm_hwm_kib'))} |")
print(f"| fake upstream | peak RSS | {mib(extra.get('fake_hwm_kib'))} |")
print()

print("## config reload under full load\n")
print(
    f"routes.yaml rewritten every 200 ms during c=64 runs of {extra.get('storm_secs')} s each "
    f"(plain, then stream); reloads applied: {extra.get('storm_reloads')}.\n"
)
print("| mode | req/s | p50 µs | p99 µs | ok | failed |")
print("|---|---:|---:|---:|---:|---:|")
storm_bad = 0
for mode in ("plain", "stream"):
    v = extra.get(f"storm_{mode}", "").split()
    if len(v) == 5:
        storm_bad += int(v[4])
        print(f"| {mode} | {fmt(float(v[0]))} | {v[1]} | {v[2]} | {v[3]} | {v[4]} |")
print()

# ---- goals ----
print("## goals\n")
print("| goal | measured | met |")
print("|---|---|---|")


def goal(text, measured, ok):
    print(f"| {text} | {measured} | {'yes' if ok else '**no**'} |")


top = max(concs) if concs else 64
for mode in modes:
    d = agg.get((mode, "direct", top))
    for p in ("switchyard-1", "switchyard-3"):
        a = agg.get((mode, p, top))
        if not a or not d:
            continue
        add50 = a["p50"] - d["p50"]
        add99 = a["p99"] - d["p99"]
        goal(f"{mode}, {p}, c={top}: added p50 < 100 µs", f"{add50:,.0f} µs", add50 < 100)
        goal(f"{mode}, {p}, c={top}: added p99 < 1 ms", f"{add99:,.0f} µs", add99 < 1000)
for mode in modes:
    for c in concs:
        a = agg.get((mode, "switchyard-1", c))
        lite = agg.get((mode, "litellm", c))
        ngx = agg.get((mode, "nginx", c))
        if a and lite:
            r = a["rps"] / lite["rps"] if lite["rps"] else float("inf")
            goal(f"{mode}, c={c}: throughput ≥ 10x LiteLLM", f"{r:.1f}x", r >= 10)
        if a and ngx:
            r = a["rps"] / ngx["rps"] if ngx["rps"] else float("inf")
            goal(f"{mode}, c={c}: throughput ≥ 0.7x nginx", f"{r:.2f}x", r >= 0.7)
for mode in modes:
    for c in concs:
        a = agg.get((mode, "switchyard-1", c))
        d = agg.get((mode, "direct", c))
        if a and d and a["rps"]:
            r = d["rps"] / a["rps"]
            goal(f"{mode}, c={c}: the fake upstream serves ≥ 3x switchyard", f"{r:.1f}x", r >= 3)
# ---- the "as cheap as a plain proxy hop" goals (neutral upstream) ----
for mode in modes:
    for c in concs:
        a = agg.get((mode, "switchyard-neutral", c))
        n = agg.get((mode, "nginx-neutral", c))
        if not a or not n:
            continue
        if n["cpu"] == n["cpu"] and n["cpu"] > 0:
            r = a["cpu"] / n["cpu"]
            goal(f"{mode}, c={c}: CPU per request ≤ 1.3x nginx's", f"{a['cpu']:.4f} vs {n['cpu']:.4f} ms: {r:.2f}x", r <= 1.3)
        if c == top and n["rps"]:
            r = a["rps"] / n["rps"]
            goal(f"{mode}, c={c}: throughput ≥ 0.9x nginx's", f"{r:.2f}x", r >= 0.9)
        d = agg.get((mode, "neutral", c))
        if c == min(concs) and d:
            add_sy = a["p50"] - d["p50"]
            add_ng = n["p50"] - d["p50"]
            goal(f"{mode}, c={c}: added p50 ≤ nginx's + 20 µs", f"+{add_sy:,.0f} µs vs nginx +{add_ng:,.0f} µs", add_sy <= add_ng + 20)
    # A pass-through costs no more than the chat path: switchyard's CPU
    # above the nginx hop that relays the same bytes.
    chat, chat_hop = agg.get((mode, "switchyard-neutral", top)), agg.get((mode, "nginx-neutral", top))
    for p in ("switchyard-neutral-messages", "switchyard-neutral-responses-native"):
        a, n = agg.get((mode, p, top)), agg.get((mode, hop_of[p], top))
        if not (a and n and chat and chat_hop):
            continue
        own, chat_own = a["cpu"] - n["cpu"], chat["cpu"] - chat_hop["cpu"]
        goal(f"{mode}, c={top}: {p[len('switchyard-neutral-'):]} pass-through above its nginx hop ≤ chat's",
             f"{own:.4f} vs {chat_own:.4f} ms ({a['cpu']:.4f} vs {chat['cpu']:.4f} whole)", own <= chat_own)
    one = agg.get((mode, "switchyard-neutral", top))
    three = agg.get((mode, "switchyard-neutral-3", top))
    if one and three and one["cpu"] > 0:
        r = three["cpu"] / one["cpu"] - 1
        goal(f"{mode}, c={top}: chain of 3 (two DOWN) ≤ 5 % more CPU than chain of 1", f"{100 * r:+.1f} %", r <= 0.05)
if "switchyard" in long_us:
    x = long_us["switchyard"]
    ng = f" (nginx {long_us['nginx']:.2f})" if "nginx" in long_us else ""
    goal("long stream: ≤ 2 µs CPU per relayed chunk", f"{x:.2f} µs{ng}", x <= 2)
try:
    idle = int(extra.get("sy_idle_rss_kib", "0")) / 1024
    goal("idle RSS ≤ 12 MB", f"{idle:.1f} MiB", idle * 1.048576 <= 12)
    opn = int(extra.get("sy_open_streams_rss_kib", "0")) / 1024
    goal(f"RSS with {extra.get('sy_open_streams')} open streams ≤ 40 MB", f"{opn:.1f} MiB", 0 < opn * 1.048576 <= 40)
except ValueError:
    pass
try:
    idle = int(extra.get("sy_idle_rss_kib", "0")) / 1024
    goal("idle RSS < 20 MB", f"{idle:.1f} MiB", idle < 20)
    opn = int(extra.get("sy_open_streams_rss_kib", "0")) / 1024
    goal(f"RSS with {extra.get('sy_open_streams')} open streams < 60 MB", f"{opn:.1f} MiB", 0 < opn < 60)
except ValueError:
    pass
goal(
    "config reload under full load fails no request",
    f"{extra.get('storm_reloads')} reloads, {storm_bad} failed",
    storm_bad == 0 and extra.get("storm_reloads", "0") not in ("0", ""),
)
bad_total = sum(a["bad"] for a in agg.values())
print(f"\nFailed or non-2xx requests over all points: {bad_total}.")
print(f"switchyard ERROR log lines: {extra.get('sy_error_log_lines')}.")
