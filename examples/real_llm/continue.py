#!/usr/bin/env python3
"""The continuation run: a long temperature-0 stream through switchyard whose
primary LLM server is SIGKILLed half-way; the fallback (the same model)
finishes the answer. The client's text must be byte-identical to the same
stream uninterrupted.

  python continue.py --base http://127.0.0.1:18091/v1 --kill-pid PID [--after 8]
"""

import argparse
import os
import signal
import time

import openai

PROMPT = "Tell me a long story about a lighthouse keeper and a storm."


def stream(client, kill_pid=None, after=8):
    """Streams the prompt; returns (text, content chunks, chunks before the kill, headers, seconds)."""
    started = time.monotonic()
    raw = client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=200,
        temperature=0,
        stream=True,
    )
    headers = raw.headers
    text, chunks, killed_at = [], 0, None
    ids = set()
    for chunk in raw.parse():
        ids.add(chunk.id)
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
            chunks += 1
            if kill_pid and killed_at is None and chunks == after:
                os.kill(kill_pid, signal.SIGKILL)
                killed_at = chunks
    return "".join(text), chunks, killed_at, headers, time.monotonic() - started, ids


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--kill-pid", type=int, required=True)
    ap.add_argument("--after", type=int, default=8)
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.base, api_key="unused", max_retries=0, timeout=120)

    ref, ref_chunks, _, h, secs, ids = stream(client)
    print(f"uninterrupted: {ref_chunks} chunks, {len(ref)} chars, {secs:.1f} s, "
          f"target {h.get('x-switchyard-target')}, ids {len(ids)}")
    got, chunks, killed_at, h, secs, ids = stream(client, args.kill_pid, args.after)
    print(f"killed after {killed_at} chunks: {chunks} chunks, {len(got)} chars, {secs:.1f} s, "
          f"target {h.get('x-switchyard-target')}, ids {len(ids)}")
    same = got == ref
    print(f"byte-identical to the uninterrupted answer: {same}")
    if not same:
        n = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
        print(f"first difference at char {n}: ref {ref[n:n + 40]!r} / got {got[n:n + 40]!r}")
    print("--- answer ---")
    print(got)
    raise SystemExit(0 if same else 1)


if __name__ == "__main__":
    main()
