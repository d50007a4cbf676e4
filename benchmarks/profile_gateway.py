"""Where one gateway process's time goes under load: py-spy on it while the Envoy-shaped
driver of ``extproc_throughput.py`` sends ``--rate`` requests/s of ``--tokens``-token prompts
(32 documents, a quarter of each prompt its own) for ``--seconds``; prints the CPU per
request and the top frames by own and inclusive share of the samples.

    pip install py-spy
    python benchmarks/profile_gateway.py --tokens 56320 --rate 60 --seconds 15
    python benchmarks/profile_gateway.py --noop          # the no-op ext_proc server instead
    python benchmarks/profile_gateway.py --kb 220 --rate 150 --seconds 30 --hz 1000
                                          # scaling.py's prompts (the CPU bar's workload)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from cachepilot.tooling.procs import wait_http_ok
from cachepilot.tooling.stack import free_port

sys.path.insert(0, str(Path(__file__).parent))
from extproc_throughput import Driver, bodies_for, cpu_seconds, wait_port


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=56320)
    ap.add_argument("--rate", type=float, default=60)
    ap.add_argument("--seconds", type=float, default=15)
    ap.add_argument("--kb", type=float, default=0,
                    help="profile scaling.py's prompts of this size instead (4 documents, 95 %% "
                         "of the prompt, and a tail of their own: the CPU bar's workload)")
    ap.add_argument("--noop", action="store_true")
    ap.add_argument("--no-observe", action="store_true")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--hz", type=int, default=250, help="py-spy's samples a second")
    args = ap.parse_args()
    spy_bin = (shutil.which("py-spy", path=str(Path(sys.executable).parent))
               or shutil.which("py-spy"))
    if spy_bin is None:
        sys.exit("needs py-spy: pip install py-spy")
    tmp = Path(tempfile.mkdtemp(prefix="cachepilot-profile-"))
    wports = [free_port() for _ in range(2)]
    here = Path(__file__).parent
    procs = [subprocess.Popen([sys.executable, str(here / "extproc_throughput.py"),
                               "--serve-metrics", *map(str, wports)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)]
    gport, aport = free_port(), free_port()
    argv = ([sys.executable, str(here / "added_latency.py"), "--serve-noop", str(gport),
             "127.0.0.1:1", "aio"] if args.noop else
            [sys.executable, "-m", "cachepilot", "gateway", "--listen", f"127.0.0.1:{gport}",
             "--admin-port", str(aport), "--workers",
             ",".join(f"127.0.0.1:{p}" for p in wports), "--engine", "vllm",
             *(["--no-observe-responses"] if args.no_observe else [])])
    gw = subprocess.Popen(argv, stdout=open(tmp / "gateway.log", "wb"),  # noqa: SIM115
                          stderr=subprocess.STDOUT)
    procs.append(gw)
    try:
        wait_port(gport)
        if not args.noop:
            wait_http_ok([f"http://127.0.0.1:{aport}/readyz"], hint=f"; logs in {tmp}")
        time.sleep(1.0)
        asyncio.run(drive(args, gport, gw.pid, spy_bin, tmp))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
    shares(tmp / "spy.txt", args.top)


async def drive(args: argparse.Namespace, port: int, pid: int, spy_bin: str,
                tmp: Path) -> None:
    drv = Driver([port], observe=not (args.noop or args.no_observe))
    if args.kb:
        from scaling import prompts
        bodies = prompts(args.kb, 64)
    else:
        bodies = bodies_for(args.tokens, 200)
    for b in bodies[:20]:
        await drv.one(b)
    spy = subprocess.Popen([spy_bin, "record", "-p", str(pid), "-r", str(args.hz), "-d",
                            str(int(args.seconds)), "-f", "raw", "-o", str(tmp / "spy.txt"),
                            "--nonblocking"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    await asyncio.sleep(0.5)
    cpu0 = cpu_seconds([pid])
    lat, errors, n, _ = await drv.step(bodies, args.rate, args.seconds)
    cpu = cpu_seconds([pid]) - cpu0
    print(f"{n} requests, {errors} errors, routing answer p50 {np.percentile(lat, 50):.2f} ms, "
          f"{cpu * 1000 / max(1, len(lat)):.2f} CPU ms a request")
    spy.wait()


def shares(path: Path, top: int) -> None:
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames, n = stack.split(";"), int(count)
        total += n
        own[frames[-1]] += n
        for f in set(frames):
            inclusive[f] += n
    print(f"{total} samples\n-- own share")
    for f, n in own.most_common(top):
        print(f"{100 * n / total:5.1f}% {f}")
    print("-- inclusive share")
    for f, n in inclusive.most_common(top * 2):
        print(f"{100 * n / total:5.1f}% {f}")


if __name__ == "__main__":
    main()
