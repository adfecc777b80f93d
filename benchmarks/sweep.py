"""Convert and check every timm architecture and every torchvision classifier.

    .venv/bin/python benchmarks/sweep.py --all                  # everything (make sweep): hours on one core
    .venv/bin/python benchmarks/sweep.py --sample               # the CI sample that tests/benchmarks/test_sweep.py runs
    .venv/bin/python benchmarks/sweep.py --models 'timm/resnet*' 'torchvision/vit_*'
    .venv/bin/python benchmarks/sweep.py --all --resume runs/sweep-20250101-120000.jsonl
    .venv/bin/python benchmarks/sweep.py --summarize runs/sweep-20250101-120000.jsonl

The checks (identity at init, shapes, finiteness, a gradient on every rank-1 parameter, original
Parameters and state_dict keys kept) live in ``benchmarks/_sweep_checks.py``, shared with the
test. Models run in shards, each in a worker subprocess with one torch thread: the parent kills a
worker whose current model runs past ``--timeout`` seconds or whose resident memory passes
``--max-rss-gib``, records that model, and starts a fresh worker for the rest of the shard, so one
huge model or a crash cannot take the run down. Models with more than ``--max-params`` parameters
(counted on the meta device) are skipped before they are built.

Each model is one JSON line in ``runs/sweep-<time>.jsonl`` (git-ignored): model, family, status
(pass/fail/skip), check (which promise failed), reason, input size, params original / added,
overhead %, seconds. At the end a summary is printed: passed / tried per source, failures
grouped by reason, median parameter overhead, and ResNet-50's parameter count at K=4.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _sweep_checks as checks  # noqa: E402

BEGIN, RESULT = "@@sweep-begin ", "@@sweep-result "


# ---- worker: runs a shard of models, one line of JSON per model ---------------------------------


def worker(options: dict) -> None:
    import torch

    torch.set_num_threads(1)
    specs = [line.strip() for line in sys.stdin if line.strip()]
    for spec in specs:
        print(BEGIN + spec, flush=True)
        record = checks.timed_check(spec, components=options["components"], max_params=options["max_params"])
        print(RESULT + json.dumps(record), flush=True)


# ---- parent: shards, guards, results file -------------------------------------------------------


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker's own process group (start_new_session)
    except ProcessLookupError:
        pass
    proc.wait()


def run_shard(shard: list[str], args: argparse.Namespace, emit, log) -> list[str]:
    """Run ``shard`` in one worker; return the specs it did not get to (after a kill or crash)."""
    options = json.dumps({"components": args.components, "max_params": int(args.max_params)})
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, __file__, "--worker", options],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    proc.stdin.write("\n".join(shard) + "\n")
    proc.stdin.close()

    done: set[str] = set()
    current, started, peak = None, time.monotonic(), 0
    limit = args.max_rss_gib * 2**30
    while True:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            line = ""
        if line is None:  # the worker exited
            proc.wait()
            if current is not None:
                code = proc.returncode
                why = f"signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"exit code {code}"
                emit(_record(current, "fail", "error:crash", f"worker died while running it: {why}", started))
                done.add(current)
            break
        if line.startswith(BEGIN):
            current, started, peak = line[len(BEGIN) :].strip(), time.monotonic(), 0
            continue
        if line.startswith(RESULT):
            record = json.loads(line[len(RESULT) :])
            record["peak_rss_gib"] = round(peak / 2**30, 2)
            emit(record)
            done.add(record["model"])
            current = None
            continue
        if current is None:
            continue
        rss = _rss_bytes(proc.pid)
        peak = max(peak, rss)
        if rss > limit:
            _kill(proc)
            emit(_record(current, "skip", "guard:memory", f"memory guard: worker RSS {rss / 2**30:.1f} GiB > {args.max_rss_gib} GiB", started))
            done.add(current)
            break
        if time.monotonic() - started > args.timeout:
            _kill(proc)
            emit(_record(current, "skip", "guard:timeout", f"timeout: still running after {args.timeout:.0f} s", started))
            done.add(current)
            break
    return [s for s in shard if s not in done]


def _record(spec: str, status: str, check: str, reason: str, started: float) -> dict:
    return {
        "model": spec,
        "family": checks.family(spec),
        "status": status,
        "check": check,
        "components": None,
        "reason": reason,
        "seconds": round(time.monotonic() - started, 2),
    }


def select(args: argparse.Namespace) -> list[str]:
    if args.sample:
        specs = []
        for spec in checks.ci_sample():
            if spec.startswith("timm-family/"):
                spec = checks.pick_from_family(
                    spec, checks.CI_MAX_PARAMS, checks.ci_excluded, fallback_max_params=checks.CI_FAMILY_MAX_PARAMS
                )[0]
            elif (checks.meta_parameter_count(spec) or 0) > checks.CI_MAX_PARAMS:
                spec = None  # the test skips these: over the size filter
            if spec is not None:
                specs.append(spec)
        return specs
    specs = checks.list_specs()
    if args.models:
        specs = [s for s in specs if any(fnmatch.fnmatchcase(s, p) for p in args.models)]
    # stable-hash order: any prefix of the run already spans many families
    return sorted(specs, key=checks.stable_hash)


def sweep(args: argparse.Namespace) -> Path:
    out = Path(args.resume) if args.resume else ROOT / "runs" / time.strftime("sweep-%Y%m%d-%H%M%S.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    specs = select(args)
    if args.sample:  # the CI sample's size filter applies to torchvision models too, as in the test
        args.max_params = min(args.max_params, checks.CI_FAMILY_MAX_PARAMS)
    seen = set()
    if args.resume and out.exists():
        latest = {}
        for line in out.open():
            if line.strip():
                record = json.loads(line)
                latest[record["model"]] = record["status"]
        seen = {model for model, status in latest.items() if status not in (args.redo or [])}
    todo = [s for s in specs if s not in seen]
    print(f"sweep: {len(todo)} models to run ({len(seen)} already in {out}), K={args.components}, "
          f"timeout {args.timeout:.0f} s, max {args.max_rss_gib} GiB RSS, max {args.max_params / 1e6:.0f}M params", flush=True)
    counts: Counter = Counter()
    start = time.monotonic()
    with out.open("a") as results, out.with_suffix(".log").open("a") as log:

        def emit(record: dict) -> None:
            results.write(json.dumps(record) + "\n")
            results.flush()
            counts[record["status"]] += 1
            n = sum(counts.values())
            if record["status"] != "pass" or args.verbose:
                print(f"[{n}/{len(todo)}] {record['status']:4} {record['model']} ({record['seconds']} s) "
                      f"{record.get('reason', '')[:160]}", flush=True)
            elif n % 25 == 0:
                print(f"[{n}/{len(todo)}] {dict(counts)} {time.monotonic() - start:.0f} s", flush=True)

        pending = list(todo)
        while pending:
            shard, pending = pending[: args.shard_size], pending[args.shard_size :]
            while shard:
                shard = run_shard(shard, args, emit, log)
    return out


# ---- summary ------------------------------------------------------------------------------------


def _reason_key(record: dict) -> str:
    reason = record.get("reason") or ""
    reason = re.sub(r"\[[a-z]+\] ", "", reason)
    reason = re.sub(r"[-+]?\d[\d.e+-]*", "N", reason)  # numbers vary, the kind of failure does not
    reason = re.sub(r"'[^']*'", "'…'", reason)
    return f"{record.get('check') or record['status']}: {reason[:110]}"


def resnet50_counts(components: int = 4) -> dict[str, tuple[int, int]]:
    """ResNet-50 parameters original -> converted at K=components (paper: 25.6M -> 26.0M at K=4)."""
    import timm
    import torchvision

    import bayesify

    counts = {}
    for label, build in (("torchvision", lambda: torchvision.models.resnet50()), ("timm", lambda: timm.create_model("resnet50"))):
        model = build()
        before = sum(p.numel() for p in model.parameters())
        bayesify.convert(model, components=components)
        counts[label] = (before, sum(p.numel() for p in model.parameters()))
    return counts


def summarize(path: Path, with_resnet: bool = True) -> None:
    records = {}
    for line in path.open():
        if line.strip():
            record = json.loads(line)
            records[record["model"]] = record  # a resumed run's later line wins
    records = list(records.values())
    print(f"\n=== sweep summary: {path} ===")
    for source in ("timm", "torchvision"):
        rs = [r for r in records if r["model"].startswith(source + "/")]
        by = Counter(r["status"] for r in rs)
        tried = by["pass"] + by["fail"]
        print(f"{source:12} passed {by['pass']} / tried {tried}  (skipped {by['skip']}, listed {len(rs)})")
    failures = defaultdict(list)
    skips = defaultdict(list)
    for r in records:
        if r["status"] == "fail":
            failures[_reason_key(r)].append(r["model"])
        elif r["status"] == "skip":
            skips[_reason_key(r)].append(r["model"])
    for title, groups in (("failures", failures), ("skips", skips)):
        if groups:
            print(f"{title} by reason:")
            for key, models in sorted(groups.items(), key=lambda kv: -len(kv[1])):
                examples = ", ".join(models[:4]) + (", ..." if len(models) > 4 else "")
                print(f"  {len(models):4}  {key}\n        e.g. {examples}")
    passed = [r for r in records if r["status"] == "pass"]
    bypassed = [r["model"] for r in passed if r.get("bypassed_layers")]
    if bypassed:
        print(f"passed with layers reported as bypassed by summary(): {len(bypassed)}, e.g. {', '.join(bypassed[:5])}")
    for source in ("timm", "torchvision", ""):
        rs = [r["overhead_pct"] for r in passed if r["model"].startswith(source)]
        if rs:
            ks = sorted({r.get("components") for r in passed})
            print(f"median parameter overhead ({source or 'all'}, K={ks}): {statistics.median(rs):.2f}% over {len(rs)} models")
    seconds = [r["seconds"] for r in records]
    if seconds:
        print(f"time: {sum(seconds) / 3600:.2f} h in models, median {statistics.median(seconds):.1f} s, max {max(seconds):.0f} s")
    if with_resnet:
        for label, (before, after) in resnet50_counts(4).items():
            print(f"ResNet-50 ({label}) K=4: {before:,} -> {after:,} parameters ({before / 1e6:.1f}M -> {after / 1e6:.1f}M; paper 25.6M -> 26.0M)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--all", action="store_true", help="every timm architecture and torchvision classifier")
    which.add_argument("--sample", action="store_true", help="the CI sample of tests/benchmarks/test_sweep.py")
    which.add_argument("--models", nargs="+", metavar="GLOB", help="specs matching these globs, e.g. 'timm/vit_*'")
    which.add_argument("--summarize", metavar="JSONL", help="only print the summary of a results file")
    which.add_argument("--worker", metavar="OPTIONS", help=argparse.SUPPRESS)
    parser.add_argument("--components", type=int, default=2, help="K of the conversion (default 2)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per model before its worker is killed")
    parser.add_argument("--max-rss-gib", type=float, default=12, help="worker memory before it is killed")
    parser.add_argument("--max-params", type=float, default=5e8, help="skip models with more parameters")
    parser.add_argument("--shard-size", type=int, default=40, help="models per worker process")
    parser.add_argument("--resume", metavar="JSONL", help="append to this results file, skipping models in it")
    parser.add_argument("--redo", nargs="+", choices=["fail", "skip"], help="with --resume: run these again")
    parser.add_argument("--no-resnet", action="store_true", help="leave the ResNet-50 count out of the summary")
    parser.add_argument("--verbose", action="store_true", help="print every model, not only failures")
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return
    if args.summarize:
        summarize(Path(args.summarize), with_resnet=not args.no_resnet)
        return
    if not (args.all or args.sample or args.models):
        parser.error("choose what to run: --all, --sample or --models GLOB...")
    summarize(sweep(args), with_resnet=not args.no_resnet)


if __name__ == "__main__":
    main()
