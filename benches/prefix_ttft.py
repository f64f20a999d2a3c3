#!/usr/bin/env python3
"""Time to first token with and without `k3ring serve`'s prefix cache.

A long system prompt (SYSTEM_TOKENS ids, default 2,000) followed by TURNS short user turns
(default 8), sent as streamed greedy completions to two servers on the same model: one with the
prefix cache off (`--prefix-cache-gb 0`), one with it on (the default size unless PREFIX_GB).
Each turn goes to both servers, the order alternating, and the time to the first chunk that
carries a token is taken on each. MODE=independent (default): each turn is the system prompt
and one user turn, as different users of one application send them (only the system prompt is
shared); MODE=history: each turn resends the conversation so far, as a chat front end does.

Prints one line per turn (TTFT off, on, ratio, cached tokens) and a summary: the median and the
lowest ratio over turns 2..TURNS, and whether both servers gave the same ids (they must).

Environment: BIN (default target/release/k3ring), MODEL (default: the tiny model in the
binary), TRUNK, MEM_GB and PREFIX_GB (stream the model under that budget, the cache taken from
it; the server without the cache gets MEM_GB - PREFIX_GB, so both plans match), CHUNK
(--prefill-chunk, default 32), SYSTEM_TOKENS, TURNS, MODE, PREFIX_GB, VOCAB (ids are drawn
below it, default 256), JSON (a file for the summary).
Usage: benches/prefix_ttft.py
"""

import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("BIN", os.path.join(ROOT, "target", "release", "k3ring"))
SYSTEM_TOKENS = int(os.environ.get("SYSTEM_TOKENS", "2000"))
TURNS = int(os.environ.get("TURNS", "8"))
MODE = os.environ.get("MODE", "independent")
VOCAB = int(os.environ.get("VOCAB", "256"))


def start(extra, mem_gb=None):
    args = [BIN, "serve", "--port", "0", "--max-batch", "1", "--no-access-log",
            "--prefill-chunk", os.environ.get("CHUNK", "32"), "--max-tokens", "64"]
    if os.environ.get("MODEL"):
        args += ["--model", os.environ["MODEL"]]
    if os.environ.get("TRUNK"):
        args += ["--trunk", os.environ["TRUNK"], "--mem-gb", mem_gb or os.environ["MEM_GB"]]
    proc = subprocess.Popen(args + extra, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    found, lines = {}, []

    def read():
        for line in proc.stderr:
            lines.append(line)
            if "listening on http://" in line:
                found["addr"] = line.split("listening on http://", 1)[1].strip()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.time() + 600
    while "addr" not in found:
        if time.time() > deadline or proc.poll() is not None:
            proc.kill()
            sys.exit("the server did not start:\n" + "".join(lines))
        time.sleep(0.05)
    return proc, found["addr"], lines


def ask(addr, prompt):
    """Streams a greedy completion: (seconds to the first token, ids, cached tokens)."""
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=3600)
    body = json.dumps({"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True}})
    started = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        sys.exit(f"status {resp.status}: {resp.read()[:500]}")
    first, ids, cached = None, [], 0
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("choices") and chunk["choices"][0].get("token_ids"):
            if first is None:
                first = time.perf_counter() - started
            ids += chunk["choices"][0]["token_ids"]
        usage = chunk.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached)
    conn.close()
    return first, ids, cached


def ids(seed, n):
    x = seed * 2654435761 + 12345
    out = []
    for _ in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out.append((x >> 33) % VOCAB)
    return out


def main():
    system = ids(1, SYSTEM_TOKENS)
    cache = ["--prefix-cache-gb", os.environ["PREFIX_GB"]] if os.environ.get("PREFIX_GB") else []
    # Streamed, the cache is taken from the budget: the server without it gets the budget less
    # the cache, so that both plans are the same.
    off_mem = None
    if os.environ.get("TRUNK"):
        if not os.environ.get("PREFIX_GB"):
            sys.exit("with TRUNK, give PREFIX_GB (the cache's size, taken from MEM_GB)")
        off_mem = str(float(os.environ["MEM_GB"]) - float(os.environ["PREFIX_GB"]))
    servers = {"off": start(["--prefix-cache-gb", "0"], off_mem), "on": start(cache)}
    rows, same, history = [], True, list(system)
    try:
        for turn in range(1, TURNS + 1):
            user = ids(100 + turn, 12)
            prompt = history + user if MODE == "history" else system + user
            order = ["off", "on"] if turn % 2 else ["on", "off"]
            got = {}
            for name in order:
                got[name] = ask(servers[name][1], prompt)
            same &= got["off"][1] == got["on"][1]
            ratio = got["off"][0] / got["on"][0]
            rows.append((turn, len(prompt), got["off"][0], got["on"][0], ratio, got["on"][2]))
            print(f"turn {turn}: {len(prompt)} prompt tokens, TTFT off {got['off'][0]:.3f} s, "
                  f"on {got['on'][0]:.3f} s, {ratio:.1f}x, {got['on'][2]} cached", flush=True)
            if MODE == "history":
                history = prompt + got["on"][1]
    finally:
        for proc, _, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    later = [r[4] for r in rows[1:]]
    summary = {
        "mode": MODE, "system_tokens": SYSTEM_TOKENS, "turns": TURNS,
        "model": os.environ.get("MODEL", "tiny (embedded)"), "mem_gb": os.environ.get("MEM_GB"),
        "median_ratio_later_turns": statistics.median(later) if later else None,
        "lowest_ratio_later_turns": min(later) if later else None,
        "same_ids": same,
        "turns_detail": [dict(zip(["turn", "prompt_tokens", "ttft_off", "ttft_on", "ratio", "cached"], r)) for r in rows],
    }
    print(f"turns 2-{TURNS}: median {summary['median_ratio_later_turns']:.1f}x, lowest "
          f"{summary['lowest_ratio_later_turns']:.1f}x lower TTFT with the prefix cache; ids "
          + ("identical" if same else "DIFFER"))
    if os.environ.get("JSON"):
        with open(os.environ["JSON"], "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
