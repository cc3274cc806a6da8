#!/usr/bin/env python3
"""Drive switchyard with the official `openai` SDK while its primary upstream dies.

Phases (started by run.sh, or by hand against a running setup):
  1. requests 1..N/2, alternating non-streaming / streaming: primary is healthy
  2. one long stream (max_tokens 200); after a few content chunks the primary
     LLM server is killed (SIGKILL) while it is still generating
  3. requests N/2+1..N, alternating: primary is dead, the fallback must answer

Per request it prints: index, stream?, HTTP status, x-switchyard-target /
-attempts / -failovers / -degraded, latency, time to first token (streams) and
the start of the text. temperature=0, so primary and fallback give the same
text for the same prompt: a replayed stream would show up as repeated text.

  python drive.py --base http://127.0.0.1:18090/v1 --kill-pid PID_OF_PRIMARY
  (or PRIMARY_PID=... python drive.py)
  python drive.py --base http://127.0.0.1:18081/v1 --model gemma-3-270m --baseline -n 6
"""

import argparse
import os
import signal
import sys
import time

import httpx
import openai

PROMPTS = [
    "Write one sentence about the sea.",
    "Name three colours.",
    "What is a gateway?",
    "Tell me about trains.",
    "Describe a cat in a few words.",
    "What is the capital of France?",
]


class TeeTransport(httpx.HTTPTransport):
    """Records the raw bytes of the last response body (to show exact SSE events)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.last = bytearray()

    def handle_request(self, request):
        resp = super().handle_request(request)
        inner = resp.stream
        rec = self.last = bytearray()

        class Tee(httpx.SyncByteStream):
            def __iter__(self):
                for chunk in inner:
                    rec.extend(chunk)
                    yield chunk

            def close(self):
                inner.close()

        resp.stream = Tee()
        return resp


def hdrs(h):
    return (
        h.get("x-switchyard-target", "-"),
        h.get("x-switchyard-attempts", "-"),
        h.get("x-switchyard-failovers", "-"),
        h.get("x-switchyard-degraded", "-"),
    )


def short(text, n=40):
    return repr(text.replace("\n", " ")[:n])


def row(i, stream, status, h, lat, ttft, text, note=""):
    t, a, f, d = h
    ttft_s = f"{ttft * 1000:7.0f}" if ttft is not None else "      -"
    print(
        f"{i:>3} {'stream' if stream else 'plain ':6} {status:>3} {t:<15} {a:>3} {f:>3} {d:<5} "
        f"{lat * 1000:7.0f} {ttft_s}  {short(text)} {note}",
        flush=True,
    )


def one(client, i, stream, model, max_tokens):
    prompt = PROMPTS[(i - 1) % len(PROMPTS)]
    kw = dict(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
    )
    t0 = time.monotonic()
    try:
        if not stream:
            raw = client.chat.completions.with_raw_response.create(**kw)
            comp = raw.parse()
            lat = time.monotonic() - t0
            row(i, False, raw.status_code, hdrs(raw.headers), lat, None,
                comp.choices[0].message.content or "")
            return
        raw = client.chat.completions.with_raw_response.create(stream=True, **kw)
        h = hdrs(raw.headers)
        ttft, text, note = None, "", ""
        try:
            for chunk in raw.parse():
                if chunk.choices and chunk.choices[0].delta.content:
                    if ttft is None:
                        ttft = time.monotonic() - t0
                    text += chunk.choices[0].delta.content
        except openai.APIError as e:
            note = f"STREAM ERROR {type(e).__name__}: {e}"
        row(i, True, raw.status_code, h, time.monotonic() - t0, ttft, text, note)
    except openai.APIStatusError as e:
        row(i, stream, e.status_code, hdrs(e.response.headers), time.monotonic() - t0, None,
            "", f"ERROR {e.message[:120]}")
    except openai.APIError as e:
        row(i, stream, 0, ("-",) * 4, time.monotonic() - t0, None, "", f"ERROR {type(e).__name__}: {e}")


def midstream_kill(client, tee, i, model, pid, kill_after_chunks):
    """A long stream; the primary is SIGKILLed after `kill_after_chunks` content chunks."""
    print(f"\n--- request {i}: long stream (max_tokens 200), SIGKILL primary pid {pid} "
          f"after {kill_after_chunks} content chunks ---", flush=True)
    t0 = time.monotonic()
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}],
        max_tokens=200,
        temperature=0,
        stream=True,
    )
    h = hdrs(raw.headers)
    ttft, text, n, killed_at, before_kill, outcome = None, "", 0, None, "", "ended normally"
    try:
        for chunk in raw.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                if ttft is None:
                    ttft = time.monotonic() - t0
                text += chunk.choices[0].delta.content
                n += 1
                if n == kill_after_chunks and pid:
                    os.kill(pid, signal.SIGKILL)
                    killed_at = time.monotonic() - t0
                    before_kill = text
    except openai.APIError as e:
        outcome = f"openai.{type(e).__name__} raised: {e} (body={getattr(e, 'body', None)!r})"
    end = time.monotonic() - t0
    row(i, True, raw.status_code, h, end, ttft, text, "(mid-stream kill)")
    kill_s = f"{killed_at * 1000:.0f} ms, after {kill_after_chunks} chunks" if killed_at else "never (too few chunks)"
    print(f"    primary killed at {kill_s}; stream ended at {end * 1000:.0f} ms; "
          f"content chunks received in total: {n}")
    print(f"    text before kill ({len(before_kill)} chars): {before_kill!r}")
    print(f"    text after kill ({len(text) - len(before_kill)} chars): {text[len(before_kill):]!r}")
    print(f"    outcome: {outcome}")
    rest = text[len(before_kill):]
    repeated = bool(before_kill) and before_kill.strip()[:20] in rest
    print(f"    text repeated after the kill: {'YES' if repeated else 'no'}")
    events = [e for e in bytes(tee.last).split(b"\n\n") if e.strip()]
    print(f"    raw SSE: {len(events)} events; last 3:")
    for e in events[-3:]:
        print(f"      {e.decode(errors='replace')[:300]}")
    print(flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="http://127.0.0.1:18090/v1")
    ap.add_argument("--model", default="gpt-4o-mini")
    ap.add_argument("-n", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--kill-pid", type=int, default=int(os.environ.get("PRIMARY_PID", "0")))
    ap.add_argument("--kill-after-chunks", type=int, default=8)
    ap.add_argument("--baseline", action="store_true",
                    help="only N alternating requests, no kill (e.g. straight at an LLM server)")
    args = ap.parse_args()
    if not args.kill_pid:
        print("warning: no --kill-pid/PRIMARY_PID: the primary is not killed", file=sys.stderr)

    tee = TeeTransport()
    client = openai.OpenAI(
        base_url=args.base,
        api_key="unused",
        max_retries=0,
        timeout=90,
        http_client=httpx.Client(transport=tee, timeout=90),
    )
    half = args.n // 2
    print(f"  # kind   st  target          att  fo deg   lat_ms ttft_ms  text")
    if args.baseline:
        for i in range(1, args.n + 1):
            one(client, i, stream=(i % 2 == 0), model=args.model, max_tokens=args.max_tokens)
        return
    for i in range(1, half + 1):
        one(client, i, stream=(i % 2 == 0), model=args.model, max_tokens=args.max_tokens)
    midstream_kill(client, tee, half + 1, args.model, args.kill_pid, args.kill_after_chunks)
    print(f"  # kind   st  target          att  fo deg   lat_ms ttft_ms  text   (primary dead)")
    for i in range(half + 2, args.n + 2):
        one(client, i, stream=(i % 2 == 1), model=args.model, max_tokens=args.max_tokens)


if __name__ == "__main__":
    main()
