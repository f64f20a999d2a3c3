#!/usr/bin/env python3
"""Walks the README as a newcomer would: runs every command of its ```sh blocks (except the test
command, which CI runs itself, and `cargo install`, whose binary the tests already built) and
fails if one exits non-zero. `k3ring` is the binary `cargo test --release` built. Also fails if
a Markdown file of the repository links outside the repository.

Usage: python3 .ci/readme-walk.py [path/to/k3ring]
"""
import os
import re
import shlex
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
# Commands CI runs by itself, or that would build the binary a second time.
SKIP = ("cargo test", "cargo install")


def sh_commands(markdown):
    """The commands of the ```sh blocks, one per line (comments and blank lines left out)."""
    out = []
    for block in re.findall(r"```sh\n(.*?)```", markdown, re.S):
        for line in block.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def outside_links():
    """Markdown links (and the model contract's old path) that point outside the repository."""
    bad = []
    for dirpath, dirnames, files in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in (".git", "target") and not d.startswith(".")]
        for name in files:
            if not name.endswith(".md"):
                continue
            path = os.path.join(dirpath, name)
            with open(path, encoding="utf-8") as f:
                text = f.read()
            for target in re.findall(r"\]\(([^)\s]+)\)", text):
                if re.match(r"[a-z]+:", target) or target.startswith("#"):
                    continue
                resolved = os.path.normpath(os.path.join(dirpath, target.split("#")[0]))
                if not resolved.startswith(ROOT + os.sep) and resolved != ROOT:
                    bad.append(f"{os.path.relpath(path, ROOT)}: link to {target}")
            if "shared/docs/" in text:
                bad.append(f"{os.path.relpath(path, ROOT)}: names a file outside the repository (shared/docs/)")
    return bad


def main():
    binary = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "target/release/k3ring"))
    if not os.access(binary, os.X_OK):
        sys.exit(f"readme-walk: no k3ring binary at {binary}; build it first (cargo build --release)")
    bindir = os.path.join(ROOT, "target", "readme-walk-bin")
    os.makedirs(bindir, exist_ok=True)
    link = os.path.join(bindir, "k3ring")
    if os.path.lexists(link):
        os.remove(link)
    os.symlink(binary, link)
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
    env.pop("RUST_LOG", None)
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        commands = sh_commands(f.read())
    failed = []
    for cmd in commands:
        if cmd.startswith(SKIP):
            print(f"readme-walk: skip  {cmd}", flush=True)
            continue
        started = time.monotonic()
        r = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], cwd=ROOT, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        took = time.monotonic() - started
        print(f"readme-walk: rc {r.returncode} in {took:.1f} s  {cmd}", flush=True)
        if r.returncode != 0:
            failed.append(cmd)
            print(r.stdout[-2000:] + r.stderr[-4000:], flush=True)
    bad = outside_links()
    for b in bad:
        print(f"readme-walk: {b}", flush=True)
    if failed or bad:
        sys.exit(f"readme-walk: {len(failed)} command(s) failed, {len(bad)} link(s) outside the repository")
    print(f"readme-walk: {len(commands)} commands walked, every link inside the repository")


if __name__ == "__main__":
    main()
