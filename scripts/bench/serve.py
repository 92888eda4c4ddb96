#!/usr/bin/env python
"""Benchmark `omlx serve` against `mlx_lm.server` (or against itself with other settings) on
the same model, in the same run.

Why: `omlx serve` batches requests continuously over mlx-lm's BatchGenerator; the number
that matters is what N streaming clients get from it compared with stock mlx-lm's own
server on the same checkpoint and machine, as a ratio (absolute figures on the 2-core CI
CPU are noise-prone; the ratio from one run is what to compare).

How: the model is resolved once (`default` is the embedded SmolLM2-135M, imported from its
GGUF on first use) and both servers serve that one checkpoint directory: mlx_lm.server gets
its path, omlx gets the name as given (so its per-model settings apply, as for a user) and
`--max-concurrency` = `--concurrency`; mlx_lm.server keeps its defaults (decode concurrency
32). Each server is a subprocess on a free 127.0.0.1 port, logging to a file; once `/health`
answers 200 the workload runs through `omlx_core.bench.serving.run_serving` (the load
generator `omlx bench --url` uses), then the server is stopped (SIGTERM, SIGKILL after
--stop-timeout) before the other one starts: never both at once, so neither competes for
the cores. mlx_lm.server answers /health 200 before its model has loaded, so the warm-up
(the calibration request plus --warmup requests at --concurrency, not counted) also absorbs
the load. --warmup defaults to --concurrency, which runs every batch size before the clock
starts: on CUDA a fresh server compiles kernels for each new shape, and a measured level
that meets them first times those compiles (--warmup 1 at 32 streams on the H200: 1,027-1,620
tok/s, docs/benchmarks/serve-h200-qwen3-8b-shape-32-streams-decode-block-cold.json; an earlier
warm run of the same workload: 2,548).

`--set KEY=VALUE` gives the omlx server a setting (through its `OMLX_<KEY>` environment
variable, the layer above the settings files); `--against omlx` makes the baseline an omlx
server too, with the `--against-set` settings instead: an A/B of one setting, e.g.
`--against omlx --set server.prefill_batch=32`; a KEY named MLX_* is an MLX environment
variable, passed as it is (`--set MLX_CUDA_USE_CUDNN_SDPA=0`). `--against-src DIR` runs the
baseline omlx server from another checkout's code (DIR/src first on its PYTHONPATH): an A/B
of two commits, e.g. a branch extracted with `git archive BRANCH src kernels | tar -x -C DIR`.
Each omlx server's
`omlx_engine_step_seconds` (steps and seconds by phase: decode only, or with admissions'
prefill) is read from /metrics after its level: the warm-up's steps included. `--step-log`
runs the omlx servers at debug level, where the engine logs every step, and reports the
measured level's steps (the warm-up's left out): each step that admitted prompts (when,
milliseconds, sequences decoded, prompt tokens prefilled), the decode-only steps' count,
median and sum, and the wall time outside any step: where the level's time went (an older
baseline checkout that does not log steps reports none).

Every request streams `max_tokens` = --gen with `ignore_eos`; omlx honours it, mlx_lm.server
does not and may stop at EOS, so tokens are counted as each server reports them and the
table shows tokens per request: compare tok/s only where both reached --gen. Generation
tok/s is aggregate: completion tokens of all requests / wall time of the level. TTFT is the
first event with text, so on a model of random weights (the generated benchmark models, the
tests' tiny ones) its tail is not the server's: a sequence of byte tokens that never make
valid UTF-8 shows no text until its last token (3 of 64 greedy sequences of the tiny llama,
whose streams then arrive whole at the end).

Order: round r runs the two servers in the order --first, other when r is even and the
reverse when it is odd (A B, B A, A B, …), so slow drift (thermal, page cache, another job)
falls on both sides alike over an even number of rounds. Each figure is the median over
--rounds of the per-round figure (TTFT p50/p99 are medians of the per-round percentiles);
the ratio is median omlx tok/s / median baseline tok/s. On a fresh CUDA machine the first
server process also compiles what every later one finds in the disk caches (on an H100 its
prefill steps took 19.8 s against 7.9 s for the same server in the last round:
docs/benchmarks/serve-h100-qwen3-8b-shape-32-streams-prefill-batching.json): `--prime` runs
the first server once, unmeasured, before round 0.

    .venv/bin/python scripts/bench/serve.py [--model default] [--concurrency 8] [--requests 32]
        [--ctx 128] [--gen 64] [--rounds 1] [--prime] [--endpoint completions|chat]
        [--set KEY=VALUE ...] [--against mlx-lm|omlx] [--against-set KEY=VALUE ...] [--against-src DIR]
        [--step-log] [--json]
"""

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OMLX, MLX_LM, OMLX_BASELINE = "omlx", "mlx-lm", "omlx-baseline"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def omlx_command(home: Path, model: str, port: int, concurrency: int, log_level: str = "info") -> list[str]:
    script = Path(sys.executable).parent / "omlx"
    entry = [str(script)] if script.is_file() else \
        [sys.executable, "-c", "from omlx_cli.main import run; run()"]
    return entry + ["--home", str(home), "--log-level", log_level, "serve", "--model", model, "--host", "127.0.0.1",
                    "--port", str(port), "--max-concurrency", str(concurrency)]


def mlx_lm_command(path: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "mlx_lm.server", "--model", str(path), "--host", "127.0.0.1",
            "--port", str(port)]


def _tail(log: Path, lines: int = 30) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class Subprocess:
    """A server process on a loopback port: start, wait for /health 200, stop."""

    def __init__(self, name: str, command: list[str], port: int, log: Path, env: dict | None = None):
        self.name, self.command, self.port, self.log, self.env = name, command, port, log, env
        self.url = f"http://127.0.0.1:{port}"
        self.proc = None

    def start(self, timeout_s: float) -> float:
        import httpx

        started = time.perf_counter()
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env)
        last = "no answer"
        while time.perf_counter() - started < timeout_s:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name}: exited {self.proc.returncode} before /health "
                                 f"answered 200 ({last}); log {self.log}:\n{_tail(self.log)}")
            try:
                response = httpx.get(self.url + "/health", timeout=2.0)
                if response.status_code == 200:
                    return time.perf_counter() - started
                last = f"/health {response.status_code}: {response.text[:200]}"
            except httpx.HTTPError as error:
                last = type(error).__name__
            time.sleep(0.5)
        self.stop(5.0)
        raise SystemExit(f"{self.name}: /health not 200 after {timeout_s:.0f} s ({last}); "
                         f"log {self.log}:\n{_tail(self.log)}")

    def stop(self, timeout_s: float) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.terminate()
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def settings_env(pairs: list[str], flag: str) -> dict[str, str]:
    """`OMLX_<KEY>` variables for KEY=VALUE settings, each checked against the schema; an
    MLX environment variable (MLX_*, e.g. MLX_CUDA_USE_CUDNN_SDPA=0) passes as it is."""
    from omlx_core.errors import OmlxError
    from omlx_core.settings.schema import lookup

    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"{flag} {pair}: expected KEY=VALUE, e.g. server.prefill_batch=32")
        if key.startswith("MLX_"):
            env[key] = value.strip()
            continue
        try:
            setting = lookup(key.strip())
            setting.parse(value)
        except OmlxError as error:
            raise SystemExit(f"{flag} {pair}: {error}") from None
        env[setting.env_name] = value.strip()
    return env


SLOW_STEP = "0.25"  # a histogram bucket of omlx_engine_step_seconds: steps above it are stalls (compiles)


def engine_steps(url: str) -> dict:
    """Steps, seconds and steps over SLOW_STEP s by phase from an omlx server's /metrics
    (empty if it has none)."""
    import httpx

    steps: dict = {}
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return steps
    for line in text.splitlines():
        if not line.startswith("omlx_engine_step_seconds_"):
            continue
        series, value = line.rsplit(" ", 1)
        phase = series.split('phase="', 1)[1].split('"', 1)[0]
        found = steps.setdefault(phase, {})
        if series.startswith("omlx_engine_step_seconds_sum"):
            found["seconds"] = float(value)
        elif series.startswith("omlx_engine_step_seconds_count"):
            found["steps"] = float(value)
        elif f'le="{SLOW_STEP}"' in series:
            found["fast"] = float(value)
    for found in steps.values():
        found["slow"] = found.get("steps", 0) - found.pop("fast", 0)
    return steps


STEP_LINE = re.compile(r": (prefill|decode) step at ([\d.]+): ([\d.]+) ms, (\d+) sequences decoded, "
                       r"(\d+) prompt tokens prefilled")


def step_log(log: Path, window: list[float]) -> dict | None:
    """The engine steps an omlx server logged at debug level (--step-log) that began within
    the measured level's `window` (the client's monotonic clock, which a local server's
    shares): each step that admitted prompts (the engine's prefill phase: a prefill chunk or
    prompts joining) as [seconds into the level, ms, sequences decoded, prompt tokens
    prefilled], the decode-only steps' count and ms (median, p90, sum), and the ms of the
    level that no step took (the engine between steps, or idle). None where the server logged
    no step at all (a checkout from before the engine logged them)."""
    start, end = window
    prefill, decode = [], []
    matches = list(STEP_LINE.finditer(log.read_text(errors="replace")))
    if not matches:
        return None
    for match in matches:
        at, ms, decoded, tokens = float(match[2]), float(match[3]), int(match[4]), int(match[5])
        if not start <= at <= end:
            continue
        if match[1] == "prefill":
            prefill.append([round(at - start, 3), ms, decoded, tokens])
        else:
            decode.append(ms)
    decode.sort()
    busy = sum(ms for _, ms, _, _ in prefill) + sum(decode)
    return {"prefill_steps": prefill,
            "decode_steps": {"count": len(decode), "median_ms": statistics.median(decode) if decode else None,
                             "p90_ms": decode[int(0.9 * (len(decode) - 1))] if decode else None,
                             "sum_ms": round(sum(decode), 1)},
            "outside_steps_ms": round((end - start) * 1000 - busy, 1)}


def run_one(name: str, command: list[str], port: int, log: Path, workload, args,
            settings: dict | None = None) -> dict:
    from omlx_core.bench.serving import Server, run_serving

    server = Subprocess(name, command, port, log, os.environ | settings if settings else None)
    steps = {}
    try:
        print(f"{name}: starting on port {port}", file=sys.stderr)
        startup = server.start(args.startup_timeout)
        print(f"{name}: /health 200 after {startup:.1f} s; {workload.requests} requests, "
              f"{args.concurrency} concurrent", file=sys.stderr)
        document = run_serving(Server(server.url, None, None, args.endpoint, args.timeout),
                               workload, _progress(name) if not args.quiet else None)
        if name != MLX_LM:
            steps = engine_steps(server.url)
    finally:
        code = server.stop(args.stop_timeout)
    result = document["results"][0]
    logged = step_log(log, result["window_s"]) if args.step_log and name != MLX_LM else None
    print(f"{name}: {result['generation_tps'] or 0:.2f} tok/s, {result['completed']}/"
          f"{result['requests']} done, stopped (exit {code})", file=sys.stderr)
    return {"server": name, "command": command, "settings": settings or {}, "startup_s": round(startup, 2),
            "exit_code": code, "log": str(log), "result": result, "engine_steps": steps, "step_log": logged,
            "document": document}


def _progress(name: str):
    shown = {"at": 0.0}

    def report(done: int, total: int, what: str) -> None:
        now = time.perf_counter()
        if what or done == total or now - shown["at"] > 10:
            shown["at"] = now
            print(f"{name}: {done}/{total} {what}".rstrip(), file=sys.stderr)

    return report


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(runs: list[dict], gen: int) -> dict:
    results = [run["result"] for run in runs]
    return {
        "generation_tps": _median(r["generation_tps"] for r in results),
        "request_throughput_rps": _median(r["request_throughput_rps"] for r in results),
        "ttft_p50_s": _median(r["ttft_s"]["p50"] for r in results),
        "ttft_p99_s": _median(r["ttft_s"]["p99"] for r in results),
        "tpot_p50_s": _median(r["tpot_s"]["p50"] for r in results),
        "completion_tokens_mean": _median(r["completion_tokens_mean"] for r in results),
        "prompt_tokens_mean": _median(r["prompt_tokens_mean"] for r in results),
        "completed": sum(r["completed"] for r in results),
        "requests": sum(r["requests"] for r in results),
        "errors": {k: sum(r["errors"].get(k, 0) for r in results)
                   for k in sorted({k for r in results for k in r["errors"]})},
        "reached_gen": all((r["completion_tokens_mean"] or 0) >= gen for r in results),
        "startup_s": _median(run["startup_s"] for run in runs),
        "samples_tps": [r["generation_tps"] for r in results],
    }


def run(args) -> dict:
    from omlx_core.bench.serving import ServingWorkload
    from omlx_core.home import resolve_home
    from omlx_core.models.resolve import resolve

    home = resolve_home(args.home)
    ref = resolve(args.model, home)  # imports `default` from its GGUF on first use
    workload = ServingWorkload((args.ctx,), args.gen, (args.concurrency,), args.requests,
                               args.warmup, args.seed)
    logs = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="omlx-bench-serve-"))
    logs.mkdir(parents=True, exist_ok=True)
    baseline = baseline_name(args)
    settings = {OMLX: settings_env(args.set, "--set"), baseline: settings_env(args.against_set, "--against-set")}
    if args.against_src:
        settings[baseline]["PYTHONPATH"] = os.pathsep.join(
            [str(args.against_src / "src")] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    order = [OMLX, baseline] if args.first == OMLX else [baseline, OMLX]
    runs = {OMLX: [], baseline: []}
    sequence = []

    def level(name: str, log_name: str) -> dict:
        port = free_port()
        command = mlx_lm_command(ref.path, port) if name == MLX_LM \
            else omlx_command(home, args.model, port, args.concurrency, "debug" if args.step_log else "info")
        return run_one(name, command, port, logs / f"{log_name}.log", workload, args, settings[name])

    primed = None
    if args.prime:  # the first process on a fresh machine pays the disk caches' first compiles
        found = level(order[0], f"{order[0]}-prime")
        primed = {"server": found["server"], "generation_tps": found["result"]["generation_tps"],
                  "engine_steps": found["engine_steps"]}
    for round_ in range(args.rounds):
        for name in (order if round_ % 2 == 0 else order[::-1]):
            found = level(name, f"{name}-{round_}")
            found["round"] = round_
            runs[name].append(found)
            sequence.append(name)
    if not args.log_dir and not args.keep_logs:
        shutil.rmtree(logs, ignore_errors=True)

    summary = {name: summarize(found, args.gen) for name, found in runs.items()}
    ours, theirs = summary[OMLX]["generation_tps"], summary[baseline]["generation_tps"]
    ratio = ours / theirs if ours and theirs else None
    per_round = [a["result"]["generation_tps"] / b["result"]["generation_tps"]
                 if a["result"]["generation_tps"] and b["result"]["generation_tps"] else None
                 for a, b in zip(runs[OMLX], runs[baseline])]
    header = runs[OMLX][0]["document"]
    return {
        "benchmark": "serve", "created": header["created"], "versions": header["versions"],
        "hardware": header["hardware"],
        "model": {"ref": args.model, "name": ref.name, "path": str(ref.path)},
        "workload": {**workload.as_dict(), "endpoint": args.endpoint, "rounds": args.rounds},
        "baseline": baseline, "settings": settings,
        "order": sequence, "primed": primed,
        "summary": summary,
        "ratio_generation_tps": ratio,
        "ratio_per_round": per_round,
        "rounds": {name: [{k: v for k, v in run.items() if k != "document"} for run in found]
                   for name, found in runs.items()},
        "logs": str(logs) if args.log_dir or args.keep_logs else None,
    }


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.0f}"


def _num(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def final_line(report: dict) -> str:
    s, ratio, base = report["summary"], report["ratio_generation_tps"], report["baseline"]
    conc = report["workload"]["concurrency"][0]
    shown = "-" if ratio is None else f"{ratio:.2f}"
    return (f"omlx/{base} generation tok/s ratio: {shown}× (omlx {_num(s[OMLX]['generation_tps'])} "
            f"tok/s, {base} {_num(s[base]['generation_tps'])} tok/s, {conc} concurrent)")


def ttft_line(report: dict) -> str:
    s, base = report["summary"], report["baseline"]
    return (f"TTFT p50/p99: omlx {_ms(s[OMLX]['ttft_p50_s'])}/{_ms(s[OMLX]['ttft_p99_s'])} ms, "
            f"{base} {_ms(s[base]['ttft_p50_s'])}/{_ms(s[base]['ttft_p99_s'])} ms")


def baseline_name(args) -> str:
    return MLX_LM if args.against == MLX_LM else OMLX_BASELINE


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    w, s = report["workload"], report["summary"]
    title = (f"{report['model']['name']}: {w['concurrency'][0]} concurrent, {w['requests']} requests, "
             f"ctx {w['ctx'][0]}, gen {w['gen']}, {w['endpoint']}; median of {w['rounds']} "
             f"round{'s' if w['rounds'] > 1 else ''}")
    table = Table("server", "gen tok/s", "req/s", "TTFT ms p50", "TTFT ms p99", "TPOT ms p50",
                  "tokens/req", "prompt tok", "done", "errors", "startup s", title=title)
    for name in (OMLX, report["baseline"]):
        r = s[name]
        table.add_row(name, _num(r["generation_tps"]), _num(r["request_throughput_rps"], 3),
                      _ms(r["ttft_p50_s"]), _ms(r["ttft_p99_s"]), _ms(r["tpot_p50_s"]),
                      _num(r["completion_tokens_mean"], 1), _num(r["prompt_tokens_mean"], 0),
                      f"{r['completed']}/{r['requests']}",
                      ", ".join(f"{k}: {v}" for k, v in r["errors"].items()) or "0",
                      _num(r["startup_s"], 1))
    console = Console(width=None if sys.stdout.isatty() else 160)  # a pipe gets the whole table
    console.print(table)
    if w["rounds"] > 1:
        rounds = ", ".join(_num(x) for x in report["ratio_per_round"])
        console.print(f"per-round ratios: {rounds}; order {' '.join(report['order'])}", style="dim")
    for name in (OMLX, report["baseline"]):
        if report["settings"][name]:
            console.print(f"{name} settings: " + " ".join(f"{k}={v}" for k, v in report["settings"][name].items()),
                          style="dim")
        if not s[name]["reached_gen"]:
            console.print(f"note: {name} stopped before --gen {w['gen']} tokens on average "
                          f"({_num(s[name]['completion_tokens_mean'], 1)}/request)", style="yellow")
    console.print(f"{report['created']} · hardware {report['hardware']['fingerprint']} · "
                  f"omlx {report['versions']['omlx']}, mlx {report['versions']['mlx']}, "
                  f"mlx-lm {report['versions']['mlx_lm']} · {report['model']['path']}", style="dim")
    if report["primed"]:
        console.print(f"primed: {report['primed']['server']} ran once first, not counted "
                      f"({_num(report['primed']['generation_tps'])} tok/s)", style="dim")
    for name, found in report["rounds"].items():
        if found and found[-1]["engine_steps"]:
            console.print(engine_line(name, found[-1]["engine_steps"]), style="dim")
        if found and found[-1].get("step_log"):
            console.print(step_line(name, found[-1]["step_log"]), style="dim")
    print(ttft_line(report))
    print(final_line(report))


def engine_line(name: str, steps: dict) -> str:
    """One omlx server's engine steps by phase (its last round, the warm-up included)."""
    parts = [f"{int(s['steps'])} {phase} steps, {1000 * s.get('seconds', 0) / s['steps']:.1f} ms each, "
             f"{int(s['slow'])} over {float(SLOW_STEP) * 1000:.0f} ms"
             for phase, s in sorted(steps.items()) if s.get("steps")]
    return f"{name} engine (last round, warm-up included): " + "; ".join(parts)


def step_line(name: str, logged: dict) -> str:
    """One omlx server's logged steps of the measured level (--step-log, its last round)."""
    prefill, decode = logged["prefill_steps"], logged["decode_steps"]
    shown = ", ".join(f"{ms:.0f} ms/{tokens} tok" for _, ms, _, tokens in prefill)
    return (f"{name} steps of the level: {decode['count']} decode-only, {decode['sum_ms']:,.0f} ms (median "
            f"{_num(decode['median_ms'])}, p90 {_num(decode['p90_ms'])}); {len(prefill)} admitting, "
            f"{sum(ms for _, ms, _, _ in prefill):,.0f} ms: {shown}; outside steps {logged['outside_steps_ms']:,.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default",
                        help="a path, a name under $OMLX_HOME/models, or default (default)")
    parser.add_argument("--home", default=None, help="omlx home (default: $OMLX_HOME or ~/.omlx)")
    parser.add_argument("--concurrency", type=int, default=8, help="streaming clients (default 8)")
    parser.add_argument("--requests", type=int, default=32, help="measured requests per server per round")
    parser.add_argument("--ctx", type=int, default=128, help="prompt tokens (default 128)")
    parser.add_argument("--gen", type=int, default=64, help="max_tokens per request (default 64)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="uncounted requests before the measured ones (default --concurrency: every batch size "
                             "warm; 1 or 0 for a cold server)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    parser.add_argument("--rounds", type=int, default=1, help="A/B rounds, order alternating (default 1)")
    parser.add_argument("--prime", action="store_true",
                        help="first run the first server once, unmeasured (a fresh machine's first process "
                             "compiles what later ones find cached)")
    parser.add_argument("--first", choices=("baseline", OMLX), default="baseline",
                        help="which server runs first in round 0 (default the baseline)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of the omlx server (repeatable)")
    parser.add_argument("--against", choices=(MLX_LM, OMLX), default=MLX_LM,
                        help="the baseline: mlx_lm.server (default) or omlx with --against-set")
    parser.add_argument("--against-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of the baseline omlx server (repeatable; with --against omlx)")
    parser.add_argument("--against-src", type=Path, default=None, metavar="DIR",
                        help="run the baseline omlx server from the checkout DIR (its src/ first on PYTHONPATH; "
                             "with --against omlx)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--startup-timeout", type=float, default=300.0,
                        help="seconds to wait for /health 200")
    parser.add_argument("--stop-timeout", type=float, default=20.0,
                        help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("--log-dir", default=None, help="keep server logs here (default: a temp dir)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the temp dir of server logs")
    parser.add_argument("--step-log", action="store_true",
                        help="omlx servers log every engine step (debug level); the report gives the measured "
                             "level's admitting steps one by one, its decode-only steps summed")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    parser.add_argument("--json", action="store_true", help="print one JSON report")
    args = parser.parse_args()
    for flag in ("concurrency", "requests", "ctx", "gen", "rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag}: {getattr(args, flag)} is too small; use 1 or more")
    if args.warmup is None:
        args.warmup = args.concurrency
    if args.warmup < 0:
        parser.error(f"--warmup: {args.warmup} is too small; use 0 or more")
    if args.against_set and args.against != OMLX:
        parser.error("--against-set: the baseline is mlx_lm.server; add --against omlx")
    if args.against_src:
        if args.against != OMLX:
            parser.error("--against-src: the baseline is mlx_lm.server; add --against omlx")
        args.against_src = args.against_src.resolve()
        if not (args.against_src / "src" / "omlx_core").is_dir():
            parser.error(f"--against-src {args.against_src}: no src/omlx_core there; give a checkout's root")
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    failed = [name for name, r in report["summary"].items() if r["completed"] == 0]
    if failed:
        raise SystemExit(f"no request succeeded on {', '.join(failed)}; see the errors column")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
